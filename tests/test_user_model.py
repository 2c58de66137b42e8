"""A user's model from a file outside the package: the stage contract (any layer built
anywhere from the seed alone), the Dataset adapter's order, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaptipe.errors import PlanError
from adaptipe.models.mapdata import MapDataset
from adaptipe.models.user import resolve_factory, user_model

HERE = Path(__file__).parent / "usermodel"


def _ref(name: str = "build") -> str:
    return resolve_factory(f"user_model.py:{name}", base=HERE)


def test_a_file_ref_is_made_absolute_and_a_missing_file_is_named() -> None:
    assert _ref().startswith(str(HERE.resolve()))
    with pytest.raises(PlanError, match="no file"):
        resolve_factory("nowhere.py:build", base=HERE)
    with pytest.raises(PlanError, match=r"package\.module:function"):
        resolve_factory("user_model.py", base=HERE)


def test_each_layer_depends_on_the_seed_and_its_index_only() -> None:
    spec = user_model(_ref(), width=8)
    assert spec.layer_names() == ["embed", "res0", "res1", "head"]
    whole = spec.build_all(seed=3)
    alone = spec.build(2, 4, seed=3)  # a stage that holds the last two layers
    for name, p in alone.named_parameters():
        assert torch.equal(p, whole.get_parameter(name)), name
    other = spec.build(2, 3, seed=4)
    assert not torch.equal(other.res1.inner[0].weight, alone.res1.inner[0].weight)
    # the two residual blocks are drawn under their own seeds, not copied
    assert not torch.equal(whole.res0.inner[0].weight, whole.res1.inner[0].weight)


def test_named_layer_factories_build_under_the_layers_seed() -> None:
    spec = user_model(_ref("build_factories"), width=8)
    a, b = spec.build_all(seed=0), spec.build_all(seed=0)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert spec.build_layer(1, seed=0).inner[0].weight.shape == (8, 8)


def test_the_dataset_reads_tuples_in_the_seeded_order_and_through_workers() -> None:
    spec = user_model(_ref(), width=8)
    data = spec.dataset(split="train")
    assert isinstance(data, MapDataset) and len(data) == 256
    first = list(data.batches(32, seed=5, epoch=1))
    again = list(data.batches(32, seed=5, epoch=1))
    assert len(first) == 8
    for (x, y), (x2, y2) in zip(first, again, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert first[0][1].dtype == torch.long and first[0][0].shape == (32, 8)
    other = next(iter(data.batches(32, seed=5, epoch=2)))
    assert not torch.equal(other[0], first[0][0])
    loaded = MapDataset(data.data, name="points", workers=2)
    for (x, y), (x2, y2) in zip(first, loaded.batches(32, seed=5, epoch=1), strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert len(spec.dataset(split="val")) == 64


def test_a_factory_without_validation_data_says_how_to_give_it() -> None:
    spec = user_model(_ref("build_factories"))
    with pytest.raises(PlanError, match="val_dataset"):
        spec.dataset(split="val")


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("build_unresettable", r"layer '1': parameter 's' .*reset_parameters"),
        ("build_shared", r"layers '0' and '1' share a parameter"),
        ("build_tuple_output", r"layer '1' returns a tuple"),
        ("nope", r"has no function 'nope'"),
    ],
)
def test_a_model_the_pipeline_cannot_run_is_refused_naming_the_layer(name: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        user_model(_ref(name))


def test_an_item_that_is_not_an_input_target_pair_is_refused() -> None:
    data = MapDataset([torch.zeros(3)] * 4, name="flat")
    with pytest.raises(PlanError, match="tuple of two"):
        data.batch([0, 1])
    with pytest.raises(PlanError, match="map-style"):
        MapDataset(iter([]), name="stream")
