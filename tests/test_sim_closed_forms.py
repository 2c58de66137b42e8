"""The simulator against closed forms: pipeline bubbles, recompute cost, a hand-computed
2-stage run with communication (Narayanan's dissertation, ch. 3-4 bubble formulas)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptipe.schedule.build import build_schedule
from adaptipe.sim import CostModel, simulate, simulate_iterations


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b"]),
    stages=st.integers(1, 8),
    microbatches=st.integers(1, 32),
)
def test_gpipe_and_1f1b_bubble(name: str, stages: int, microbatches: int) -> None:
    # Forward 1, backward 2, no communication: (M + S - 1) slots of 3 s, bubble (S-1)/(M+S-1).
    schedule = build_schedule(name, stages=stages, microbatches=microbatches)
    r = simulate(schedule, CostModel.uniform_for(schedule), record=False)
    assert r.makespan == (microbatches + stages - 1) * 3.0
    assert r.bubble_ratio == pytest.approx((stages - 1) / (microbatches + stages - 1), abs=1e-12)
    assert r.busy_s == (3.0 * microbatches,) * stages
    assert r.throughput == pytest.approx(microbatches / r.makespan)


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(2, 8), chunks=st.integers(2, 4), groups=st.integers(1, 4))
def test_interleaved_bubble(stages: int, chunks: int, groups: int) -> None:
    # PTD-P interleaving: the bubble shrinks V times, (S-1)/(V*M+S-1), for M % S == 0.
    m = stages * groups
    schedule = build_schedule("interleaved", stages=stages, microbatches=m, chunks=chunks)
    r = simulate(schedule, CostModel.uniform_for(schedule), record=False)
    assert r.bubble_ratio == pytest.approx((stages - 1) / (chunks * m + stages - 1), rel=1e-9)
    assert r.makespan == pytest.approx(3.0 * (chunks * m + stages - 1) / chunks, rel=1e-12)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_recompute_adds_one_forward_per_microbatch(name: str) -> None:
    S, M = 4, 8
    plain = build_schedule(name, stages=S, microbatches=M)
    rc = build_schedule(name, stages=S, microbatches=M, recompute=True)
    costs = CostModel.uniform_for(plain, forward=1.5, backward=2.5)
    a, b = simulate(plain, costs), simulate(rc, costs)
    assert all(y - x == pytest.approx(M * 1.5) for x, y in zip(a.busy_s, b.busy_s, strict=True))
    # Recompute sits right before each backward: the critical path grows by M + S - 1 forwards.
    assert b.makespan == pytest.approx(a.makespan + (M + S - 1) * 1.5)


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("pipedream", {}),
        ("pipedream", {"vertical_sync": True}),
        ("2bw", {}),
        ("2bw", {"update_every": 8}),
    ],
)
def test_async_windows_simulate(name: str, kw: dict[str, object]) -> None:
    schedule = build_schedule(name, stages=4, microbatches=16, **kw)  # type: ignore[arg-type]
    r = simulate(schedule, CostModel.uniform_for(schedule))
    # 1F1B steady state: the window takes at least M slots of 3 s plus the fill and drain.
    assert r.makespan >= 16 * 3.0
    assert 0 < r.bubble_ratio < 1
    it = simulate_iterations(schedule, CostModel.uniform_for(schedule), 10)
    # Back to back, the next window's fill overlaps this one's drain: never slower.
    assert it.iteration_s[0] == r.makespan
    assert all(0 < t <= r.makespan for t in it.iteration_s)


def _two_stage_costs(schedule_name: str) -> tuple[float, float]:
    schedule = build_schedule(schedule_name, stages=2, microbatches=2)
    free = CostModel.uniform_for(schedule)
    # 1 byte at 1 B/s plus 0.5 s latency: every transfer takes 1.5 s.
    comm = dataclasses.replace(
        free,
        activation_bytes=[[1.0, 0.0]],
        gradient_bytes=[[0.0, 1.0]],
        bandwidth_Bps=1.0,
        latency_s=0.5,
    )
    return simulate(schedule, free).makespan, simulate(schedule, comm).makespan


def test_communication_two_stages_by_hand() -> None:
    # GPipe, S=2, M=2. Worker 0: F0 0-1, F1 1-2; activations on link 0->1 at 1-2.5 and
    # (FIFO, link busy) 2.5-4. Worker 1: F0 2.5-3.5, F1 4-5, B0 5-7, B1 7-9; gradients on
    # 1->0 at 7-8.5 and 9-10.5. Worker 0: B0 8.5-10.5, B1 10.5-12.5.
    free, comm = _two_stage_costs("gpipe")
    assert free == 9.0 and comm == 12.5
    # 1F1B: worker 1 runs F0 2.5-3.5, B0 3.5-5.5 (grad 5.5-7), F1 5.5-6.5, B1 6.5-8.5
    # (grad 8.5-10); worker 0: B0 7-9, B1 10-12.
    free, comm = _two_stage_costs("1f1b")
    assert free == 9.0 and comm == 12.0
