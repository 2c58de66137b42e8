"""Branch-and-bound: exact where it claims it, honest at its time limit, fast on small arrays."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptipe.japsp import JapspInstance, evaluate, generate, lower_bound, solve
from adaptipe.japsp.bnb import _Search, solve_bnb
from adaptipe.japsp.bounds import drain_fits, johnson_key
from adaptipe.japsp.cpsat import available as cpsat_available
from adaptipe.japsp.evaluate import OpTable, semi_active
from adaptipe.japsp.genetic import solve_ga
from tests._japsp_brute import brute_force_optimum

COSTS = ("comm", "switch", "update", "recompute")


def _tiny(seed: int, *, fractional: bool = False) -> JapspInstance:
    """2-3 jobs x 1-3 stages with random cost terms, sometimes with identical jobs."""
    rng = random.Random(seed)
    jobs, stages = rng.choice([(2, 1), (3, 1), (2, 2), (3, 2), (2, 3), (1, 3)])

    def table(lo: float, hi: float) -> list[list[float]]:
        if fractional:
            return [[round(rng.uniform(lo, hi), 3) for _ in range(stages)] for _ in range(jobs)]
        return [[float(rng.randint(int(lo), int(hi))) for _ in range(stages)] for _ in range(jobs)]

    fwd, bwd = table(0 if seed % 5 == 0 else 1, 9), table(1, 12)
    if jobs > 1 and seed % 3 == 0:  # a twin: the symmetry rule must keep the search exact
        fwd[1], bwd[1] = list(fwd[0]), list(bwd[0])
    extras = {key: table(0, 3) for key in COSTS if rng.random() < 0.5}
    if jobs > 1 and seed % 3 == 0:
        for rows in extras.values():
            rows[1] = list(rows[0])
    return JapspInstance.build(fwd, bwd, **extras)


def _bounds_along(inst: JapspInstance, optimum: float, seqs: list[list[int]]) -> list[float]:
    """The node bound after each block of an optimal schedule, with the incumbent just
    above the optimum: a valid bound never exceeds the optimum."""
    tab = OpTable.of(inst)
    res = semi_active(tab, seqs)
    assert res is not None
    start = res[0]
    search = _Search(tab, optimum, seqs, deadline=float("inf"))
    search.ub = optimum + search.step + (0.0 if search.integral else 1e-7)
    k2 = 2 * tab.stages
    pos = [0] * tab.stages
    done: set[int] = set()
    out = []
    for _ in range(tab.n):
        o = min(
            (seq[pos[m]] for m, seq in enumerate(seqs) if pos[m] < len(seq)),
            key=lambda x: (x % k2 and x - 1 not in done, start[x], x),
        )
        search._push(o, start[o])
        done.add(o)
        pos[tab.machine[o]] += 1
        if len(done) < tab.n:
            out.append(search.bound())
    return out


@pytest.mark.parametrize("seed", range(60))
def test_bnb_proves_the_brute_force_optimum_with_every_cost_term(seed: int) -> None:
    inst = _tiny(seed)
    optimum, seqs = brute_force_optimum(inst)
    gpipe = solve(inst, solver="gpipe")
    result = solve_bnb(inst, time_limit_s=20, initial=gpipe.orders)  # the search, not the GA
    assert result.optimal and result.makespan == optimum == result.lower_bound
    assert evaluate(inst, result.orders).makespan == optimum
    assert max(_bounds_along(inst, optimum, seqs)) <= optimum


@pytest.mark.parametrize("seed", range(20))
def test_bnb_is_exact_on_fractional_times(seed: int) -> None:
    inst = _tiny(seed, fractional=True)
    optimum, seqs = brute_force_optimum(inst)
    result = solve_bnb(inst, time_limit_s=20, initial=solve(inst, solver="rr").orders)
    assert result.optimal and result.makespan == pytest.approx(optimum, abs=1e-9)
    assert max(_bounds_along(inst, optimum, seqs)) <= optimum + 1e-6


@st.composite
def _instances(draw: st.DrawFn) -> JapspInstance:
    jobs = draw(st.integers(1, 4))
    stages = draw(st.integers(1, 3))

    def table(lo: int, hi: int) -> list[list[float]]:
        cell = st.integers(lo, hi).map(float)
        row = st.lists(cell, min_size=stages, max_size=stages)
        return draw(st.lists(row, min_size=jobs, max_size=jobs))

    extras = {key: table(0, 4) for key in COSTS if draw(st.booleans())}
    return JapspInstance.build(table(1, 12), table(1, 24), **extras)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=_instances())
def test_bnb_is_never_worse_than_the_ga_or_the_baselines(inst: JapspInstance) -> None:
    result = solve_bnb(inst, time_limit_s=2)
    timeline = evaluate(inst, result.orders)
    assert timeline.makespan == pytest.approx(result.makespan, abs=1e-9)
    assert lower_bound(inst) - 1e-9 <= result.lower_bound <= result.makespan + 1e-9
    others = [solve(inst, solver=name).makespan for name in ("gpipe", "1f1b", "rr")]
    assert result.makespan <= min(others) + 1e-9
    if result.optimal:
        assert result.lower_bound == pytest.approx(result.makespan)
        assert result.makespan <= solve_ga(inst, time_limit_s=0.05).makespan + 1e-9


@pytest.mark.skipif(not cpsat_available(), reason="ortools (adaptipe[cpsat]) is not installed")
@pytest.mark.parametrize(
    ("jobs", "stages", "seed"), [(4, 3, 0), (4, 4, 1), (5, 3, 2), (5, 2, 3), (3, 4, 4)]
)
def test_bnb_agrees_with_cpsat_on_generated_arrays_with_costs(
    jobs: int, stages: int, seed: int
) -> None:
    inst = generate(jobs, stages, seed=seed, comm=0.1, switch=0.05, update=0.1, recompute=0.3)
    bb = solve_bnb(inst, time_limit_s=30)
    cp = solve(inst, solver="cpsat", time_limit_s=30)
    assert bb.optimal and cp.optimal and bb.makespan == cp.makespan


def test_bnb_at_its_time_limit_returns_its_best_schedule_and_the_gap() -> None:
    inst = generate(8, 4, seed=0)
    start = solve(inst, solver="rr")
    result = solve_bnb(inst, time_limit_s=0.3, initial=start.orders)
    assert result.seconds < 3
    assert result.makespan <= start.makespan
    assert evaluate(inst, result.orders).makespan == result.makespan
    assert lower_bound(inst) <= result.lower_bound <= result.makespan
    assert result.optimal == (result.gap == 0.0)


@pytest.mark.parametrize("seed", range(3))
def test_bnb_proves_generated_five_by_four_arrays(seed: int) -> None:
    result = solve_bnb(generate(5, 4, seed=seed), time_limit_s=60)
    assert result.optimal and result.gap == 0.0


def test_identical_jobs_enter_in_index_order() -> None:
    inst = generate(5, 3, seed=1, profiles=1, jitter=0.0)  # five identical jobs
    result = solve_bnb(inst, time_limit_s=20)
    assert result.optimal
    first = [j for kind, j in result.orders[0] if kind == "F"]
    assert first == sorted(first)


def test_drain_fits_sees_jobs_queue_after_the_last_stage() -> None:
    # two jobs finish 10 units of work each on M from time 0, then 5 on Z (no Y)
    flow = sorted([(0.0, 5.0, 0.0), (0.0, 5.0, 0.0)], key=lambda f: johnson_key(f[0], f[1]))
    work = [(0.0, 10.0, 0.0, 0.0, 0), (0.0, 10.0, 0.0, 0.0, 1)]
    # the first leaves M at 10, the second at 20 and ends on Z at 25
    assert drain_fits(work, [], flow, 25.0)
    assert not drain_fits(work, [], flow, 24.0)
    # a job already past M (released on Z at 3) fits before them
    flow3 = [*flow, (0.0, 5.0, 0.0)]
    assert drain_fits(work, [(3.0, 2)], flow3, 25.0)
    assert not drain_fits(work, [(21.0, 2)], flow3, 29.0)
