"""PipeDream's partitioner: the DPs equal brute force under the dissertation's cost model."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptipe.errors import PlanError
from adaptipe.plan.pipedream import Level, plan_pipedream, plan_pipeline_stages, stage_memory_bytes
from adaptipe.profile.types import LayerProfile, Profile

FAST = settings(max_examples=60, deadline=None)


def layer(f: float, b: float, *, act: int = 0, params: int = 0, saved: int = 0) -> LayerProfile:
    return LayerProfile(
        name="l",
        kind="Linear",
        forward_s=f,
        backward_s=b,
        activation_bytes=act,
        gradient_bytes=act,
        saved_bytes=saved,
        param_bytes=params,
        optimizer_bytes=0,
        num_params=params // 4,
    )


def make(*layers: LayerProfile) -> Profile:
    return Profile(model="toy", microbatch=1, device="cpu", layers=layers)


@st.composite
def profiles(draw: st.DrawFn, max_layers: int = 8) -> Profile:
    n = draw(st.integers(2, max_layers))
    return make(
        *(
            layer(
                draw(st.integers(0, 12)) / 4,
                draw(st.integers(0, 12)) / 4,
                act=draw(st.integers(0, 40)),
                params=draw(st.integers(0, 40)),
                saved=draw(st.integers(0, 10)),
            )
            for _ in range(n)
        )
    )


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    return [
        tuple(b - a for a, b in itertools.pairwise((0, *cuts, total)))
        for cuts in itertools.combinations(range(1, total), parts - 1)
    ]


def flat_cost(p: Profile, bounds: tuple[int, ...], bandwidth: float) -> float:
    stages = [sum(x.compute_s for x in p.layers[a:b]) for a, b in itertools.pairwise(bounds)]
    comm = [2 * p.layers[b - 1].activation_bytes / bandwidth for b in bounds[1:-1]]
    return max(stages + comm)


def all_plans(
    p: Profile,
    levels: list[Level],
    k: int,
    i: int,
    j: int,
    m: int,
    *,
    replication: bool,
    limit: float,
) -> list[float]:
    """Cost of every nested plan of layers [i, j) on m level-k components (levels 1-based)."""
    if k == 0:
        fits = stage_memory_bytes(p, i, j, inflight=math.prod(lv.workers for lv in levels)) <= limit
        return [sum(x.compute_s for x in p.layers[i:j]) if fits else math.inf]
    lv = levels[k - 1]
    below = levels[k - 2].workers if k > 1 else 1
    out: list[float] = []
    for stages in range(1, min(j - i, m) + 1):
        for widths in compositions(j - i, stages):
            bounds = list(itertools.accumulate(widths, initial=i))
            for workers in compositions(m, stages):
                if not replication and any(w > 1 for w in workers):
                    continue
                options = []
                for (a, b), w in zip(itertools.pairwise(bounds), workers, strict=True):
                    sync = (
                        2 * (w - 1) * sum(x.param_bytes for x in p.layers[a:b]) / lv.bandwidth_Bps
                    )
                    subs = all_plans(
                        p, levels, k - 1, a, b, below, replication=replication, limit=limit
                    )
                    options.append([max(s, sync) / w for s in subs])
                comm = [
                    2 * p.layers[s - 1].activation_bytes / lv.bandwidth_Bps for s in bounds[1:-1]
                ]
                out.extend(max([*combo, *comm]) for combo in itertools.product(*options))
    return out


def brute(
    p: Profile, levels: list[Level], *, replication: bool = True, limit: float = math.inf
) -> float:
    plans = all_plans(
        p,
        levels,
        len(levels),
        0,
        p.num_layers,
        levels[-1].workers,
        replication=replication,
        limit=limit,
    )
    return min(plans, default=math.inf)


@FAST
@given(
    p=profiles(), stages=st.integers(1, 4), bandwidth=st.sampled_from([1.0, 4.0, 50.0, math.inf])
)
def test_pipeline_stages_equal_brute_force_and_recorded_cost(
    p: Profile, stages: int, bandwidth: float
) -> None:
    stages = min(stages, p.num_layers)
    part = plan_pipeline_stages(p, num_stages=stages, bandwidth_Bps=bandwidth)
    best = min(
        flat_cost(p, (0, *cuts, p.num_layers), bandwidth)
        for cuts in itertools.combinations(range(1, p.num_layers), stages - 1)
    )
    assert part.num_stages == stages and part.replicas == (1,) * stages
    assert part.predicted_s == pytest.approx(best, abs=1e-9)
    assert part.predicted_s == pytest.approx(flat_cost(p, part.bounds, bandwidth), abs=1e-9)


@FAST
@given(
    p=profiles(max_layers=5),
    workers=st.integers(1, 4),
    bandwidth=st.sampled_from([1.0, 8.0, math.inf]),
    replication=st.booleans(),
)
def test_one_level_dp_equals_brute_force_over_stages_and_replication(
    p: Profile, workers: int, bandwidth: float, replication: bool
) -> None:
    levels = [Level(workers, bandwidth)]
    best = brute(p, levels, replication=replication)
    if not replication and workers > p.num_layers:
        with pytest.raises(PlanError, match="workers <= layers"):
            plan_pipedream(p, levels=levels, replication=replication)
        return
    part = plan_pipedream(p, levels=levels, replication=replication)
    assert part.predicted_s == pytest.approx(best, abs=1e-9)
    assert sum(part.replicas) == workers
    # Recompute the cost of the returned stages and replicas from the dissertation's formulas.
    cost = []
    for s, r in enumerate(part.replicas):
        lay = p.layers[part.bounds[s] : part.bounds[s + 1]]
        sync = 2 * (r - 1) * sum(x.param_bytes for x in lay) / bandwidth
        cost.append(max(sum(x.compute_s for x in lay), sync) / r)
    cost += [2 * p.layers[b - 1].activation_bytes / bandwidth for b in part.bounds[1:-1]]
    assert part.predicted_s == pytest.approx(max(cost), abs=1e-9)
    assert part.meta["noam"] == math.ceil(workers / part.replicas[0])


@settings(max_examples=40, deadline=None)
@given(
    p=profiles(max_layers=4),
    inner=st.integers(1, 2),
    outer=st.integers(1, 2),
    fast=st.sampled_from([4.0, math.inf]),
    slow=st.sampled_from([0.5, 2.0]),
    limit=st.sampled_from([math.inf, 300.0, 150.0]),
    replication=st.booleans(),
)
def test_two_level_dp_equals_brute_force(
    p: Profile, inner: int, outer: int, fast: float, slow: float, limit: float, replication: bool
) -> None:
    levels = [Level(inner, fast), Level(outer, slow)]
    best = brute(p, levels, replication=replication, limit=limit)
    memory = None if limit == math.inf else limit
    if not math.isfinite(best):
        with pytest.raises(PlanError):
            plan_pipedream(p, levels=levels, replication=replication, memory_limit_bytes=memory)
        return
    part = plan_pipedream(p, levels=levels, replication=replication, memory_limit_bytes=memory)
    assert part.predicted_s == pytest.approx(best, abs=1e-9)
    assert sum(part.replicas) == inner * outer
    assert max(part.meta["stage_times"] + part.meta["boundary_times"]) == pytest.approx(
        part.predicted_s, abs=1e-9
    )
    assert all(m <= limit for m in part.meta["memory_bytes"])


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
def test_equal_layers_and_infinite_bandwidth_give_balanced_stages(stages: int) -> None:
    p = Profile.uniform(8, activation_bytes=1000)
    part = plan_pipeline_stages(p, num_stages=stages)
    assert {b - a for a, b in itertools.pairwise(part.bounds)} == {8 // stages}
    straight = plan_pipedream(p, levels=[Level(stages, math.inf)], replication=False)
    assert straight.bounds == part.bounds and straight.predicted_s == pytest.approx(
        3.0 * 8 / stages
    )


def test_dominant_layer_is_replicated_like_figure_2_7() -> None:
    # Stage 1 takes 2 + 4 time units, stage 2 takes 1 + 2: with 3 workers the first stage
    # runs on two replicas so both sustain one input per 3 units. Layer 1's large weights
    # make pure data parallelism pay for weight synchronisation.
    p = make(layer(2, 4), layer(1, 2, params=10))
    part = plan_pipedream(p, levels=[Level(3, 1.0)])
    assert part.bounds == (0, 1, 2) and part.replicas == (2, 1)
    assert part.predicted_s == pytest.approx(3.0)
    assert part.meta["noam"] == 2 and part.meta["stage_times"] == pytest.approx([3.0, 3.0])
    assert part.planner == "pipedream"


def test_memory_limit_excludes_stages_that_do_not_fit() -> None:
    # Two workers: each stage holds 2 in-flight micro-batches, so 200 bytes per layer.
    p = make(layer(2, 3, params=100), *(layer(0.5, 0.5, params=100) for _ in range(5)))
    assert stage_memory_bytes(p, 0, 1, inflight=2) == 200
    assert plan_pipeline_stages(p, num_stages=2).bounds == (0, 1, 6)
    part = plan_pipeline_stages(p, num_stages=2, memory_limit_bytes=800)
    assert part.bounds == (0, 2, 6) and part.predicted_s == pytest.approx(6.0)
    assert plan_pipedream(p, levels=[Level(2, math.inf)], memory_limit_bytes=800).bounds == (
        0,
        2,
        6,
    )
    with pytest.raises(
        PlanError,
        match=r"memory_limit_bytes=100\b.*smallest per-device requirement of any plan is 600 bytes",
    ):
        plan_pipeline_stages(p, num_stages=2, memory_limit_bytes=100)
    with pytest.raises(PlanError, match=r"memory_limit_bytes=100\b.*is 600 bytes"):
        # Six workers: the leanest plan puts one layer on each, holding 6 in-flight versions.
        plan_pipedream(p, levels=[Level(6, math.inf)], memory_limit_bytes=100)


@pytest.mark.parametrize("stages", [0, 9, -1])
def test_stage_count_outside_one_to_layers_is_rejected(stages: int) -> None:
    with pytest.raises(PlanError, match=rf"into {stages} stages \(allowed: 1\.\.8\)"):
        plan_pipeline_stages(Profile.uniform(8), num_stages=stages)


def test_bad_bandwidths_workers_and_limits_are_rejected() -> None:
    p = Profile.uniform(4)
    with pytest.raises(PlanError, match=r"bandwidth_Bps must be .*\(0, inf\] \(got -1"):
        plan_pipeline_stages(p, num_stages=2, bandwidth_Bps=-1.0)
    with pytest.raises(PlanError, match=r"Level.bandwidth_Bps .*\(got 0"):
        Level(2, 0.0)
    with pytest.raises(PlanError, match=r"Level.workers must be an integer >= 1 \(got 0\)"):
        Level(0, 1.0)
    with pytest.raises(PlanError, match="at least one"):
        plan_pipedream(p, levels=[])
    with pytest.raises(PlanError, match=r"memory_limit_bytes must be > 0 .*\(got -5"):
        plan_pipedream(p, levels=[Level(2, 1.0)], memory_limit_bytes=-5)
    with pytest.raises(PlanError, match="8 workers"):
        plan_pipedream(p, levels=[Level(8, 1.0)], replication=False)
