"""Trained controllers on disk (`adaptipe.controllers.artifacts`): a round trip keeps
every byte and the training metadata; a missing, mismatched or tampered artifact is
refused with what is wrong and how to get a good one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptipe.controllers.artifacts import load_artifact, save_artifact
from adaptipe.errors import PlanError

FILES = {"weights.safetensors": b"\x00\x01weights", "config.json": b'{"hidden": 32}'}


def _save(root: Path) -> Path:
    return save_artifact(
        root, model="predictor", format=2, files=FILES, training={"seed": 3}, metrics={"mape": 0.04}
    )


def test_an_artifact_round_trips(tmp_path: Path) -> None:
    art = load_artifact(_save(tmp_path / "a"), model="predictor", format=2)
    assert dict(art.files) == FILES and art.training == {"seed": 3}
    assert art.metrics == {"mape": 0.04} and art.json("config.json") == {"hidden": 32}
    assert art.created.endswith("Z")


def test_a_tampered_file_is_refused(tmp_path: Path) -> None:
    root = _save(tmp_path / "a")
    (root / "weights.safetensors").write_bytes(b"\x00\x01weightz")
    with pytest.raises(PlanError, match=r"weights.safetensors: sha256 .* changed after training"):
        load_artifact(root, model="predictor", format=2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda root: (root / "config.json").unlink(), r"config.json is missing"),
        (lambda root: (root / "artifact.json").unlink(), r"no artifact.json: not a predictor"),
        (
            lambda root: (root / "artifact.json").write_text(
                json.dumps(json.loads((root / "artifact.json").read_text()) | {"format": 1})
            ),
            r"predictor format 1; this adaptipe reads format 2; retrain it with `adaptipe "
            r"controllers train predictor`",
        ),
        (
            lambda root: (root / "artifact.json").write_text(
                json.dumps(json.loads((root / "artifact.json").read_text()) | {"model": "switch"})
            ),
            r"a 'switch' artifact, not a 'predictor' one",
        ),
    ],
)
def test_a_missing_or_mismatched_artifact_is_refused(tmp_path: Path, change, message: str) -> None:  # type: ignore[no-untyped-def]
    root = _save(tmp_path / "a")
    change(root)
    with pytest.raises(PlanError, match=message):
        load_artifact(root, model="predictor", format=2)
