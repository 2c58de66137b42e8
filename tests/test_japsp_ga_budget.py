"""The GA's default budget: counted work that grows with jobs x stages, one schedule per seed."""

from __future__ import annotations

import math
import random
import time

import pytest

from adaptipe.japsp import generate, genetic, solve
from adaptipe.japsp.budget import WORK_PER_JOB_STAGE, WORK_PER_SECOND, default_work
from adaptipe.japsp.genetic import solve_ga


def test_default_work_grows_with_jobs_times_stages_between_one_and_ten_million() -> None:
    assert default_work(30, 10) == 3_000_000 == WORK_PER_JOB_STAGE * 300
    assert default_work(30, 16) == 4_800_000
    assert default_work(16, 30) == default_work(30, 16)  # only the product counts
    assert default_work(60, 10) == 2 * default_work(30, 10)
    # small arrays keep the old default (one second's worth), huge ones a few seconds
    assert default_work(6, 4) == default_work(1, 1) == WORK_PER_SECOND
    assert default_work(64, 16) == default_work(200, 64) == 10 * WORK_PER_SECOND
    sizes = sorted(((j, s) for j in (4, 8, 16, 30, 64) for s in (2, 4, 8, 16)), key=math.prod)
    works = [default_work(j, s) for j, s in sizes]
    assert works == sorted(works)  # never less work for more job-stages


def _frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that never moves: the search can only end on its work (or the bound)."""
    frozen = time.perf_counter()
    monkeypatch.setattr(time, "perf_counter", lambda: frozen)


def test_ga_without_a_time_limit_asks_default_work_for_its_jobs_and_stages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int]] = []

    def small(jobs: int, stages: int) -> int:  # the real work, scaled down to keep this fast
        asked.append((jobs, stages))
        return default_work(jobs, stages) // 20

    monkeypatch.setattr(genetic, "default_work", small)
    _frozen_clock(monkeypatch)
    inst = generate(14, 8, seed=1, profiles=3, jitter=0.02)  # 112 job-stages: 1.12 million
    result = solve(inst, solver="ga", seed=2)  # `solve` passes no limit: the GA's default
    assert asked == [(14, 8)]
    assert result.stopped_by == "work"
    # it spends what it was given, one search step past it at most (a polish, a seed)
    assert 56_000 <= result.nodes < 112_000


def test_default_ga_gives_one_schedule_per_seed_whatever_the_clock_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fast machine (the clock stands still) and a slow, jumpy one (up to 1 s of the
    # 3 s backstop gone at any reading) end on the same work with the same schedule.
    inst = generate(10, 6, seed=3, profiles=3, jitter=0.02)
    _frozen_clock(monkeypatch)
    fast = solve_ga(inst, seed=4)
    rng = random.Random(0)
    start = time.perf_counter()
    monkeypatch.setattr(time, "perf_counter", lambda: start + rng.random())
    slow = solve_ga(inst, seed=4)
    assert fast.stopped_by == slow.stopped_by == "work"
    assert fast.nodes == slow.nodes >= default_work(10, 6) == WORK_PER_SECOND
    assert fast.orders == slow.orders and fast.makespan == slow.makespan


def test_an_explicit_time_limit_still_buys_a_million_units_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inst = generate(30, 10, seed=1, profiles=3, jitter=0.0)  # default: 3 million
    _frozen_clock(monkeypatch)
    result = solve(inst, solver="ga", time_limit_s=0.5)
    assert result.stopped_by == "work"
    assert 0.5 * WORK_PER_SECOND <= result.nodes < 0.75 * WORK_PER_SECOND
