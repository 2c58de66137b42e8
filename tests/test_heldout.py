"""The held-out set is pinned: the manifest's digest is fixed here, every trace it
lists is generated again and matches its sha256, and training never draws from it (by
seed and by family)."""

from __future__ import annotations

import json

from adaptipe.envs.gym_envs import PipelineSwitch
from adaptipe.envs.heldout import (
    HELD_OUT_FAMILIES,
    HELD_OUT_SEED,
    MANIFEST,
    TRAINING_FAMILIES,
    heldout_traces,
    manifest_digest,
)

# Committed with the manifest, before any controller was trained on these environments.
MANIFEST_SHA256 = "b5ab1806e97617de82337d96d2c2ce698f6266a6e32e8834ea336b9c8bee81b5"


def test_the_manifest_is_the_committed_one() -> None:
    assert manifest_digest() == MANIFEST_SHA256


def test_every_held_out_trace_is_generated_again_bit_for_bit() -> None:
    traces = heldout_traces()
    data = json.loads(MANIFEST.read_text())
    assert [t.digest() for t in traces] == [e["sha256"] for e in data["traces"]]
    families = {t.family for t in traces}
    assert families == {*TRAINING_FAMILIES, *HELD_OUT_FAMILIES}
    for family in families:
        seeds = sorted(t.seed or 0 for t in traces if t.family == family)
        assert len(seeds) >= 5 and min(seeds) >= HELD_OUT_SEED


def test_training_draws_neither_a_held_out_seed_nor_a_held_out_family() -> None:
    assert not set(HELD_OUT_FAMILIES) & set(TRAINING_FAMILIES)
    env = PipelineSwitch(trace_iterations=40)
    assert not set(env.families) & set(HELD_OUT_FAMILIES)
    for seed in range(5):
        env.reset(seed=seed)
        assert env.episode is not None
        trace = env.episode.trace
        assert trace.family in TRAINING_FAMILIES and (trace.seed or 0) < HELD_OUT_SEED
