"""Branch-and-bound: exact where it claims it, honest at its time limit, fast on small arrays."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptipe.errors import ScheduleError
from adaptipe.japsp import JapspInstance, evaluate, generate, lower_bound, solve
from adaptipe.japsp.bnb import _Search, solve_bnb
from adaptipe.japsp.bounds import drain_fits, johnson_key
from adaptipe.japsp.cpsat import available as cpsat_available
from adaptipe.japsp.evaluate import OpTable, Orders, semi_active, to_seqs
from adaptipe.japsp.genetic import solve_ga
from adaptipe.japsp.mirror import mirror, mirror_orders
from adaptipe.japsp.partial import twin_arcs, twin_ordered
from tests._japsp_brute import brute_force_optimum

COSTS = ("comm", "switch", "update", "recompute")

# Optima of generate(6, 4, seed=s, jitter=0.0) (jobs of one batch size identical, as in
# the paper's workload), proven by OR-Tools CP-SAT 9.15.
PAPER_SIX_BY_FOUR_OPTIMA = {0: 3821.0, 4: 5468.0, 15: 8289.0, 18: 3332.0}


def _tiny(seed: int, *, fractional: bool = False) -> JapspInstance:
    """2-3 jobs x 1-3 stages with random cost terms, sometimes with identical jobs; every
    fourth has a mirror image (no update, a switch that is the same for every job)."""
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
    if seed % 4 == 1:
        extras.pop("update", None)
        if "switch" in extras:
            extras["switch"] = [list(extras["switch"][0]) for _ in range(jobs)]
    if jobs > 1 and seed % 3 == 0:
        for rows in extras.values():
            rows[1] = list(rows[0])
    return JapspInstance.build(fwd, bwd, **extras)


def _bounds_along(tab: OpTable, optimum: float, seqs: list[list[int]]) -> list[float]:
    """The node bound after each block of an optimal schedule, with the incumbent just
    above the optimum: a valid bound never exceeds the optimum. The schedule keeps twins
    in index order (`twin_ordered`), as the search does."""
    ordered = twin_ordered(tab, seqs)
    assert ordered is not None
    seqs = ordered
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
        search.push(o, start[o])
        done.add(o)
        pos[tab.machine[o]] += 1
        if len(done) < tab.n:
            out.append(search.bound())
    return out


def _search_alone(tab: OpTable, orders: Orders) -> float:
    """One direction's search run to the end from ``orders``, without the other."""
    seqs = to_seqs(tab, orders)
    res = semi_active(tab, seqs)
    assert res is not None
    search = _Search(tab, res[1], seqs, deadline=float("inf"))
    for _ in search.run(tab.n):
        pass
    res = semi_active(tab, search.best)
    assert res is not None and res[1] == pytest.approx(search.found, abs=1e-9)
    return search.found


def _check_both_directions(inst: JapspInstance, optimum: float, seqs: list[list[int]]) -> None:
    """Each direction alone proves ``optimum`` (the race would hide a wrong one), and no
    node bound along an optimal schedule exceeds it."""
    tab = OpTable.of(inst)
    start = solve(inst, solver="gpipe").orders
    assert _search_alone(tab, start) == pytest.approx(optimum, abs=1e-9)
    assert max(_bounds_along(tab, optimum, seqs), default=0.0) <= optimum + 1e-6
    back = mirror(inst)
    if back is None:
        return
    btab = OpTable.of(back)
    assert _search_alone(btab, mirror_orders(start)) == pytest.approx(optimum, abs=1e-9)
    bseqs = to_seqs(btab, mirror_orders(tab.orders(seqs)))
    assert max(_bounds_along(btab, optimum, bseqs), default=0.0) <= optimum + 1e-6


@pytest.mark.parametrize("seed", range(60))
def test_bnb_proves_the_brute_force_optimum_with_every_cost_term(seed: int) -> None:
    inst = _tiny(seed)
    optimum, seqs = brute_force_optimum(inst)
    gpipe = solve(inst, solver="gpipe")
    result = solve_bnb(inst, time_limit_s=20, initial=gpipe.orders)  # the search, not the GA
    assert result.optimal and result.makespan == optimum == result.lower_bound
    assert evaluate(inst, result.orders).makespan == optimum
    _check_both_directions(inst, optimum, seqs)


@pytest.mark.parametrize("seed", range(20))
def test_bnb_is_exact_on_fractional_times(seed: int) -> None:
    inst = _tiny(seed, fractional=True)
    optimum, seqs = brute_force_optimum(inst)
    result = solve_bnb(inst, time_limit_s=20, initial=solve(inst, solver="rr").orders)
    assert result.optimal and result.makespan == pytest.approx(optimum, abs=1e-9)
    _check_both_directions(inst, optimum, seqs)


