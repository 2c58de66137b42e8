"""Checkpoints: atomic, pickle-free, global keys, and resuming is bitwise invisible."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from torch import Tensor, nn

from adaptipe.models import ModelSpec, get_model
from adaptipe.runtime import checkpoint as ckpt
from adaptipe.runtime.checkpoint import CheckpointError
from adaptipe.runtime.config import OptimizerSection

SGD = OptimizerSection(name="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
ADAM = OptimizerSection(name="adam", lr=1e-2, weight_decay=1e-3)
ADAMW = OptimizerSection(name="adamw", lr=1e-2, weight_decay=1e-2)


def _spec() -> ModelSpec:
    return get_model("mlp", in_features=4, hidden=8, depth=4, out_features=2, num_samples=64)


def _meta(spec: ModelSpec) -> dict[str, Any]:
    return {"model": spec.name, "model_config": dict(spec.config), "num_layers": spec.num_layers}


def _layers(spec: ModelSpec, seed: int) -> list[nn.Module]:
    return [spec.build_layer(i, seed=seed) for i in range(spec.num_layers)]


def _train(
    spec: ModelSpec,
    layers: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    steps: range,
) -> None:
    data = spec.dataset()
    for step in steps:
        x, y = data.inputs[step * 8 : step * 8 + 8], data.targets[step * 8 : step * 8 + 8]
        for opt in optimizers:
            opt.zero_grad()
        for layer in layers:
            x = layer(x)
        spec.loss(x, y).backward()  # type: ignore[no-untyped-call]
        for opt in optimizers:
            opt.step()


def _save(
    root: Path,
    iteration: int,
    stages: list[list[int]],
    layers: list[nn.Module],
    owner: dict[int, torch.optim.Optimizer | None],
    spec: ModelSpec,
) -> Path:
    for stage, indices in enumerate(stages):
        tensors: dict[str, Tensor] = {}
        for i in indices:
            tensors.update(ckpt.layer_state(i, layers[i], owner[i]))
        meta = {"stage": stage, "layers": indices}
        ckpt.save_stage(root / f"iter-{iteration:06d}", stage=stage, tensors=tensors, meta=meta)
    return ckpt.commit(root, iteration=iteration, num_stages=len(stages), meta=_meta(spec))


def _state(layers: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for i, layer in enumerate(layers):
        for opt in optimizers:
            if any(
                p is q for q in layer.parameters() for g in opt.param_groups for p in g["params"]
            ):
                out.update(ckpt.layer_state(i, layer, opt))
    return out


def _assert_bitwise_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("optimizer", [SGD, ADAM, ADAMW], ids=["sgd-momentum", "adam", "adamw"])
def test_resume_is_bitwise_identical_to_not_stopping(tmp_path: Path, optimizer: Any) -> None:
    spec, k = _spec(), 3
    straight = _layers(spec, seed=0)
    opt = optimizer.build([p for layer in straight for p in layer.parameters()])
    _train(spec, straight, [opt], range(2 * k))

    first = _layers(spec, seed=0)
    opt1 = optimizer.build([p for layer in first for p in layer.parameters()])
    _train(spec, first, [opt1], range(k))
    _save(tmp_path, k, [list(range(spec.num_layers))], first, dict.fromkeys(range(4), opt1), spec)

    tensors, record = ckpt.load(tmp_path / f"iter-{k:06d}")
    assert record["iteration"] == k and record["num_stages"] == 1
    resumed = _layers(spec, seed=1)  # different initial weights: all must come from the file
    opt2 = optimizer.build([p for layer in resumed for p in layer.parameters()])
    for i, layer in enumerate(resumed):
        ckpt.load_layer_state(i, layer, opt2, tensors)
    _train(spec, resumed, [opt2], range(k, 2 * k))
    _assert_bitwise_equal(_state(resumed, [opt2]), _state(straight, [opt]))


@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_global_keys_load_into_a_different_split(tmp_path: Path, optimizer: Any) -> None:
    spec, k = _spec(), 2
    straight = _layers(spec, seed=0)
    opt = optimizer.build([p for layer in straight for p in layer.parameters()])
    _train(spec, straight, [opt], range(2 * k))

    # Saved as two stages [0, 2) and [2, 4), each with its own optimizer ...
    first = _layers(spec, seed=0)
    stage_opts = [
        optimizer.build([p for i in r for p in first[i].parameters()]) for r in ((0, 1), (2, 3))
    ]
    _train(spec, first, stage_opts, range(k))
    owner = {i: stage_opts[i // 2] for i in range(4)}
    _save(tmp_path, k, [[0, 1], [2, 3]], first, owner, spec)

    # ... loaded as [0, 1) and [1, 4) with one optimizer per layer.
    tensors, _ = ckpt.load(ckpt.latest(tmp_path) or tmp_path)
    assert all(key.split(".")[1] in "0123" for key in tensors)
    resumed = _layers(spec, seed=5)
    layer_opts = [optimizer.build(layer.parameters()) for layer in resumed]
    for i, layer in enumerate(resumed):
        ckpt.load_layer_state(i, layer, layer_opts[i], tensors)
    _train(spec, resumed, layer_opts, range(k, 2 * k))
    _assert_bitwise_equal(_state(resumed, layer_opts), _state(straight, [opt]))


def test_layer_state_keys_are_global_and_state_is_tensors() -> None:
    spec = _spec()
    layer = spec.build_layer(2, seed=0)
    opt = ADAM.build(layer.parameters())
    _train(
        spec,
        [spec.build_layer(i, seed=0) for i in (0, 1)] + [layer, spec.build_layer(3, seed=0)],
        [opt],
        range(1),
    )
    params = dict(layer.named_parameters())
    opt.state[params["linear.bias"]]["custom"] = 3.5  # a non-tensor value, as some optimizers keep
    state = ckpt.layer_state(2, layer, opt)
    assert set(state) == {
        "layers.2.linear.weight",
        "layers.2.linear.bias",
        *(
            f"optim.2.linear.{p}.{s}"
            for p in ("weight", "bias")
            for s in ("step", "exp_avg", "exp_avg_sq")
        ),
        "optim.2.linear.bias.custom",
    }
    custom = state["optim.2.linear.bias.custom"]
    assert custom.dim() == 0 and custom.dtype == torch.float64 and custom.item() == 3.5
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
    state["layers.2.linear.weight"].add_(1.0)  # copies: the live layer is untouched
    assert not torch.equal(state["layers.2.linear.weight"], params["linear.weight"])


def test_load_layer_state_names_missing_extra_and_misshapen_keys() -> None:
    spec = _spec()
    layer = spec.build_layer(1, seed=0)
    good = ckpt.layer_state(1, layer, None)
    with pytest.raises(CheckpointError, match=r"checkpoint has no layers\.1\.linear\.bias"):
        ckpt.load_layer_state(
            1, layer, None, {"layers.1.linear.weight": good["layers.1.linear.weight"]}
        )
    with pytest.raises(
        CheckpointError, match=r"layers\.1\.linear\.scale is not a tensor of layer 1"
    ):
        ckpt.load_layer_state(1, layer, None, {**good, "layers.1.linear.scale": torch.ones(1)})
    with pytest.raises(CheckpointError) as info:
        ckpt.load_layer_state(1, layer, None, {**good, "layers.1.linear.bias": torch.ones(3)})
    assert str(info.value) == (
        "checkpoint key layers.1.linear.bias has shape [3] but the model expects [8]"
    )
    opt = SGD.build(layer.parameters())
    bad = {**good, "optim.1.linear.weight.momentum_buffer": torch.ones(2, 2)}
    with pytest.raises(
        CheckpointError, match=r"momentum_buffer has shape \[2, 2\] but the model expects \[8, 8\]"
    ):
        ckpt.load_layer_state(1, layer, opt, bad)
    with pytest.raises(CheckpointError, match=r"optim\.1\.lin\.weight\.step names no parameter"):
        ckpt.load_layer_state(1, layer, opt, {**good, "optim.1.lin.weight.step": torch.tensor(1.0)})
    # Another layer's keys in the same mapping are not this layer's business.
    ckpt.load_layer_state(1, layer, opt, {**good, "layers.2.linear.weight": torch.ones(1)})


def test_save_stage_stores_meta_in_header_and_json(tmp_path: Path) -> None:
    meta = {"stage": 0, "layers": [0, 1]}
    path = ckpt.save_stage(
        tmp_path / "iter-000001", stage=0, tensors={"a": torch.ones(2)}, meta=meta
    )
    assert path == tmp_path / "iter-000001" / "stage-0.safetensors"
    with safetensors.safe_open(str(path), framework="pt") as fh:
        assert json.loads(fh.metadata()["adaptipe"]) == meta
    assert json.loads((path.parent / "stage-0.json").read_text()) == meta


def test_failed_rename_keeps_the_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "iter-000001"
    path = ckpt.save_stage(folder, stage=0, tensors={"w": torch.zeros(4)}, meta={"v": 1})
    before = path.read_bytes()

    def crash(src: Any, dst: Any) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.save_stage(folder, stage=0, tensors={"w": torch.ones(4)}, meta={"v": 2})
    assert path.read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == ["stage-0.json", "stage-0.safetensors"]
    assert json.loads((folder / "stage-0.json").read_text()) == {"v": 1}


def test_round_trip_commit_latest_and_load(tmp_path: Path) -> None:
    spec = _spec()
    layers = _layers(spec, seed=0)
    assert ckpt.latest(tmp_path) is None
    directory = _save(tmp_path, 10, [[0, 1], [2, 3]], layers, dict.fromkeys(range(4)), spec)
    assert directory == tmp_path / "iter-000010"
    assert ckpt.latest(tmp_path) == directory
    record = json.loads((directory / "COMMITTED.json").read_text())
    assert record["iteration"] == 10 and record["num_stages"] == 2
    assert record["meta"]["model"] == "mlp" and len(record["files"]) == 4
    tensors, loaded = ckpt.load(directory)
    assert loaded == record
    expected = {
        k: v for i, layer in enumerate(layers) for k, v in ckpt.layer_state(i, layer, None).items()
    }
    _assert_bitwise_equal(tensors, expected)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_are_created_as_the_umask_says(tmp_path: Path, umask: int) -> None:
    # mkstemp creates 0600 files whatever the umask: a run directory mixed private
    # checkpoints and JSON files with readable logs.
    from adaptipe.serial import write_json

    spec = _spec()
    old = os.umask(umask)
    try:
        layers = _layers(spec, seed=0)
        directory = _save(tmp_path, 10, [[0, 1], [2, 3]], layers, dict.fromkeys(range(4)), spec)
        write_json(tmp_path / "plain.json", {"a": 1})
        with (tmp_path / "opened.txt").open("w"):
            pass
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    files = [p for p in directory.iterdir() if p.is_file()]
    assert files and (tmp_path / "opened.txt").stat().st_mode & 0o777 == want
    for path in [*files, tmp_path / "plain.json"]:
        assert path.stat().st_mode & 0o777 == want, path


def test_commit_needs_every_stage(tmp_path: Path) -> None:
    spec = _spec()
    ckpt.save_stage(tmp_path / "iter-000005", stage=0, tensors={"a": torch.ones(1)}, meta={})
    with pytest.raises(CheckpointError, match=r"stage-1\.safetensors: missing"):
        ckpt.commit(tmp_path, iteration=5, num_stages=2, meta=_meta(spec))
    assert ckpt.latest(tmp_path) is None
    (tmp_path / "iter-000005" / "stage-1.safetensors").write_bytes(b"not safetensors")
    (tmp_path / "iter-000005" / "stage-1.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        ckpt.commit(tmp_path, iteration=5, num_stages=2, meta=_meta(spec))


def test_flipped_byte_is_detected_by_sha256(tmp_path: Path) -> None:
    spec = _spec()
    directory = _save(
        tmp_path, 3, [[0, 1, 2, 3]], _layers(spec, seed=0), dict.fromkeys(range(4)), spec
    )
    path = directory / "stage-0.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the tensor data: the file still parses, but is wrong
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"stage-0\.safetensors: corrupt \(sha256"):
        ckpt.load(directory)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"stage-0\.safetensors: missing"):
        ckpt.load(directory)


def test_uncommitted_folder_is_never_used(tmp_path: Path) -> None:
    spec = _spec()
    layers = _layers(spec, seed=0)
    good = _save(tmp_path, 10, [[0, 1, 2, 3]], layers, dict.fromkeys(range(4)), spec)
    ckpt.save_stage(tmp_path / "iter-000020", stage=0, tensors={"a": torch.ones(1)}, meta={})
    assert ckpt.latest(tmp_path) == good
    (tmp_path / "latest.json").unlink()  # even without the pointer, only committed ones count
    assert ckpt.latest(tmp_path) == good
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        ckpt.load(tmp_path / "iter-000020")


def test_checkpoint_for_another_model_or_config_is_rejected(tmp_path: Path) -> None:
    spec = _spec()
    directory = _save(
        tmp_path, 10, [[0, 1, 2, 3]], _layers(spec, seed=0), dict.fromkeys(range(4)), spec
    )
    _, record = ckpt.load(directory)
    ckpt.check_compatible(
        record, model="mlp", model_config=spec.config, num_layers=4, source=str(directory)
    )
    gpt = get_model("gpt")
    with pytest.raises(CheckpointError) as info:
        ckpt.check_compatible(
            record,
            model="gpt",
            model_config=gpt.config,
            num_layers=gpt.num_layers,
            source=str(directory),
        )
    assert (
        str(info.value)
        == f"checkpoint {directory} is for model 'mlp' but the config asks for 'gpt'"
    )
    deeper = {**spec.config, "depth": 6}
    with pytest.raises(CheckpointError, match=r"with depth=4 but the config asks for depth=6"):
        ckpt.check_compatible(record, model="mlp", model_config=deeper, num_layers=6, source="c")


def test_no_pickle_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle must not be used")

    for target, name in ((torch, "load"), (torch, "save"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(target, name, forbidden)
    spec = _spec()
    layers = _layers(spec, seed=0)
    opt = ADAM.build([p for layer in layers for p in layer.parameters()])
    _train(spec, layers, [opt], range(1))
    _save(tmp_path, 1, [[0, 1], [2, 3]], layers, dict.fromkeys(range(4), opt), spec)
    tensors, _ = ckpt.load(tmp_path / "iter-000001")
    fresh = _layers(spec, seed=1)
    fresh_opt = ADAM.build([p for layer in fresh for p in layer.parameters()])
    for i, layer in enumerate(fresh):
        ckpt.load_layer_state(i, layer, fresh_opt, tensors)


def test_prune_keeps_the_newest_and_the_latest(tmp_path: Path) -> None:
    spec = _spec()
    layers = _layers(spec, seed=0)
    for it in (1, 2, 3, 4, 5):
        _save(tmp_path, it, [[0, 1, 2, 3]], layers, dict.fromkeys(range(4)), spec)
    ckpt.save_stage(tmp_path / "iter-000000", stage=0, tensors={"a": torch.ones(1)}, meta={})
    removed = ckpt.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["iter-000000", "iter-000001", "iter-000002", "iter-000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter-000004",
        "iter-000005",
        "latest.json",
    ]
    ckpt.prune(tmp_path, keep=0)
    assert ckpt.latest(tmp_path) == tmp_path / "iter-000005"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-000005", "latest.json"]


def test_resumed_run_redoes_later_folders(tmp_path: Path) -> None:
    """After resuming from iter 2 while iter 3 exists, iter 3 is redone, never mixed."""
    spec = _spec()
    layers = _layers(spec, seed=0)
    for it in (1, 2, 3):
        _save(tmp_path, it, [[0, 1, 2, 3]], layers, dict.fromkeys(range(4)), spec)
    pointer = json.loads((tmp_path / "latest.json").read_text())
    (tmp_path / "latest.json").write_text(json.dumps({**pointer, "checkpoint": "iter-000002"}))
    assert ckpt.latest(tmp_path) == tmp_path / "iter-000002"
    assert [p.name for p in ckpt.prune(tmp_path, keep=1)] == ["iter-000001"]
    assert (tmp_path / "iter-000003").exists()  # past the pointer: left for the run to redo
    ckpt.save_stage(tmp_path / "iter-000003", stage=0, tensors={"a": torch.ones(1)}, meta={})
    assert not (tmp_path / "iter-000003" / "COMMITTED.json").exists()
    with pytest.raises(CheckpointError, match="refusing to overwrite the latest checkpoint"):
        ckpt.save_stage(tmp_path / "iter-000002", stage=0, tensors={}, meta={})
