"""Windows: rounds of a job-array's block order merged into one schedule.

A window must be a valid schedule (each job's next round on a stage after its own
step there), keep every stage's order within a round, be timed as its orders are,
never be slower than its rounds one after another, and respect the memory budget.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptipe.errors import PlanError, ScheduleError
from adaptipe.japsp import JapspInstance, evaluate, solve
from adaptipe.japsp.baselines import one_f_one_b_orders
from adaptipe.japsp.evaluate import OpTable
from adaptipe.japsp.jitter import Replay as _Jitter
from adaptipe.japsp.window import (
    AUTO_WINDOW_MAX,
    JITTER,
    NEAR,
    ROUND_ORDERS,
    _one_step_ahead,
    auto_window,
    best_window,
    expected_makespan,
    unroll,
    window_schedule,
)
from adaptipe.runtime.memory import block_order, minimum_budget
from adaptipe.schedule.types import Forward, OptimizerStep
from adaptipe.schedule.validate import validate
from tests.test_japsp_solvers import instances

PINNED_1F1B_JITTERED = 8.903639938795857  # a 1F1B window of 13, spread by JITTER (see its test)


def _rounds_as_jobs(inst: JapspInstance, rounds: int) -> JapspInstance:
    """The instance with job ``j`` of round ``r`` as job ``r * J + j`` (same costs)."""

    def rows(table: tuple[tuple[float, ...], ...]) -> list[list[float]]:
        return [list(row) for row in table] * rounds

    return JapspInstance.build(
        rows(inst.forward),
        rows(inst.backward),
        comm=rows(inst.comm),
        switch=rows(inst.switch),
        update=rows(inst.update),
        recompute=rows(inst.recompute),
    )


def _as_jobs(order: tuple[tuple[str, int, int], ...], jobs: int) -> list[str]:
    return [f"{k}{r * jobs + j}" for k, j, r in order]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    inst=instances(max_jobs=4, max_stages=3),
    rounds=st.integers(1, 4),
    solver=st.sampled_from(["rr", "1f1b", "gpipe"]),
    budget=st.integers(0, 3),
)
def test_a_window_is_valid_timed_as_ordered_and_never_slower_than_its_rounds(
    inst: JapspInstance, rounds: int, solver: str, budget: int
) -> None:
    base = solve(inst, solver=solver)
    window = unroll(inst, base.orders, rounds, budget=budget)
    schedule = window_schedule(inst, window)
    validate(schedule)
    # Within each round, every stage keeps the base order.
    for s, order in enumerate(window.orders):
        for r in range(rounds):
            assert [(k, j) for k, j, rr in order if rr == r] == list(base.orders[s])
    # The window's makespan is the semi-active timeline of its orders, read as R*J jobs
    # (switch costs aside: a job's next round runs on its own state, no switch).
    as_jobs = _rounds_as_jobs(inst, rounds)
    timed = evaluate(as_jobs, [_as_jobs(order, inst.num_jobs) for order in window.orders])
    if not any(any(row) for row in inst.switch):
        assert timed.makespan == pytest.approx(window.makespan, abs=1e-9)
    else:
        assert window.makespan <= timed.makespan + 1e-9
    # One after another, rounds pay a switch at each boundary (from one round's last job
    # on a stage to the next round's first), which one round's makespan leaves out.
    boundary_switch = max(max(row) for row in inst.switch)
    assert window.makespan <= rounds * base.makespan + (rounds - 1) * boundary_switch + 1e-9
    tab = OpTable.of(inst)
    busiest = max(sum(tab.dur[o] for o in ops) for ops in tab.machine_ops)
    assert window.makespan >= rounds * busiest - 1e-9
    # No stage holds more jobs in flight than the budget (or one round's order) needs.
    if budget:
        for s, program in enumerate(schedule.stages):
            one_round = minimum_budget([j for _, j in base.orders[s]])
            assert minimum_budget(block_order(program)) <= max(budget, one_round)


def test_one_round_is_the_base_order() -> None:
    inst = JapspInstance.build([[3.0, 4.0], [5.0, 2.0], [1.0, 6.0]], [[6.0, 8.0]] * 3)
    base = solve(inst, solver="bb")
    window = unroll(inst, base.orders, 1)
    assert window.makespan == pytest.approx(base.makespan)
    assert [[(k, j) for k, j, _ in stage] for stage in window.orders] == [
        list(stage) for stage in base.orders
    ]


def test_overlapping_rounds_hides_the_fill_and_drain() -> None:
    # Four identical jobs on two stages: one round costs 155 (stage work 124 plus fill
    # and drain); with a 1F1B round order, rounds overlap and a round costs
    # 124 + 31 / R.
    inst = JapspInstance.build(
        [[10.0, 10.0]] * 4, [[20.0, 20.0]] * 4, update=[[1.0, 1.0]] * 4, comm=[[0.5, 0.5]] * 4
    )
    one = one_f_one_b_orders(inst)
    assert one.makespan == pytest.approx(155.0)
    window = unroll(inst, one.orders, 4)
    assert window.makespan == pytest.approx(4 * 124.0 + 31.0)
    # An optimal but GPipe-like round order cannot overlap: best_window finds a 1F1B one
    # (stage 0 one forward further ahead than 1F1B: the same makespan, less exposed to
    # late blocks).
    gpipe_like = solve(inst, solver="gpipe")
    assert unroll(inst, gpipe_like.orders, 4).makespan == pytest.approx(4 * 155.0)
    orders, best = best_window(inst, gpipe_like.orders, 4)
    assert best.makespan == pytest.approx(4 * 124.0 + 31.0)
    assert " ".join(f"{k}{j}" for k, j in orders[0]) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert orders[1] == one.orders[1]


def test_the_budget_caps_jobs_in_flight() -> None:
    # Jobs of different sizes: a short job's next round fits early, putting a third job
    # in flight on stage 0 unless the budget of 2 forbids it.
    inst = JapspInstance.build(
        [[4.0, 4.0], [1.0, 1.0], [3.0, 3.0]], [[8.0, 8.0], [2.0, 2.0], [6.0, 6.0]]
    )
    one = one_f_one_b_orders(inst)
    free = window_schedule(inst, unroll(inst, one.orders, 2))
    capped = window_schedule(inst, unroll(inst, one.orders, 2, budget=2))
    assert max(minimum_budget(block_order(p)) for p in free.stages) == 3
    assert max(minimum_budget(block_order(p)) for p in capped.stages) == 2
    validate(capped)


def test_bad_arguments_are_named() -> None:
    inst = JapspInstance.build([[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2)
    orders = solve(inst, solver="1f1b").orders
    with pytest.raises(PlanError, match="rounds must be an integer >= 1"):
        unroll(inst, orders, 0)
    with pytest.raises(PlanError, match="rules must be among serial, fit, eager"):
        unroll(inst, orders, 2, rules=["lazy"])
    with pytest.raises(PlanError, match="missing blocks"):
        unroll(inst, [orders[0], orders[1][:-1]], 2)


def test_a_next_round_before_the_step_of_the_last_is_rejected() -> None:
    inst = JapspInstance.build([[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2)
    schedule = window_schedule(inst, unroll(inst, solve(inst, solver="1f1b").orders, 2))
    stage = list(schedule.stages[0])
    fwd = next(i for i, ins in enumerate(stage) if isinstance(ins, Forward) and ins.microbatch)
    job = stage[fwd].job
    step = max(
        i for i, ins in enumerate(stage[:fwd]) if isinstance(ins, OptimizerStep) and ins.job == job
    )
    stage.insert(step, stage.pop(fwd))
    forged = replace(schedule, stages=(tuple(stage), *schedule.stages[1:]))
    with pytest.raises(ScheduleError, match=r"belongs to flush 2 .* exactly 1 OptimizerStep"):
        validate(forged)


def test_within_the_budget_beats_a_shorter_order_over_it() -> None:
    # Identical jobs: the GPipe order is optimal for one round but keeps all four jobs
    # in flight; with a budget of 2 the 1F1B order (two in flight) is the one to run,
    # even with windows off.
    inst = JapspInstance.build([[10.0, 10.0]] * 4, [[20.0, 20.0]] * 4)
    gpipe = solve(inst, solver="gpipe").orders
    for rounds in (1, 3):
        orders, window = best_window(inst, gpipe, rounds, budget=2)
        assert orders == one_f_one_b_orders(inst).orders
        assert (
            max(minimum_budget(block_order(p)) for p in window_schedule(inst, window).stages) == 2
        )
    assert best_window(inst, gpipe, 1)[0] == tuple(tuple(s) for s in gpipe)  # no budget
    assert best_window(inst, gpipe, 1)[1].order == "given"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(max_jobs=4, max_stages=4), data=st.data())
def test_any_budget_of_one_or_more_gets_a_window_within_it(
    inst: JapspInstance, data: st.DataObject
) -> None:
    # Few jobs left on many stages (after early stops, say): 1F1B itself keeps S jobs
    # in flight on stage 0, so the fallback orders must keep the array runnable.
    budget = data.draw(st.integers(1, max(1, inst.num_jobs - 1)), label="budget")
    rounds = data.draw(st.integers(1, 3), label="rounds")
    orders, window = best_window(inst, solve(inst, solver="gpipe").orders, rounds, budget=budget)
    evaluate(inst, orders)  # a feasible round order
    schedule = window_schedule(inst, window)
    validate(schedule)
    assert max(minimum_budget(block_order(p)) for p in schedule.stages) <= budget


def test_one_job_in_flight_runs_jobs_one_after_another_on_three_stages() -> None:
    inst = JapspInstance.build([[1.0, 1.0, 1.0]] * 3, [[2.0, 2.0, 2.0]] * 3)
    orders, _ = best_window(inst, one_f_one_b_orders(inst).orders, 2, budget=1)
    for stage in orders:
        assert [f"{k}{j}" for k, j in stage] == ["F0", "B0", "F1", "B1", "F2", "B2"]


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("jobs", [1, 2, 3, 4, 5, 8, 13, 16, 64])
def test_auto_window_is_the_fewest_iterations_with_a_boundary_share_of_2_percent(
    jobs: int, stages: int
) -> None:
    length = auto_window(jobs, stages)
    if jobs == 1:  # a lone job's rounds cannot overlap: no window is worth a late stop
        assert length == 1
        return
    share = (stages - 1) / (length * jobs)  # one block of S - 1 stages per window boundary
    assert 1 <= length <= AUTO_WINDOW_MAX
    assert share <= 0.02 or length == AUTO_WINDOW_MAX
    assert length == 1 or (stages - 1) / ((length - 1) * jobs) > 0.02  # the fewest


@pytest.mark.parametrize(
    ("jobs", "stages"), [(2, 2), (4, 2), (8, 2), (3, 3), (8, 3), (4, 4), (12, 4)]
)
def test_an_auto_window_keeps_the_japsp_model_within_2_percent_of_the_bound(
    jobs: int, stages: int
) -> None:
    # Equal jobs whose pipeline can stay full (J >= S): the busiest stage's load per
    # iteration is the bound; the fill and drain of each window is all that remains.
    inst = JapspInstance.build([[1.0] * stages] * jobs, [[2.0] * stages] * jobs)
    length = auto_window(jobs, stages)
    _, window = best_window(inst, one_f_one_b_orders(inst).orders, length)
    per_iteration = window.makespan / length
    assert per_iteration <= 3.0 * jobs * (1.025 if length == AUTO_WINDOW_MAX else 1.02)
    _, shorter = best_window(inst, one_f_one_b_orders(inst).orders, max(1, length // 2))
    assert shorter.makespan / max(1, length // 2) > per_iteration  # length pays off


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    inst=instances(max_jobs=4, max_stages=3),
    rounds=st.integers(1, 4),
    solver=st.sampled_from(["rr", "1f1b", "gpipe"]),
    rule=st.sampled_from(["serial", "fit", "eager"]),
    budget=st.integers(0, 3),
)
def test_the_replay_without_jitter_is_the_windows_makespan(
    inst: JapspInstance, rounds: int, solver: str, rule: str, budget: int
) -> None:
    window = unroll(inst, solve(inst, solver=solver).orders, rounds, rules=[rule], budget=budget)
    assert expected_makespan(inst, window) == pytest.approx(window.makespan, rel=1e-12)


def test_a_jittered_replay_scales_each_block_and_sends_before_the_update() -> None:
    # One job, two stages: a chain F0 F1 B1 B0 over one link (comm 0.5 each way).
    # B1's gradient leaves stage 1 when its own work is done, before its update; each
    # block's time is its cost times the draw for that block.
    inst = JapspInstance.build([[2.0, 3.0]], [[5.0, 7.0]], comm=[[0.5, 0.0]], update=[[1.0, 4.0]])
    window = unroll(inst, solve(inst, solver="1f1b").orders, 1)
    tab = OpTable.of(inst)
    spread = _Jitter(tab, 1, jitter=0.3, samples=5)
    total = 0.0
    for k in spread.scales:  # ops of job 0: F@0, F@1, B@1, B@0
        f0, f1, b1, b0 = (
            k[tab.op(block, s)]
            for block, s in ((("F", 0), 0), (("F", 0), 1), (("B", 0), 1), (("B", 0), 0))
        )
        t_f1 = 2.0 * f0 + 0.5
        t_b1 = t_f1 + 3.0 * f1
        t_b0 = t_b1 + 7.0 * b1 + 0.5  # the update (4.0 * b1) runs after the send
        total += max(t_b0 + (5.0 + 1.0) * b0, t_b1 + (7.0 + 4.0) * b1)
    assert spread.expected(window) == pytest.approx(total / 5, rel=1e-12)
    assert expected_makespan(inst, window, jitter=0.3, samples=5) == spread.expected(window)


def test_jittered_replays_draw_the_same_everywhere() -> None:
    # Workers pick their windows each on their own: the draws must not depend on the
    # platform's maths library (plain arithmetic on Python's seeded generator), and a
    # change to them changes which windows runs use. The figure is pinned.
    inst = JapspInstance.build([[0.0522, 0.0527]] * 4, [[0.105, 0.112]] * 4)
    window = unroll(inst, one_f_one_b_orders(inst).orders, 13)
    value = expected_makespan(inst, window, jitter=JITTER)
    assert value == expected_makespan(inst, window, jitter=JITTER)
    assert value == pytest.approx(PINNED_1F1B_JITTERED, rel=1e-12)


def test_bad_replay_arguments_are_named() -> None:
    inst = JapspInstance.build([[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2)
    window = unroll(inst, one_f_one_b_orders(inst).orders, 2)
    with pytest.raises(PlanError, match="needs jitter >= 0 and samples >= 1"):
        expected_makespan(inst, window, jitter=0.1, samples=0)
    with pytest.raises(PlanError, match="needs jitter >= 0"):
        expected_makespan(inst, window, jitter=-0.1)
    other = JapspInstance.build([[1.0, 1.0, 1.0]] * 2, [[2.0, 2.0, 2.0]] * 2)
    with pytest.raises(PlanError, match="a window of 2 rounds over 2 stages, not 2 over 3"):
        expected_makespan(other, window)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(max_jobs=4, max_stages=3), rounds=st.integers(2, 4))
def test_the_chosen_window_is_the_least_jittered_of_those_near_the_shortest(
    inst: JapspInstance, rounds: int
) -> None:
    orders, window = best_window(inst, solve(inst, solver="bb").orders, rounds)
    validate(window_schedule(inst, window))
    assert window == unroll(inst, orders, rounds, rules=[window.rule])
    # Every candidate order under every rule, spelt out here:
    candidates = [solve(inst, solver=s).orders for s in ("bb", "1f1b", "rr", "gpipe")]
    candidates.append(_one_step_ahead(inst.num_stages, inst.num_jobs))
    others = [
        unroll(inst, cand, rounds, rules=[rule])
        for cand in candidates
        for rule in ("serial", "fit", "eager")
    ]
    shortest = min(w.makespan for w in others)
    assert window.makespan <= shortest * (1 + NEAR) + 1e-9
    mine = expected_makespan(inst, window, jitter=JITTER)
    for other in others:
        if other.makespan <= shortest * (1 + NEAR) + 1e-12:
            assert mine <= expected_makespan(inst, other, jitter=JITTER) * (1 + 1e-9)


def test_late_blocks_cost_less_with_the_first_stage_one_forward_ahead() -> None:
    # The job-array benchmark's costs (4 equal jobs, stage 1 about 5% heavier): 1F1B
    # and one-step-ahead tie by the block costs; with block times spread as in real runs,
    # 1F1B's stage 1 waits for every late forward, and best_window takes the other.
    inst = JapspInstance.build([[0.0522, 0.0527]] * 4, [[0.105, 0.112]] * 4)
    one = unroll(inst, one_f_one_b_orders(inst).orders, 13)
    orders, window = best_window(inst, solve(inst, solver="bb").orders, 13)
    assert " ".join(f"{k}{j}" for k, j in orders[0]) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert window.order == "1f1b-ahead" and window.order in ROUND_ORDERS
    assert window.makespan == pytest.approx(one.makespan)
    late_one = expected_makespan(inst, one, jitter=JITTER)
    late = expected_makespan(inst, window, jitter=JITTER)
    assert late < late_one * 0.99
    assert late == pytest.approx(window.makespan, rel=0.005)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_a_lone_jobs_rounds_cannot_overlap(stages: int) -> None:
    # Why auto windows are 1 for one job: its next forward on stage 0 waits for its own
    # last backward there, so a window is its rounds one after another.
    from adaptipe.japsp.instance import generate

    for seed in range(3):
        inst = generate(1, stages, seed=seed, comm=0.1, update=0.2)
        one = solve(inst, solver="bb").makespan
        _, window = best_window(inst, solve(inst, solver="bb").orders, 5)
        assert window.makespan == pytest.approx(5 * one)
    assert auto_window(1, stages) == 1