@st.composite
def _twin_heavy(draw: st.DrawFn) -> JapspInstance:
    """2-3 jobs x 1-2 stages, each job a copy of an earlier one with probability 1/2."""
    jobs = draw(st.integers(2, 3))
    stages = draw(st.integers(1, 2))
    cell = st.integers(1, 9).map(float)
    keys = ["forward", "backward", *(k for k in COSTS if draw(st.booleans()))]
    rows: dict[str, list[list[float]]] = {k: [] for k in keys}
    for j in range(jobs):
        copy = draw(st.integers(0, j - 1)) if j and draw(st.booleans()) else -1
        for k in keys:
            row = draw(st.lists(cell, min_size=stages, max_size=stages))
            rows[k].append(list(rows[k][copy]) if copy >= 0 else row)
    return JapspInstance.build(rows.pop("forward"), rows.pop("backward"), **rows)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=_twin_heavy())
def test_bnb_is_exact_with_identical_jobs(inst: JapspInstance) -> None:
    optimum, seqs = brute_force_optimum(inst)
    result = solve_bnb(inst, time_limit_s=20, initial=solve(inst, solver="1f1b").orders)
    assert result.optimal and result.makespan == optimum
    tab = OpTable.of(inst)
    ordered = twin_ordered(tab, seqs)
    res = semi_active(tab, ordered) if ordered is not None else None
    assert res is not None and res[1] == optimum  # twins in index order lose nothing
    _check_both_directions(inst, optimum, seqs)


@st.composite
def _mirrorable(draw: st.DrawFn, max_jobs: int = 4, max_stages: int = 4) -> JapspInstance:
    jobs = draw(st.integers(1, max_jobs))
    stages = draw(st.integers(1, max_stages))

    def table(lo: int, hi: int) -> list[list[float]]:
        row = st.lists(st.integers(lo, hi).map(float), min_size=stages, max_size=stages)
        return draw(st.lists(row, min_size=jobs, max_size=jobs))

    switch = draw(st.lists(st.integers(0, 3).map(float), min_size=stages, max_size=stages))
    return JapspInstance.build(
        table(1, 12),
        table(1, 24),
        comm=table(0, 4),
        recompute=table(0, 4),
        switch=[list(switch) for _ in range(jobs)],
    )


@settings(max_examples=25, deadline=None)
@given(inst=_mirrorable(), seed=st.integers(0, 1000))
def test_mirror_keeps_the_makespan_of_every_schedule(inst: JapspInstance, seed: int) -> None:
    back = mirror(inst)
    assert back is not None
    rng = random.Random(seed)
    for name in ("gpipe", "1f1b", "rr"):
        orders = solve(inst, solver=name).orders
        # a random stage order that keeps each job's forward block before its backward one
        stage = rng.randrange(inst.num_stages)
        shuffled = [("F", j) for j in range(inst.num_jobs)]
        rng.shuffle(shuffled)
        mixed = list(shuffled)
        for j in range(inst.num_jobs):
            mixed.insert(rng.randint(mixed.index(("F", j)) + 1, len(mixed)), ("B", j))
        for candidate in (orders, (*orders[:stage], tuple(mixed), *orders[stage + 1 :])):
            try:
                ahead = evaluate(inst, candidate).makespan
            except ScheduleError:  # the random order made the schedule cyclic
                continue
            assert evaluate(back, mirror_orders(candidate)).makespan == pytest.approx(ahead)
            assert mirror_orders(mirror_orders(candidate)) == tuple(map(tuple, candidate))


def test_mirror_needs_time_symmetric_costs() -> None:
    base = {"forward": [[1.0, 2.0], [2.0, 1.0]], "backward": [[2.0, 4.0], [4.0, 2.0]]}
    assert mirror(JapspInstance.build(**base, update=[[1.0, 0.0], [0.0, 0.0]])) is None
    assert mirror(JapspInstance.build(**base, switch=[[1.0, 1.0], [2.0, 1.0]])) is None
    same = mirror(JapspInstance.build(**base, switch=[[1.0, 3.0], [1.0, 3.0]]))
    assert same is not None and same.switch == ((1.0, 3.0), (1.0, 3.0))
    back = mirror(JapspInstance.build(**base, recompute=[[1.0, 1.0], [0.0, 0.0]]))
    assert back is not None and back.forward == ((3.0, 5.0), (4.0, 2.0))
    assert back.backward == ((1.0, 2.0), (2.0, 1.0)) and not any(map(any, back.recompute))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=_mirrorable(max_jobs=2, max_stages=3))
