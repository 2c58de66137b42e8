"""Profiles and partitions are versioned JSON; bad files get errors naming file and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adaptipe import Partition, PlanError, Profile
from adaptipe.serial import load_json_file, write_json
from adaptipe.units import parse_bandwidth, parse_bytes


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    prof = Profile.uniform(5, forward_s=0.5, backward_s=1.0, activation_bytes=128, param_bytes=64)
    write_json(tmp_path / "p.json", prof.to_json())
    assert load_json_file(tmp_path / "p.json", Profile.from_json) == prof


def test_partition_round_trips_through_json(tmp_path: Path) -> None:
    part = Partition(
        model="m",
        num_layers=6,
        bounds=(0, 2, 6),
        replicas=(2, 1),
        planner="pipedream",
        predicted_s=0.1,
    )
    write_json(tmp_path / "x.json", part.to_json())
    assert load_json_file(tmp_path / "x.json", Partition.from_json) == part


def _profile_json() -> dict[str, Any]:
    return Profile.uniform(3).to_json()


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d.pop("layers"), "layers is missing"),
        (lambda d: d.update(layers=[]), "layers must not be empty"),
        (
            lambda d: d["layers"][1].update(forward_s=-1.0),
            "layers[1].forward_s must be a number >= 0.0",
        ),
        (
            lambda d: d["layers"][2].update(activation_bytes="big"),
            "layers[2].activation_bytes must be an integer",
        ),
        (lambda d: d.update(kind="partition"), "kind must be 'profile'"),
        (lambda d: d.update(version=99), "version 99 of profile is not supported"),
        (lambda d: d.update(microbatch=0), "microbatch must be >= 1"),
    ],
)
def test_malformed_profile_names_file_and_field(tmp_path: Path, mutate: Any, expected: str) -> None:
    data = _profile_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        load_json_file(path, Profile.from_json)
    assert str(path) in str(err.value)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        ([0, 2, 5], "end at num_layers=6 so every layer is covered"),
        ([1, 3, 6], "start at 0"),
        ([0, 3, 3, 6], "stage 1 is empty or reversed"),
        ([0], "at least 2 entries"),
        ([0, "3", 6], "bounds[1] must be an integer"),
    ],
)
def test_partition_that_does_not_cover_the_model_is_rejected(
    tmp_path: Path, bounds: list[Any], expected: str
) -> None:
    data = Partition.even(model="m", num_layers=6, num_stages=2).to_json()
    data["bounds"] = bounds
    data["replicas"] = []
    path = tmp_path / "part.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        load_json_file(path, Partition.from_json)
    assert str(path) in str(err.value) and expected in str(err.value)


def test_unparseable_json_names_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"kind": "profile",\n "version": }')
    with pytest.raises(PlanError, match=r"broken.json: not valid JSON \(line 2"):
        load_json_file(path, Profile.from_json)


def test_missing_file_is_a_plan_error(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="no such file"):
        load_json_file(tmp_path / "nope.json", Profile.from_json)


def test_even_partition_spreads_the_remainder_first() -> None:
    assert Partition.even(model="m", num_layers=7, num_stages=3).bounds == (0, 3, 5, 7)
    with pytest.raises(PlanError, match=r"allowed: 1..7"):
        Partition.even(model="m", num_layers=7, num_stages=8)


def test_partition_knows_which_stage_owns_a_layer() -> None:
    part = Partition(model="m", num_layers=5, bounds=(0, 2, 5))
    assert [part.stage_of(i) for i in range(5)] == [0, 0, 1, 1, 1]
    assert list(part.layers(1)) == [2, 3, 4]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e9", 1e9),
        ("10GB/s", 1e10),
        ("25Gbit/s", 25e9 / 8),
        ("100MBps", 1e8),
        ("inf", float("inf")),
    ],
)
def test_bandwidths_parse_with_units(text: str, value: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["fast", "10 furlongs/s", "-5", "0"])
def test_bad_bandwidths_say_what_is_allowed(text: str) -> None:
    with pytest.raises(PlanError, match="bandwidth"):
        parse_bandwidth(text)


def test_sizes_parse_with_binary_and_decimal_units() -> None:
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("512MB") == 512e6
    with pytest.raises(PlanError, match="examples"):
        parse_bytes("lots")


def test_strict_json_files_write_non_finite_floats_as_null(tmp_path: Path) -> None:
    # Run outputs (an active set's stopped jobs carry their last validation loss, NaN
    # for a diverged job) must parse in any JSON reader; plan files keep Python's
    # NaN / Infinity round trip.
    data = {"val_loss": float("nan"), "loads": [1.5, float("inf")]}
    write_json(tmp_path / "strict.json", data, strict=True)
    text = (tmp_path / "strict.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"val_loss": None, "loads": [1.5, None]}
    write_json(tmp_path / "plain.json", data)
    back = json.loads((tmp_path / "plain.json").read_text())
    assert back["loads"] == [1.5, float("inf")] and back["val_loss"] != back["val_loss"]
