"""PipeDream-2BW's planner against brute force: every (d, p, b, recompute) and every
cut of the layers, under the same cost model; and the memory limit's effect."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from adaptipe.errors import PlanError
from adaptipe.plan.twobw import _candidates, _Costs, config_cost, plan_2bw
from adaptipe.profile.types import LayerProfile, Profile


def _profile(seed: int, layers: int = 6) -> Profile:
    rng = random.Random(seed)
    return Profile(
        model="toy",
        microbatch=4,
        device="cpu",
        layers=tuple(
            LayerProfile(
                name=f"l{i}", kind="Linear",
                forward_s=rng.uniform(1e-3, 5e-3), backward_s=rng.uniform(2e-3, 1e-2),
                activation_bytes=rng.randrange(1, 64) * 4096, gradient_bytes=4096,
                saved_bytes=rng.randrange(1, 64) * 8192,
                param_bytes=rng.randrange(1, 256) * 4096, optimizer_bytes=0, num_params=1,
            )
            for i in range(layers)
        ),
    )  # fmt: skip


def _brute(profile: Profile, *, devices: int, memory: float, batch: int, bw: float) -> float:
    best = 0.0
    n = profile.num_layers
    for d in range(1, devices + 1):
        for p in range(1, devices // d + 1):
            for b in _candidates(batch):
                if batch % (d * b) or batch // (d * b) < p or p > n:
                    continue
                for r in (False, True):
                    costs = _Costs(profile, b, d, p, r, batch // (d * b), bw, bw)
                    for cuts in itertools.combinations(range(1, n), p - 1):
                        bounds = (0, *cuts, n)
                        rate, _, used = config_cost(costs, bounds)
                        if max(used) <= memory:
                            best = max(best, rate)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("memory_mib", [1.0, 2.5, 64.0])
def test_the_planner_matches_brute_force(seed: int, memory_mib: float) -> None:
    profile = _profile(seed)
    kw = {"devices": 4, "batch": 16, "bw": 2e8}
    want = _brute(profile, memory=memory_mib * 2**20, **kw)
    if want == 0.0:
        with pytest.raises(PlanError, match="no configuration"):
            plan_2bw(profile, devices=4, memory_limit_bytes=memory_mib * 2**20, batch_size=16,
                     bandwidth_Bps=2e8)  # fmt: skip
        return
    got = plan_2bw(profile, devices=4, memory_limit_bytes=memory_mib * 2**20, batch_size=16,
                   bandwidth_Bps=2e8)  # fmt: skip
    assert math.isclose(got.samples_per_s, want, rel_tol=1e-9)
    assert max(got.stage_bytes) <= memory_mib * 2**20
    assert got.width * got.depth <= 4 and got.accumulation * got.width * got.microbatch == 16
    assert got.accumulation >= got.depth
    assert got.partition.num_stages == got.depth and got.considered > 0


def test_less_memory_forces_recomputation_or_a_smaller_microbatch() -> None:
    from dataclasses import replace

    base = _profile(1)
    # activation stashes dominate, as in the dissertation's large models
    profile = replace(
        base, layers=tuple(replace(x, saved_bytes=x.saved_bytes * 50) for x in base.layers)
    )
    roomy = plan_2bw(profile, devices=4, memory_limit_bytes=2**40, batch_size=16, max_width=1)
    assert roomy.depth == 4 and not roomy.recompute  # no replication: deepest is fastest
    tight = max(roomy.stage_bytes) - 1
    squeezed = plan_2bw(profile, devices=4, memory_limit_bytes=tight, batch_size=16, max_width=1)
    assert max(squeezed.stage_bytes) <= tight
    changed = (squeezed.recompute, squeezed.microbatch, squeezed.partition.bounds)
    assert changed != (roomy.recompute, roomy.microbatch, roomy.partition.bounds)
    assert squeezed.samples_per_s <= roomy.samples_per_s * (1 + 1e-9)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(PlanError, match="devices"):
        plan_2bw(_profile(0), devices=0, memory_limit_bytes=1e9, batch_size=8)


def test_the_chosen_plan_trains_for_real(tmp_path: Path) -> None:
    """Profile the tiny MLP, let the planner choose for 2 devices without replication,
    and train what it chose with the 2bw schedule: it runs, and the config it prints
    is one adaptipe accepts."""
    import copy

    from adaptipe.profile.profiler import profile_model
    from adaptipe.runtime import train
    from adaptipe.runtime.config import RunConfig
    from tests.conftest import TINY_MLP

    data = copy.deepcopy(TINY_MLP)
    cfg = RunConfig.from_dict(data, source="tiny.toml")
    profile = profile_model(cfg.model.spec(), microbatch=4, warmup=1, repeats=3)
    chosen = plan_2bw(profile, devices=2, memory_limit_bytes=2**30, batch_size=16, max_width=1)
    assert chosen.depth == 2 and chosen.accumulation >= 2
    data["data"].update(batch_size=chosen.microbatch * chosen.accumulation,
                        microbatches=chosen.accumulation)  # fmt: skip
    data["pipeline"].update(stages=chosen.depth, schedule="2bw", recompute=chosen.recompute,
                            update_every=chosen.accumulation,
                            partition=list(chosen.partition.bounds))  # fmt: skip
    data["train"].update(iterations=3, run_dir=str(tmp_path / "run"))
    summary = train(RunConfig.from_dict(data, source="chosen.toml"))
    assert summary.iterations == 3 and summary.final_loss is not None
    assert math.isfinite(summary.final_loss)
