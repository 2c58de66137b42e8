"""Run configs: TOML in, resolved frozen dataclasses out; every error names file and field."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptipe import Partition, PlanError
from adaptipe.runtime.config import RunConfig, load_config
from adaptipe.serial import write_json

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

FULL: dict[str, Any] = {
    "model": {"name": "mlp", "config": {"depth": 4, "hidden": 16, "num_samples": 100}},
    "data": {"batch_size": 8, "microbatches": 4, "split": "val", "seed": 5},
    "optimizer": {
        "name": "sgd",
        "lr": 0.1,
        "momentum": 0.9,
        "weight_decay": 1e-4,
        "nesterov": True,
    },
    "pipeline": {
        "stages": 2,
        "schedule": "1f1b",
        "recompute": True,
        "partition": [0, 1, 4],
        "bandwidth": "1GB/s",
    },
    "train": {
        "iterations": 10,
        "seed": 3,
        "device": "cpu",
        "threads_per_stage": 2,
        "checkpoint_every": 5,
        "keep_checkpoints": 2,
        "log_every": 2,
        "backend": "gloo",
        "timeout_s": 30.0,
        "run_dir": "somewhere/run",
    },
}


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return json.dumps(v) if isinstance(v, str) else repr(v)


def _toml(data: dict[str, Any]) -> str:
    """Enough of a TOML writer for config tables (tomllib only reads)."""
    lines = []
    for name, table in data.items():
        if not isinstance(table, dict):
            lines.append(f"{name} = {_value(table)}")
            continue
        lines.append(f"[{name}]")
        subs = {k: v for k, v in table.items() if isinstance(v, dict)}
        # TOML has no null: an absent key is how a file says None.
        lines += [f"{k} = {_value(v)}" for k, v in table.items() if k not in subs and v is not None]
        for sub, values in subs.items():
            lines.append(f"[{name}.{sub}]")
            lines += [f"{k} = {_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _write(tmp_path: Path, data: dict[str, Any], name: str = "x.toml") -> Path:
    path = tmp_path / name
    path.write_text(_toml(data))
    return path


def _minimal() -> dict[str, Any]:
    return {
        "model": {"name": "mlp", "config": {"depth": 4, "hidden": 16}},
        "data": {"batch_size": 8, "microbatches": 2},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "pipeline": {"stages": 2},
        "train": {"iterations": 4},
    }


def test_full_config_round_trips_through_to_dict(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, FULL))
    data = config.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert RunConfig.from_dict(data, source=config.source) == config
    # The resolved form is also a valid config file: it loads to the same config.
    assert load_config(_write(tmp_path, data, "again.toml")).to_dict() == data
    assert config.optimizer.nesterov and config.pipeline.partition == (0, 1, 4)
    assert config.data.microbatch_size == 2 and config.pipeline.bandwidth_Bps == 1e9


def test_defaults_are_filled_in(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, _minimal(), "demo.toml"))
    data = config.to_dict()
    assert data["model"]["config"] == {
        "in_features": 64,
        "hidden": 16,
        "depth": 4,
        "out_features": 8,
        "num_samples": 4096,
    }
    assert data["data"] == {
        "batch_size": 8, "microbatches": 2, "split": "train", "seed": 0, "loader_workers": 0
    }  # fmt: skip
    assert data["optimizer"]["betas"] == [0.9, 0.999] and data["optimizer"]["momentum"] == 0.0
    assert data["pipeline"] | {"stages": 2} == {
        "stages": 2,
        "schedule": "1f1b",
        "virtual": 1,
        "recompute": False,
        "batch_weight_grads": False,
        "partition": "even",
        "replicas": [],
        "vertical_sync": False,
        "update_every": None,
        "bandwidth": "inf",
    }
    train = config.train
    assert (train.seed, train.device, train.backend, train.log_every) == (0, "cpu", "gloo", 1)
    assert (train.checkpoint_every, train.timeout_s, train.run_dir) == (0, 60.0, "runs/demo")
    assert train.threads_per_stage == max(1, len(os.sched_getaffinity(0)) // 2)
    assert (train.telemetry, train.telemetry_interval_s, train.link_telemetry) == (True, 0.5, False)


def test_data_seed_defaults_to_train_seed(tmp_path: Path) -> None:
    data = _minimal()
    data["train"]["seed"] = 11
    assert load_config(_write(tmp_path, data)).data.seed == 11
    data["data"]["seed"] = 2
    assert load_config(_write(tmp_path, data)).data.seed == 2


def test_epochs_become_iterations_with_drop_last(tmp_path: Path) -> None:
    data = _minimal()
    data["train"] = {"epochs": 3}
    config = load_config(_write(tmp_path, data))
    assert config.train.iterations is None and config.train.epochs == 3
    assert config.iterations_total(100) == 3 * (100 // 8)
    with pytest.raises(PlanError, match=r"\[data\]\.batch_size must be <= the dataset's 5"):
        config.iterations_total(5)
    assert load_config(_write(tmp_path, _minimal())).iterations_total(100) == 4


def test_relative_partition_path_resolves_against_config_folder(tmp_path: Path) -> None:
    (tmp_path / "conf" / "plans").mkdir(parents=True)
    part = Partition(model="mlp", num_layers=4, bounds=(0, 3, 4), planner="dynpipe")
    write_json(tmp_path / "conf" / "plans" / "p.json", part.to_json())
    data = _minimal()
    data["pipeline"]["partition"] = "plans/p.json"
    config = load_config(_write(tmp_path / "conf", data))
    expected = str((tmp_path / "conf" / "plans" / "p.json").resolve())
    assert config.pipeline.partition == expected
    assert config.to_dict()["pipeline"]["partition"] == expected
    # from_dict elsewhere still finds it: the stored path is absolute.
    again = RunConfig.from_dict(config.to_dict(), source=str(tmp_path / "run" / "config.json"))
    assert again.pipeline.partition == expected


def test_optimizer_build_and_state_factor() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    sgd = load_optimizer({"name": "sgd", "lr": 0.1})
    assert isinstance(sgd.build(params), torch.optim.SGD) and sgd.state_bytes_factor() == 0
    momentum = load_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9})
    assert momentum.state_bytes_factor() == 1
    adamw = load_optimizer({"name": "adamw", "lr": 0.1, "betas": [0.8, 0.9]})
    built = adamw.build(params)
    assert isinstance(built, torch.optim.AdamW) and adamw.state_bytes_factor() == 2
    assert built.param_groups[0]["betas"] == (0.8, 0.9)
    assert built.param_groups[0]["foreach"] is False


def load_optimizer(table: dict[str, Any]) -> Any:
    data = _minimal()
    data["optimizer"] = table
    return RunConfig.from_dict(data).optimizer


@pytest.mark.parametrize("name", ["gpt-1f1b.toml", "mlp-gpipe.toml", "sweep-halving.toml"])
def test_example_configs_load(name: str) -> None:
    config = load_config(EXAMPLES / name)
    assert RunConfig.from_dict(config.to_dict(), source=config.source) == config


def test_example_configs_say_what_the_readme_says() -> None:
    gpt = load_config(EXAMPLES / "gpt-1f1b.toml")
    assert (gpt.model.name, gpt.pipeline.stages, gpt.pipeline.schedule) == ("gpt", 2, "1f1b")
    assert (gpt.data.microbatches, gpt.data.batch_size) == (4, 32)
    assert (gpt.optimizer.name, gpt.optimizer.lr) == ("adam", 3e-4)
    assert (gpt.train.iterations, gpt.train.checkpoint_every) == (200, 50)
    mlp = load_config(EXAMPLES / "mlp-gpipe.toml")
    assert (mlp.model.name, mlp.pipeline.stages, mlp.pipeline.schedule) == ("mlp", 2, "gpipe")
    assert mlp.pipeline.recompute and mlp.train.iterations == 100
    assert (mlp.optimizer.name, mlp.optimizer.momentum) == ("sgd", 0.9)


def _set(section: str, **values: Any) -> Any:
    def mutate(data: dict[str, Any]) -> None:
        data.setdefault(section, {}).update(values)

    return mutate


def _drop(section: str, key: str | None = None) -> Any:
    def mutate(data: dict[str, Any]) -> None:
        if key is None:
            del data[section]
        else:
            del data[section][key]

    return mutate


ERRORS = [
    (_set("optimizer", lr=-0.1), "[optimizer].lr must be > 0 (got -0.1)"),
    (
        _set("pipeline", schedule="zigzag"),
        "[pipeline].schedule must be one of gpipe, 1f1b, interleaved, pipedream, 2bw "
        "(got 'zigzag')",
    ),
    (
        _set("optimizer", lrr=0.1),
        "[optimizer].lrr is not a field "
        "(allowed: name, lr, momentum, weight_decay, nesterov, betas, eps, schedule, warmup, "
        "decay_iterations, min_lr_ratio, step_every, gamma, clip_grad_norm)",
    ),
    (
        _set("traning", iterations=3),
        "unknown section [traning] (allowed: model, data, optimizer, pipeline, train, sweep, adapt)",
    ),
    (_drop("data", "batch_size"), "[data].batch_size is missing"),
    (_drop("optimizer"), "[optimizer] is missing"),
    (_set("model", name="resnet"), "[model].name must be one of mlp, gpt, cnn (got 'resnet')"),
    (
        _set("model", config={"depht": 3}),
        "[model.config].depht is not a field "
        "(allowed: in_features, hidden, depth, out_features, num_samples)",
    ),
    (_set("model", config={"depth": 1}), "[model.config].depth must be >= 2 (got 1)"),
    (_set("data", microbatches=3), "[data].microbatches must divide batch_size 8 (got 3)"),
    (_set("data", microbatches=0), "[data].microbatches must be >= 1 (got 0)"),
    (_set("data", split="test"), "[data].split must be one of train, val (got 'test')"),
    (
        lambda d: (
            d["data"].update(batch_size=6, microbatches=3),
            d["pipeline"].update(schedule="interleaved", virtual=2),
        ),
        "[pipeline]: interleaved 1F1B needs microbatches to be a multiple of stages (got M=3, S=2)",
    ),
    (
        _set("pipeline", virtual=2),
        "[pipeline]: schedule '1f1b': chunks=2 needs the 'interleaved' schedule",
    ),
    (
        _set("pipeline", update_every=2),
        "[pipeline]: schedule '1f1b': update_every=2 is only allowed for the '2bw' schedule",
    ),
    (
        _set("pipeline", stages=5),
        "[pipeline].stages times virtual (5 x 1 = 5) must be <= the 4 layers of model 'mlp'",
    ),
    (
        _set("pipeline", partition=[0, 4, 8]),
        "[pipeline].partition: partition of 'mlp': bounds must start at 0 and end at num_layers=4",
    ),
    (
        _set("pipeline", partition=[0, 1, 2, 4]),
        "[pipeline].partition has 3 stages but stages x virtual = 2",
    ),
    (_set("pipeline", partition="zigzag"), "[pipeline].partition: "),
    (_set("pipeline", partition=7), "[pipeline].partition must be a planner (pipedream,"),
    (_set("pipeline", bandwidth="fast"), "[pipeline].bandwidth 'fast' is not a bandwidth"),
    (
        _set("optimizer", momentum=0.9),
        "[optimizer].momentum is only for sgd (got 0.9 with name = 'adam')",
    ),
    (
        _set("optimizer", nesterov=True),
        "[optimizer].nesterov is only for sgd (got True with name = 'adam')",
    ),
    (
        _set("optimizer", name="sgd", nesterov=True),
        "[optimizer].nesterov needs momentum > 0 (got momentum = 0.0)",
    ),
    (
        _set("optimizer", name="sgd", momentum=1.5),
        "[optimizer].momentum must be in [0, 1) (got 1.5)",
    ),
    (
        _set("optimizer", betas=[0.9, 1.0]),
        "[optimizer].betas must be two numbers in [0, 1) (got [0.9, 1.0])",
    ),
    (_set("optimizer", eps=0.0), "[optimizer].eps must be > 0 (got 0.0)"),
    (
        _set("train", epochs=2),
        "[train] needs exactly one of iterations or epochs (got both)",
    ),
    (
        _drop("train", "iterations"),
        "[train] needs exactly one of iterations or epochs (got neither)",
    ),
    (_set("train", iterations=0), "[train].iterations must be >= 1 (got 0)"),
    (_set("train", device="tpu"), "[train].device must be cpu, cuda or cuda:N (got 'tpu')"),
    (_set("train", backend="mpi"), "[train].backend must be one of auto, gloo, nccl (got 'mpi')"),
    (_set("train", backend="nccl"), "[train].backend 'nccl' needs a cuda device"),
    (_set("train", timeout_s=0), "[train].timeout_s must be > 0 (got 0.0)"),
    (_set("train", checkpoint_every=-1), "[train].checkpoint_every must be >= 0 (got -1)"),
    (_set("train", threads_per_stage=0), "[train].threads_per_stage must be >= 1 (got 0)"),
    (
        _set("train", telemetry_interval_s=0),
        "[train].telemetry_interval_s must be > 0 (got 0.0)",
    ),
    (
        _set("train", telemetry_interval_s=1.0),
        "[train].telemetry_interval_s must be between 0.1 and 0.5 seconds (got 1.0)",
    ),
    (
        _set("pipeline", schedule="pipedream", batch_weight_grads=True),
        "[pipeline].batch_weight_grads needs a synchronous schedule "
        "(gpipe, 1f1b, interleaved; got 'pipedream')",
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), ERRORS)
def test_bad_config_names_file_section_and_field(
    tmp_path: Path, mutate: Any, expected: str
) -> None:
    data = copy.deepcopy(_minimal())
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(PlanError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: {expected}"), str(info.value)


def test_error_message_has_the_documented_shape(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    data = _minimal()
    data["optimizer"]["lr"] = -0.1
    path = _write(tmp_path / "runs", data, "demo.toml")
    with pytest.raises(PlanError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: [optimizer].lr must be > 0 (got -0.1)"


def test_invalid_toml_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('[model]\nname = "mlp"\nfoo = = 3\n')
    with pytest.raises(PlanError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: not valid TOML (line 3, column 7: Invalid value)"
    with pytest.raises(PlanError, match="no such file"):
        load_config(tmp_path / "absent.toml")


def test_partition_file_must_cover_the_model_and_have_the_stage_count(tmp_path: Path) -> None:
    data = _minimal()
    data["pipeline"]["partition"] = "p.json"
    other = Partition(model="mlp", num_layers=6, bounds=(0, 3, 6))
    write_json(tmp_path / "p.json", other.to_json())
    path = _write(tmp_path, data)
    with pytest.raises(PlanError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: [pipeline].partition covers 6 layers of model 'mlp' but the config's "
        "model 'mlp' has 4"
    )
    write_json(
        tmp_path / "p.json", Partition.even(model="mlp", num_layers=4, num_stages=4).to_json()
    )
    with pytest.raises(
        PlanError, match=r"\[pipeline\]\.partition has 4 stages but stages x virtual = 2"
    ):
        load_config(path)


def test_cuda_device_without_cuda_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data = _minimal()
    data["train"]["device"] = "cuda:0"
    path = _write(tmp_path, data)
    with pytest.raises(PlanError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: [train].device is 'cuda:0' but torch.cuda.is_available() is false "
        "(allowed here: cpu)"
    )


@pytest.mark.parametrize(
    ("gpus", "device", "backend", "resolved"),
    [
        (2, "cuda", "auto", "nccl"),  # a GPU per stage
        (1, "cuda", "auto", "gloo"),  # two stages on one GPU: NCCL would refuse
        (4, "cuda:1", "auto", "gloo"),  # every stage on GPU 1
        (1, "cuda", "gloo", "gloo"),
        (1, "cpu", "auto", "gloo"),
    ],
)
def test_auto_backend_is_nccl_only_with_a_gpu_per_stage(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    device: str,
    backend: str,
    resolved: str,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    data = _minimal()
    data["train"] |= {"device": device, "backend": backend}
    assert load_config(_write(tmp_path, data)).train.backend == resolved


@pytest.mark.parametrize(
    ("gpus", "device", "shared"),
    [
        (1, "cuda", "2 stages on this host but torch sees 1 GPU;"),
        (2, "cuda:0", "all 2 stages would share"),
    ],
)
def test_nccl_with_stages_sharing_a_gpu_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int, device: str, shared: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    data = _minimal()
    data["train"] |= {"device": device, "backend": "nccl"}
    path = _write(tmp_path, data)
    with pytest.raises(PlanError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: [train].backend 'nccl' needs one GPU per stage ")
    assert shared in message and "use backend 'gloo'" in message, message


def test_nccl_counts_the_stages_of_this_host_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchrun over two hosts, one stage each: each host's single GPU is its stage's own.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    data = _minimal()
    data["train"] |= {"device": "cuda", "backend": "auto"}
    assert load_config(_write(tmp_path, data)).train.backend == "nccl"
    data["train"]["backend"] = "nccl"
    assert load_config(_write(tmp_path, data)).train.backend == "nccl"


def test_interleaved_virtual_stages_are_checked_against_layers(tmp_path: Path) -> None:
    data = _minimal()
    data["data"]["microbatches"] = 4
    data["pipeline"] |= {"schedule": "interleaved", "virtual": 2, "partition": [0, 1, 2, 3, 4]}
    config = load_config(_write(tmp_path, data))
    assert config.pipeline.virtual == 2
    data["pipeline"]["virtual"] = 3
    data["pipeline"]["partition"] = "even"
    data["data"] |= {"batch_size": 12, "microbatches": 6}
    with pytest.raises(PlanError, match=r"\(2 x 3 = 6\) must be <= the 4 layers"):
        load_config(_write(tmp_path, data))


def test_module_docstring_example_is_a_valid_config(tmp_path: Path) -> None:
    import adaptipe.runtime.config as module

    assert module.__doc__ is not None
    example = module.__doc__.split("::", 1)[1]
    path = tmp_path / "gpt.toml"
    path.write_text("\n".join(line[4:] for line in example.splitlines()))
    config = load_config(path)
    assert config.model.config["n_layer"] == 4 and config.train.keep_checkpoints == 3
