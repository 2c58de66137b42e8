"""The 2-stage held-out set is pinned like the 4-stage one: its manifest's digest is
fixed here (committed before the 2-stage switch policy was trained), its traces are
generated again bit for bit, and a stage count without a set is refused by name."""

from __future__ import annotations

import json

import pytest

from adaptipe.envs.heldout import (
    HELD_OUT_FAMILIES,
    HELD_OUT_SEED,
    MANIFEST,
    TRAINING_FAMILIES,
    heldout_traces,
    manifest_digest,
    manifest_for,
)
from adaptipe.errors import PlanError

MANIFEST_2_SHA256 = "5d6432dfec7dfb68ecc39d42e1fa7ff92b47e30d41d7aafe593f4b7dc49652c8"


def test_the_2_stage_manifest_is_the_committed_one() -> None:
    assert manifest_digest(manifest_for(2)) == MANIFEST_2_SHA256
    assert manifest_for(4) == MANIFEST


def test_every_2_stage_trace_is_generated_again_with_the_4_stage_families_and_seeds() -> None:
    path = manifest_for(2)
    traces = heldout_traces(path)
    data = json.loads(path.read_text())
    assert [t.digest() for t in traces] == [e["sha256"] for e in data["traces"]]
    assert {t.stages for t in traces} == {2}
    assert {t.family for t in traces} == {*TRAINING_FAMILIES, *HELD_OUT_FAMILIES}
    assert min(t.seed or 0 for t in traces) >= HELD_OUT_SEED
    four = json.loads(MANIFEST.read_text())["traces"]
    assert [(e["family"], e["seed"]) for e in data["traces"]] == [
        (e["family"], e["seed"]) for e in four
    ]


def test_a_stage_count_without_a_held_out_set_is_refused_with_the_ones_there_are() -> None:
    with pytest.raises(
        PlanError, match=r"no held-out set for 3 stages \(there are sets for 2, 4\)"
    ):
        manifest_for(3)


def test_eval_on_a_stage_count_without_a_held_out_set_says_which_there_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from adaptipe.cli import main

    assert main(["controllers", "eval", "--stages", "3", "--no-tune"]) != 0
    assert "no held-out set for 3 stages (there are sets for 2, 4)" in capsys.readouterr().err