def test_mirror_has_the_same_optimum(inst: JapspInstance) -> None:
    back = mirror(inst)
    assert back is not None
    assert brute_force_optimum(back)[0] == brute_force_optimum(inst)[0]


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
    ("jobs", "stages", "seed", "costs"),
    [
        (4, 3, 0, {"comm": 0.1, "switch": 0.05, "update": 0.1, "recompute": 0.3}),
        (4, 4, 1, {"comm": 0.1, "switch": 0.05, "update": 0.1, "recompute": 0.3}),
        (5, 3, 2, {"comm": 0.1, "switch": 0.05, "update": 0.1, "recompute": 0.3}),
        (5, 2, 3, {"comm": 0.1, "switch": 0.05, "update": 0.1, "recompute": 0.3}),
        (3, 4, 4, {"comm": 0.1, "switch": 0.05, "update": 0.1, "recompute": 0.3}),
        (5, 4, 0, {"comm": 0.1, "recompute": 0.3}),  # these two have a mirror image
        (5, 4, 8, {"comm": 0.1, "recompute": 0.3}),
    ],
)
def test_bnb_agrees_with_cpsat_on_generated_arrays_with_costs(
    jobs: int, stages: int, seed: int, costs: dict[str, float]
) -> None:
    inst = generate(jobs, stages, seed=seed, **costs)
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


@pytest.mark.parametrize("limit", [1e-4, 0.02, 0.05])
def test_bnb_cut_short_claims_no_more_than_it_proved(limit: float) -> None:
    inst = generate(6, 4, seed=0, jitter=0.0)
    optimum = PAPER_SIX_BY_FOUR_OPTIMA[0]
    start = solve(inst, solver="gpipe")
    result = solve_bnb(inst, time_limit_s=limit, initial=start.orders)
    assert result.lower_bound <= optimum <= result.makespan
    assert not result.optimal or result.makespan == optimum


@pytest.mark.parametrize("seed", range(3))
def test_bnb_proves_generated_five_by_four_arrays(seed: int) -> None:
    result = solve_bnb(generate(5, 4, seed=seed), time_limit_s=60)
    assert result.optimal and result.gap == 0.0


@pytest.mark.slow
@pytest.mark.skipif(not cpsat_available(), reason="ortools (adaptipe[cpsat]) is not installed")
@pytest.mark.parametrize("seed", sorted(PAPER_SIX_BY_FOUR_OPTIMA))
def test_cpsat_proves_the_paper_workload_optima_these_tests_use(seed: int) -> None:
    result = solve(generate(6, 4, seed=seed, jitter=0.0), solver="cpsat", time_limit_s=120)
    assert result.optimal and result.makespan == PAPER_SIX_BY_FOUR_OPTIMA[seed]


@pytest.mark.parametrize("seed", sorted(PAPER_SIX_BY_FOUR_OPTIMA))
def test_bnb_proves_six_by_four_arrays_of_the_papers_workload(seed: int) -> None:
    # among the slowest of seeds 0-29 to prove; each takes well under a second of CPU
    result = solve_bnb(generate(6, 4, seed=seed, jitter=0.0), time_limit_s=60)
    assert result.optimal and result.makespan == PAPER_SIX_BY_FOUR_OPTIMA[seed]


def test_identical_jobs_keep_index_order_on_every_stage() -> None:
    inst = generate(5, 3, seed=1, profiles=1, jitter=0.0)  # five identical jobs
    result = solve_bnb(inst, time_limit_s=20)
    assert result.optimal
    for stage in result.orders:
        for kind in "FB":
            jobs = [j for k, j in stage if k == kind]
            assert jobs == sorted(jobs)


def test_twins_with_switches_only_enter_in_index_order() -> None:
    inst = generate(3, 2, seed=1, profiles=1, jitter=0.0, switch=0.1)  # identical jobs
    tab = OpTable.of(inst)
    twin, pre = twin_arcs(tab)
    assert twin == [-1, 0, 1] and max(pre) == -1  # a switch would not survive the swap
    search = _Search(tab, float("inf"), [[] for _ in range(tab.stages)], float("inf"))
    assert [o for _, o in search.ready() if search._allowed(o)] == [0]
    search.push(0, 0.0)
    search.push(1, search.ready()[0][0])  # job 0 moves on to stage 1
    k2 = 2 * tab.stages
    assert [o // k2 for _, o in search.ready() if search._allowed(o)] == [0, 1]
    free = JapspInstance.build([list(r) for r in inst.forward], [list(r) for r in inst.backward])
    assert twin_arcs(OpTable.of(free))[1][k2 + 1] == 1  # without switches: every stage


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
