"""DynPipe's planner, staleness model, model condensation and the `plan` entry point."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptipe.errors import PlanError
from adaptipe.plan.api import PLANNERS, boundary_times, plan, stage_times
from adaptipe.plan.condense import condense
from adaptipe.plan.dynpipe import cycle_time, iteration_time, plan_dynpipe
from adaptipe.plan.pipedream import Level
from adaptipe.plan.staleness import StalenessModel, estimate_staleness_model
from adaptipe.profile.types import LayerProfile, Profile

FAST = settings(max_examples=60, deadline=None)


def layer(f: float, b: float, *, act: int = 0, grad: int = 0, params: int = 0) -> LayerProfile:
    return LayerProfile(
        name="l",
        kind="Linear",
        forward_s=f,
        backward_s=b,
        activation_bytes=act,
        gradient_bytes=grad,
        saved_bytes=act,
        param_bytes=params,
        optimizer_bytes=params,
        num_params=params // 4,
    )


def make(*layers: LayerProfile) -> Profile:
    return Profile(model="toy", microbatch=1, device="cpu", layers=layers)


@st.composite
def profiles(draw: st.DrawFn) -> Profile:
    n = draw(st.integers(2, 8))
    return make(
        *(
            layer(
                draw(st.integers(0, 12)) / 4,
                draw(st.integers(0, 12)) / 4,
                act=draw(st.integers(0, 40)),
                grad=draw(st.integers(0, 40)),
            )
            for _ in range(n)
        )
    )


def fold(p: Profile, bounds: tuple[int, ...], bws: list[float]) -> float:
    """Independent Eq. 4/5: merge stages from the input side, one cycle at a time."""
    stages = [
        sum(x.forward_s + x.backward_s for x in p.layers[a:b])
        for a, b in itertools.pairwise(bounds)
    ]
    total = stages[0]
    for s in range(1, len(stages)):
        a = bounds[s]
        c = (p.layers[a - 1].activation_bytes + p.layers[a].gradient_bytes) / bws[s - 1]
        b = stages[s]
        literal = (c + total + b) / 2 if b < total + c else b
        total = max(literal, total, b)
    return total


def optimum(p: Profile, stages: int, bws: list[float]) -> float:
    n = p.num_layers
    return min(
        fold(p, (0, *cuts, n), bws) for cuts in itertools.combinations(range(1, n), stages - 1)
    )


# --- Eq. 4 -------------------------------------------------------------------------------


def test_two_stage_cycle_case_1_averages_compute_and_communication() -> None:
    # A = 1 + 2, B = 1 + 1, c = (100 + 100) / 100 = 2; B < A + c: (2 + 3 + 2) / 2.
    p = make(layer(1, 2, act=100), layer(1, 1, grad=100))
    part = plan_dynpipe(p, num_stages=2, bandwidth_Bps=100.0)
    assert part.predicted_s == pytest.approx(3.5)
    assert part.meta["boundary_comm_s"] == pytest.approx([2.0])


def test_two_stage_cycle_case_2_is_the_last_stage() -> None:
    # A = 2, B = 6, c = (50 + 50) / 100 = 1; B >= A + c: the last stage sets the pace.
    p = make(layer(1, 1, act=50), layer(2, 4, grad=50))
    assert plan_dynpipe(p, num_stages=2, bandwidth_Bps=100.0).predicted_s == pytest.approx(6.0)


def test_cycle_never_undercuts_either_stage() -> None:
    # Eq. 4 taken literally gives (0 + 10 + 0) / 2 = 5 < 10, faster than stage 1 can compute.
    assert cycle_time(10.0, 0.0, 0.0) == 10.0
    assert cycle_time(3.0, 2.0, 2.0) == 3.5
    assert cycle_time(2.0, 1.0, 6.0) == 6.0


nums = st.floats(0, 100, allow_nan=False)


@given(a1=nums, a2=nums, c=nums, b=nums)
def test_cycle_time_is_non_decreasing_in_the_merged_stage(
    a1: float, a2: float, c: float, b: float
) -> None:
    lo, hi = sorted((a1, a2))
    assert cycle_time(lo, c, b) <= cycle_time(hi, c, b)


# --- the DP (Eq. 5) -----------------------------------------------------------------------


@FAST
@given(
    p=profiles(),
    stages=st.integers(1, 4),
    links=st.lists(st.sampled_from([1.0, 5.0, 20.0, math.inf]), min_size=3, max_size=3),
    per_boundary=st.booleans(),
)
def test_dp_equals_brute_force_and_recorded_cost(
    p: Profile, stages: int, links: list[float], per_boundary: bool
) -> None:
    stages = min(stages, p.num_layers)
    bws = links[: stages - 1] if per_boundary else [links[0]] * (stages - 1)
    bandwidth: float | list[float] = bws if per_boundary else links[0]
    part = plan_dynpipe(p, num_stages=stages, bandwidth_Bps=bandwidth)
    assert part.num_stages == stages and part.planner == "dynpipe"
    assert part.predicted_s == pytest.approx(optimum(p, stages, bws), abs=1e-9)
    assert part.predicted_s == pytest.approx(fold(p, part.bounds, bws), abs=1e-9)
    assert iteration_time(p, part.bounds, bandwidth) == pytest.approx(part.predicted_s, abs=1e-9)


# --- staleness (Eq. 2-3) and Algorithm 1 ----------------------------------------------------


def test_iterations_grow_with_stages_and_become_infinite() -> None:
    model = StalenessModel(f0=1.0, lr=0.1, epsilon=1.0, smoothness=1.0, grad_second_moment=5.0)
    assert model.iterations(1) == pytest.approx(2 / (0.1 * 0.9))
    assert model.iterations(2) == pytest.approx(2 / (0.1 * 0.2))
    assert model.iterations(1) < model.iterations(2)
    assert model.iterations(3) == math.inf  # 2 * 0.01 * 27 * 5 > epsilon
    with pytest.raises(PlanError, match=r"num_stages must be an integer >= 1 \(got 0\)"):
        model.iterations(0)


@pytest.mark.parametrize(
    ("field", "value"), [("lr", 0.0), ("f0", -1.0), ("epsilon", math.nan), ("smoothness", -0.5)]
)
def test_staleness_constants_are_validated(field: str, value: float) -> None:
    kw = dict(f0=1.0, lr=0.1, epsilon=1.0, smoothness=1.0, grad_second_moment=1.0)
    kw[field] = value
    with pytest.raises(PlanError, match=rf"StalenessModel\.{field} must be .*\(got {value}\)"):
        StalenessModel(**kw)


def test_stage_count_trades_iteration_time_against_staleness() -> None:
    p = make(layer(0.5, 0.5), layer(0.5, 0.5), layer(0.5, 0.5))
    # More stages is faster per iteration: W(1) = 3, W(2) = 2, W(3) = 1 ...
    noisy = StalenessModel(f0=1.0, lr=0.1, epsilon=1.0, smoothness=1.0, grad_second_moment=5.0)
    part = plan_dynpipe(p, staleness=noisy)
    cands = part.meta["candidates"]
    assert [c["iteration_s"] for c in cands] == pytest.approx([3.0, 2.0, 1.0])
    # ... but stale gradients cost more updates: 22.2 * 3 < 100 * 2 and S = 3 never converges.
    assert cands[0]["wall_clock_s"] == pytest.approx(3 * 2 / (0.1 * 0.9))
    assert cands[1]["wall_clock_s"] == pytest.approx(2 * 2 / (0.1 * 0.2))
    assert cands[2]["iterations"] is None and cands[2]["wall_clock_s"] is None
    assert part.num_stages == 1 and part.predicted_s == pytest.approx(3.0)
    quiet = StalenessModel(f0=1.0, lr=0.1, epsilon=1.0, smoothness=1.0, grad_second_moment=0.01)
    assert plan_dynpipe(p, staleness=quiet).num_stages == 3
    assert plan_dynpipe(p, staleness=quiet, max_stages=2).num_stages == 2


def test_stage_count_search_errors() -> None:
    p = Profile.uniform(4)
    with pytest.raises(PlanError, match="needs a StalenessModel"):
        plan_dynpipe(p)
    hopeless = StalenessModel(
        f0=1.0, lr=0.1, epsilon=0.01, smoothness=10.0, grad_second_moment=10.0
    )
    with pytest.raises(PlanError, match=r"epsilon=0\.01"):
        plan_dynpipe(p, staleness=hopeless)
    with pytest.raises(PlanError, match=r"need 3 values for 4 stages \(got 2\)"):
        plan_dynpipe(p, num_stages=4, bandwidth_Bps=[1.0, 2.0])


def test_estimate_recovers_smoothness_of_a_quadratic() -> None:
    smooth = 3.7
    rng = np.random.default_rng(0)
    w = rng.normal(size=10)
    weights, grads = [], []
    for _ in range(6):
        weights.append(w.copy())
        grads.append(smooth * w)  # f(w) = 0.5 L ||w||^2
        w = w - 0.05 * smooth * w + 0.01 * rng.normal(size=10)
    model = estimate_staleness_model(weights, grads, f0=1.0, lr=0.05, epsilon=0.1)
    assert model.smoothness == pytest.approx(smooth, rel=1e-12)
    assert model.grad_second_moment == pytest.approx(np.mean([g @ g for g in grads]), rel=1e-12)
    assert model.theorem_applies


def test_estimate_needs_two_changing_samples() -> None:
    w = np.ones(3)
    with pytest.raises(PlanError, match=r"at least 2 .*\(got 1\)"):
        estimate_staleness_model([w], [w], f0=1.0, lr=0.1, epsilon=1.0)
    with pytest.raises(PlanError, match=r"weights\[1\] equals weights\[0\]"):
        estimate_staleness_model([w, w], [w, 2 * w], f0=1.0, lr=0.1, epsilon=1.0)
    with pytest.raises(PlanError, match="2 weight samples but 3 gradient"):
        estimate_staleness_model([w, 2 * w], [w, w, w], f0=1.0, lr=0.1, epsilon=1.0)


# --- condensation (Algorithm 2) -----------------------------------------------------------


def test_condense_makes_blocks_that_end_at_the_heaviest_layers() -> None:
    p = make(
        layer(0.5, 0.5, grad=7),
        layer(2, 3, act=11),
        layer(0.5, 0.5, grad=13),
        layer(0.5, 0.5),
        layer(3, 4, act=17),
        layer(0.5, 0.5),
        layer(0.5, 0.5, act=19),
    )
    c = condense(p, 3)  # heaviest: layer 4 (7 s), layer 1 (5 s), then layer 0 (tie, earlier)
    assert c.block_bounds == (0, 1, 2, 7)  # the last block runs to the end of the model
    blocks = c.profile.layers
    assert [b.compute_s for b in blocks] == [1.0, 5.0, 11.0]
    assert [b.activation_bytes for b in blocks] == [0, 11, 19]
    assert [b.gradient_bytes for b in blocks] == [7, 0, 13]
    # Communication counts: at 1 B/s layer 6's output (1 s + 19 s) outranks layer 1 (5 s + 11 s).
    assert condense(p, 2).block_bounds == (0, 2, 7)
    assert condense(p, 2, bandwidth_Bps=1.0).block_bounds == (0, 5, 7)
    with pytest.raises(PlanError, match=r"top_k must be an integer >= 1 \(got 0\)"):
        condense(p, 0)


@FAST
@given(
    p=profiles(),
    top_k=st.integers(1, 9),
    stages=st.integers(1, 4),
    bandwidth=st.sampled_from([2.0, math.inf]),
)
def test_condensed_plan_is_valid_and_never_beats_the_full_dp(
    p: Profile, top_k: int, stages: int, bandwidth: float
) -> None:
    stages = min(stages, top_k, p.num_layers)
    part = plan_dynpipe(p, num_stages=stages, bandwidth_Bps=bandwidth, top_k=top_k)
    blocks = condense(p, top_k, bandwidth_Bps=bandwidth).block_bounds
    assert part.num_layers == p.num_layers and set(part.bounds) <= set(blocks)
    bws = [bandwidth] * (stages - 1)
    assert part.predicted_s == pytest.approx(fold(p, part.bounds, bws), abs=1e-9)
    best = optimum(p, stages, bws)
    assert part.predicted_s is not None and part.predicted_s >= best - 1e-9
    if top_k >= p.num_layers:
        assert part.predicted_s == pytest.approx(best, abs=1e-9)


def test_condensed_stage_count_is_bounded_by_blocks() -> None:
    with pytest.raises(PlanError, match=r"4 blocks .* into 5 stages \(allowed: 1\.\.4\)"):
        plan_dynpipe(Profile.uniform(8), num_stages=5, top_k=4)


# --- plan() and reporting -------------------------------------------------------------------


def test_plan_dispatches_every_planner() -> None:
    p = Profile.uniform(6, activation_bytes=10)
    assert PLANNERS == ("pipedream", "dynpipe", "even")
    assert plan(p, planner="even", num_stages=4).bounds == (0, 2, 4, 5, 6)
    assert plan(p, planner="pipedream", num_stages=3).bounds == (0, 2, 4, 6)
    assert (
        plan(p, planner="pipedream", num_stages=None, levels=[Level(2, 1e9)]).planner == "pipedream"
    )
    assert plan(p, planner="dynpipe", num_stages=2, bandwidth_Bps=[5.0]).planner == "dynpipe"


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("stages", [0, 7])
def test_plan_rejects_impossible_stage_counts(planner: str, stages: int) -> None:
    with pytest.raises(PlanError, match=rf"into {stages} stages \(allowed: 1\.\.6\)"):
        plan(Profile.uniform(6), planner=planner, num_stages=stages)


@pytest.mark.parametrize("planner", PLANNERS)
def test_plan_rejects_negative_bandwidth(planner: str) -> None:
    with pytest.raises(PlanError, match=r"bandwidth_Bps must be .*\(0, inf\] \(got -2"):
        plan(Profile.uniform(6), planner=planner, num_stages=2, bandwidth_Bps=-2.0)


def test_plan_rejects_unknown_planners_and_misplaced_options() -> None:
    p = Profile.uniform(4)
    with pytest.raises(
        PlanError, match=r"unknown planner 'gpipe' \(allowed: pipedream, dynpipe, even\)"
    ):
        plan(p, planner="gpipe", num_stages=2)
    with pytest.raises(PlanError, match="does not take top_k"):
        plan(p, planner="pipedream", num_stages=2, top_k=2)
    with pytest.raises(PlanError, match="does not take levels"):
        plan(p, planner="dynpipe", num_stages=2, levels=[Level(2, 1.0)])
    with pytest.raises(PlanError, match="not both"):
        plan(p, planner="pipedream", num_stages=2, levels=[Level(2, 1.0)])
    with pytest.raises(PlanError, match="needs num_stages"):
        plan(p, planner="even", num_stages=None)


def test_stage_and_boundary_times() -> None:
    p = make(layer(1, 2, act=40, grad=4), layer(1, 1, act=20, grad=10), layer(2, 2, grad=30))
    part = plan(p, planner="dynpipe", num_stages=3, bandwidth_Bps=10.0)
    assert boundary_times(p, part, 10.0) == pytest.approx([5.0, 5.0])
    # stage 0 sends 40 B forward; stage 1 sends 20 B forward and 10 B back; stage 2 sends 30 B back.
    assert stage_times(p, part, [10.0, 5.0]) == pytest.approx([3 + 4.0, 2 + 4.0 + 1.0, 4 + 6.0])
