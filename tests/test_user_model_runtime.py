"""A user's model from a file outside the package (a residual block the zoo does not
have, a plain Dataset of tuples) trained through 2 stage processes: as a single job and
as a job-array, each job bitwise equal to the same job trained alone by adaptipe, and
within 1e-5 relative of a plain PyTorch loop with the same micro-batch split."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptipe.errors import PlanError
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from tests.conftest import final_state

FACTORY = Path(__file__).parent / "usermodel" / "user_model.py"
BASE: dict[str, Any] = {
    "model": {"factory": f"{FACTORY}:build", "config": {"width": 8, "blocks": 2}},
    "data": {"batch_size": 16, "microbatches": 2, "seed": 3},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "pipeline": {"stages": 2, "schedule": "1f1b"},
    "train": {"iterations": 4, "seed": 7, "threads_per_stage": 1, "timeout_s": 60},
}


def _config(tmp_path: Path, name: str, **over: dict[str, Any]) -> RunConfig:
    data = copy.deepcopy(BASE)
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value}
    data["train"]["run_dir"] = str(tmp_path / name)
    return RunConfig.from_dict(data, source=f"{name}.toml")


def _plain_loop(cfg: RunConfig, lr: float) -> dict[str, torch.Tensor]:
    """The model trained by hand: adaptipe's batches, each split into its micro-batches,
    the mean loss of each divided by their number, one SGD step per batch."""
    spec = cfg.model.spec()
    model = spec.build_all(seed=cfg.train.seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.optimizer.momentum)
    batches = spec.dataset(split="train").batches(cfg.data.batch_size, seed=cfg.data.seed or 0)
    m = cfg.data.microbatches
    for _, (x, y) in zip(range(cfg.train.iterations or 0), batches, strict=False):
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            (spec.loss(model(xs), ys) / m).backward()
        opt.step()
        opt.zero_grad()
    return {
        f"layers.{i}.{n}": p.detach()
        for i, layer in enumerate(model)
        for n, p in layer.named_parameters()
    }


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def _bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_single_job_trains_as_a_plain_loop_and_as_alone(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "single")
    assert (
        cfg.model.factory == f"{FACTORY.resolve()}:build" and cfg.model.name == "user_model:build"
    )
    summary = train(cfg)
    got = final_state(summary.run_dir, layers=True)
    again = final_state(train(_config(tmp_path, "again")).run_dir, layers=True)
    _bitwise(got, again)
    _close(got, _plain_loop(cfg, lr=0.05))


def test_loader_workers_read_the_same_batches(tmp_path: Path) -> None:
    plain = final_state(train(_config(tmp_path, "plain")).run_dir, layers=True)
    loaded = final_state(
        train(_config(tmp_path, "loaded", data={"loader_workers": 2})).run_dir, layers=True
    )
    _bitwise(loaded, plain)


@pytest.mark.slow  # 12 s; by default: a user model alone (above), zoo job-arrays as alone
def test_each_job_of_an_array_is_bitwise_its_own_run(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "array", data={"microbatches": 1})
    data = cfg.to_dict()
    data["sweep"] = {"grid": {"lr": [0.05, 0.1]}, "solver": "1f1b"}
    array = RunConfig.from_dict(data, source="array.toml")
    summary = train(array)
    for job in array.jobs:
        lr = job.optimizer.lr
        alone_cfg = _config(tmp_path, f"alone-{job.index}", data={"microbatches": 1},
                            optimizer={"lr": lr})  # fmt: skip
        alone = final_state(train(alone_cfg).run_dir, layers=True)
        _bitwise(final_state(summary.run_dir, job.index, layers=True), alone)
        _close(alone, _plain_loop(alone_cfg, lr=lr))


def test_a_factory_error_names_the_config(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["model"]["factory"] = f"{FACTORY}:build_shared"
    data["model"]["config"] = {}
    with pytest.raises(PlanError, match=r"bad\.toml: .*share a parameter"):
        RunConfig.from_dict(data, source="bad.toml")
    data["model"] = {"factory": f"{FACTORY}:build", "config": {"colour": 1}}
    with pytest.raises(PlanError, match=r"bad\.toml: \[model\.config\] does not fit"):
        RunConfig.from_dict(data, source="bad.toml")


def test_the_python_api_trains_a_config_built_in_code(tmp_path: Path) -> None:
    """docs/training.md's example: a config from tables, `prepare`, then `train`."""
    from adaptipe import runtime

    script = tmp_path / "my_script.py"
    (tmp_path / "my_model.py").write_text(FACTORY.read_text())
    tables = copy.deepcopy(BASE)
    tables["model"]["factory"] = "my_model.py:build"  # relative to the source's folder
    tables["optimizer"].update(schedule="cosine", warmup=2)
    tables["train"]["run_dir"] = str(tmp_path / "prepared")
    config = runtime.RunConfig.from_dict(tables, source=str(script))
    assert config.model.factory == f"{(tmp_path / 'my_model.py').resolve()}:build"
    run, _ = runtime.prepare(config)
    assert (run.root / "partition.json").exists()
    summary = runtime.train(config, run_dir=tmp_path / "trained")
    assert summary.iterations == 4 and summary.final_loss is not None


def test_the_example_sweep_reads_with_its_four_jobs() -> None:
    from adaptipe.runtime.config import parse_config

    example = Path(__file__).resolve().parent.parent / "examples" / "user-model" / "sweep.toml"
    cfg = parse_config(example)
    assert cfg.model.name == "digits_resnet:build"
    assert [(j.optimizer.lr, j.optimizer.warmup) for j in cfg.jobs] == [
        (0.001, 0), (0.001, 20), (0.003, 0), (0.003, 20),
    ]  # fmt: skip
    assert {j.optimizer.clip_grad_norm for j in cfg.jobs} == {1.0}
    assert cfg.model.spec().layer_names() == ["stem", "res0", "res1", "res2", "res3", "head"]


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        ("nowhere.py:build", r"\[model\]\.factory: no file"),
        ("user_model.py:missing", r"has no function 'missing'"),
        ("no_such_package.mod:build", r"importing failed"),
        ("user_model.py:build_wrong_type", r"must return \(layers, loss, dataset\)"),
        ("user_model.py:build_two_inputs", r"layer '1' failed on the previous layer's output"),
        ("user_model.py:build_words", r"item 0's input is a str"),
    ],
)
def test_a_bad_factory_names_the_file_and_the_field(
    tmp_path: Path, factory: str, match: str
) -> None:
    (tmp_path / "user_model.py").write_text(FACTORY.read_text())
    data = copy.deepcopy(BASE)
    data["model"] = {"factory": factory}
    with pytest.raises(PlanError, match=match) as info:
        RunConfig.from_dict(data, source=str(tmp_path / "bad.toml"))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'bad.toml'}: ") and "[model].factory" in message
