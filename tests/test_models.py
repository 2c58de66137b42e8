"""The model zoo: slice-independent initialisation, exact composition, training, datasets."""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from adaptipe.errors import PlanError
from adaptipe.models import MODEL_NAMES, Dataset, ModelSpec, get_model
from adaptipe.models.data import mix_seed
from adaptipe.models.gpt import ALPHABET, decode, encode

# Small configs keep the whole file fast on two CPU cores.
SMALL: dict[str, dict[str, Any]] = {
    "mlp": {"in_features": 16, "hidden": 32, "depth": 5, "out_features": 4, "num_samples": 256},
    "gpt": {"block_size": 16, "d_model": 32, "n_head": 2, "n_layer": 3},
    "cnn": {},
}
LEARNING_RATE = {"mlp": 0.05, "gpt": 0.1, "cnn": 0.02}


@pytest.fixture(params=MODEL_NAMES)
def spec(request: pytest.FixtureRequest) -> ModelSpec:
    name: str = request.param
    return get_model(name, **SMALL[name])


def params_of(module: nn.Module) -> dict[str, Tensor]:
    return {key: value.detach() for key, value in module.state_dict().items()}


def slices(n: int) -> list[tuple[int, int]]:
    return sorted({(0, n), (0, 1), (1, n), (n - 1, n), (1, min(3, n)), (n // 2, n), (2, n - 1)})


def test_registry_names_and_small_api() -> None:
    assert MODEL_NAMES == ("mlp", "gpt", "cnn")
    import adaptipe.models as models

    assert sorted(models.__all__) == sorted(["ModelSpec", "Dataset", "get_model", "MODEL_NAMES"])


def test_layer_names_and_kinds(spec: ModelSpec) -> None:
    names, kinds = spec.layer_names(), spec.layer_kinds()
    assert len(names) == len(kinds) == spec.num_layers >= 4
    assert len(set(names)) == len(names)
    expected_ends = {
        "mlp": ("Linear", "Linear"),
        "gpt": ("Embedding", "Head"),
        "cnn": ("Conv", "Linear"),
    }
    assert (kinds[0], kinds[-1]) == expected_ends[spec.name]


def test_slices_match_build_all(spec: ModelSpec) -> None:
    whole = params_of(spec.build_all(seed=7))
    for start, stop in slices(spec.num_layers):
        part = params_of(spec.build(start, stop, seed=7))
        names = spec.layer_names()[start:stop]
        assert part and {key.split(".")[0] for key in part} <= set(names)
        for key, value in part.items():
            assert torch.equal(value, whole[key]), (start, stop, key)


def test_seed_changes_every_layer(spec: ModelSpec) -> None:
    for index in range(spec.num_layers):
        a = params_of(spec.build_layer(index, seed=1))
        b = params_of(spec.build_layer(index, seed=2))
        assert any(not torch.equal(a[key], b[key]) for key in a), index
    first = params_of(spec.build_layer(1, seed=0))
    again = params_of(spec.build_layer(1, seed=0))
    assert all(torch.equal(first[key], again[key]) for key in first)


def test_build_leaves_global_rng_alone(spec: ModelSpec) -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    spec.build_all(seed=5)
    spec.dataset().sample_batch(4)
    assert torch.equal(torch.get_rng_state(), state)
    # ...and the global state does not leak into initialisation either.
    torch.manual_seed(999)
    reseeded = params_of(spec.build(0, 2, seed=5))
    reference = params_of(spec.build_all(seed=5))
    assert all(torch.equal(value, reference[key]) for key, value in reseeded.items())


def test_composed_slices_equal_whole_model(spec: ModelSpec) -> None:
    whole = spec.build_all(seed=3)
    inputs, _ = spec.dataset().sample_batch(4)
    with torch.no_grad():
        expected = whole(inputs)
        for cut in range(1, spec.num_layers):
            head = spec.build(0, cut, seed=3)
            tail = spec.build(cut, spec.num_layers, seed=3)
            assert torch.equal(tail(head(inputs)), expected), cut


def test_dtype_is_a_cast_of_the_float32_init(spec: ModelSpec) -> None:
    single = params_of(spec.build(0, 2, seed=4))
    double = params_of(spec.build(0, 2, seed=4, dtype=torch.float64))
    for key, value in double.items():
        assert value.dtype == torch.float64
        assert torch.equal(value, single[key].double())


def test_init_ignores_the_default_dtype_and_device_context(spec: ModelSpec) -> None:
    reference = params_of(spec.build(0, 2, seed=6))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            built = params_of(spec.build(0, 2, seed=6))
    finally:
        torch.set_default_dtype(previous)
    assert all(torch.equal(value, reference[key]) for key, value in built.items())


def test_meta_build_has_shapes_only(spec: ModelSpec) -> None:
    meta = spec.build_all(seed=0, device="meta")
    real = params_of(spec.build_all(seed=0))
    for key, value in params_of(meta).items():
        assert value.is_meta and value.shape == real[key].shape
    inputs = spec.dataset().sample_input(2)
    with torch.no_grad():
        expected = spec.build_all(seed=0)(inputs)
        output = meta(inputs.to("meta"))
    assert output.is_meta and output.shape == expected.shape


def test_a_meta_build_draws_nothing_and_leaves_dynamo_unimported() -> None:
    """On meta, ``normal_`` runs through ``torch._refs``, which imports ``torch._dynamo``:
    about 1.2 s of CPU a process (the manager's job-array check paid it at start-up)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from adaptipe.models import MODEL_NAMES, get_model\n"
        "for name in MODEL_NAMES:\n"
        "    spec = get_model(name)\n"
        "    for i in range(spec.num_layers):\n"
        "        spec.build_layer(i, seed=0, device='meta')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False", done.stderr


def test_sgd_trains(spec: ModelSpec) -> None:
    model = spec.build_all(seed=1)
    inputs, targets = spec.dataset().sample_batch(32, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE[spec.name], momentum=0.9)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = spec.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert loss.ndim == 0 and all(math.isfinite(value) for value in losses)
    assert losses[-1] < 0.75 * losses[0], losses


def test_dataset_shapes_and_dtypes(spec: ModelSpec) -> None:
    train, val = spec.dataset(), spec.dataset(split="val")
    assert isinstance(train, Dataset) and len(train) > len(val) > 0
    inputs, targets = train.batch([0, 1, 2])
    expected = {
        "mlp": ((3, 16), torch.float32, (3, 4), torch.float32),
        "gpt": ((3, 16), torch.int64, (3, 16), torch.int64),
        "cnn": ((3, 1, 8, 8), torch.float32, (3,), torch.int64),
    }[spec.name]
    assert (tuple(inputs.shape), inputs.dtype, tuple(targets.shape), targets.dtype) == expected
    assert val.inputs.shape[1:] == train.inputs.shape[1:]
    with pytest.raises(PlanError, match="allowed: train, val"):
        spec.dataset(split="test")  # type: ignore[arg-type]


def test_dataset_batch_returns_those_samples(spec: ModelSpec) -> None:
    data = spec.dataset()
    for indices in ([5, 0, 5], torch.tensor([len(data) - 1, 2])):
        inputs, targets = data.batch(indices)
        index = torch.as_tensor(indices)
        assert torch.equal(inputs, data.inputs[index]) and torch.equal(targets, data.targets[index])
    with pytest.raises(IndexError, match=r"\[0, "):
        data.batch([len(data)])


def test_batches_are_deterministic_per_seed_and_epoch(spec: ModelSpec) -> None:
    data = spec.dataset(split="val")

    def epoch(seed: int, number: int) -> list[tuple[Tensor, Tensor]]:
        return list(data.batches(16, seed=seed, epoch=number))

    first = epoch(0, 0)
    assert len(first) == len(data) // 16 == data.num_batches(16)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(first, epoch(0, 0), strict=True)
    )
    assert not torch.equal(first[0][0], epoch(0, 1)[0][0])
    assert not torch.equal(first[0][0], epoch(1, 0)[0][0])
    everything = list(data.batches(16, seed=0, drop_last=False))
    assert sum(len(batch[1]) for batch in everything) == len(data)


def test_spec_round_trips_through_json_and_pickle(spec: ModelSpec) -> None:
    config = json.loads(json.dumps(spec.config))
    assert get_model(spec.name, **config) == spec
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            params_of(clone.build_all(seed=2)).values(),
            params_of(spec.build_all(seed=2)).values(),
            strict=True,
        )
    )


def test_dataset_helpers() -> None:
    data = Dataset(torch.arange(10.0).unsqueeze(1), torch.arange(10), name="toy")
    assert torch.equal(
        data.sample_input(12).squeeze(1), torch.tensor([*range(10), 0, 1], dtype=torch.float32)
    )
    inputs, targets = data.sample_batch(10, seed=3)
    assert sorted(targets.tolist()) == list(range(10)) and torch.equal(
        inputs.squeeze(1).long(), targets
    )
    assert torch.equal(data.sample_batch(4, seed=3)[1], data.sample_batch(4, seed=3)[1])
    assert data.num_batches(4) == 2 and data.num_batches(4, drop_last=False) == 3
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        data.num_batches(0)
    with pytest.raises(ValueError, match="<= 10"):
        data.sample_batch(11)
    assert len({mix_seed(seed, index) for seed in range(20) for index in range(20)}) == 400


def test_gpt_corpus_is_printable_text() -> None:
    data = get_model("gpt", block_size=32).dataset()
    text = decode(data.inputs[0])
    assert len(ALPHABET) == 96 and len(text) == 32 and set(text) <= set(ALPHABET)
    assert torch.equal(data.inputs[:, 1:], data.targets[:, :-1])
    assert len(data) > 5_000  # hundreds of KB of real text
    assert decode(encode("hi\tthere\n")) == "hithere\n"


def test_benchmark_mlp_variant_builds() -> None:
    spec = get_model("mlp", hidden=1024, depth=16, in_features=1024, out_features=1024)
    model = spec.build_all(seed=0, device="meta")
    assert spec.num_layers == 16 and sum(p.numel() for p in model.parameters()) == 16 * (
        1024 * 1024 + 1024
    )


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("gtp", {}, r"unknown model 'gtp' \(allowed: mlp, gpt, cnn\)"),
        (
            "mlp",
            {"widht": 2},
            r"unknown config field 'widht' \(allowed: in_features, hidden, depth, out_features, num_samples\)",
        ),
        ("cnn", {"depth": 2}, r"unknown config field 'depth' \(allowed: width\)"),
        ("gpt", {"n_head": 3}, r"'n_head' must be one of 1, 2, 4, 8, 16, 32, 64, 128 \(got 3\)"),
        ("gpt", {"vocab_size": 50}, r"'vocab_size' must be one of 96"),
        ("mlp", {"depth": 1}, r"'depth' must be >= 2 \(got 1\)"),
        ("mlp", {"hidden": "256"}, r"'hidden' must be an int \(got '256'\)"),
        ("cnn", {"width": True}, r"'width' must be an int"),
        ("cnn", {"width": 0}, r"'width' must be >= 1"),
    ],
)
def test_bad_names_and_configs_raise_plan_error(
    name: str, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        get_model(name, **overrides)


def test_bad_layer_ranges_raise_plan_error() -> None:
    spec = get_model("cnn")
    with pytest.raises(PlanError, match=r"layer index must be an int in \[0, 5\] \(got 6\)"):
        spec.build_layer(6, seed=0)
    with pytest.raises(PlanError, match=r"stop must be an int in \[3, 6\] \(got 2\)"):
        spec.build(3, 2, seed=0)
    assert len(spec.build(2, 2, seed=0)) == 0
