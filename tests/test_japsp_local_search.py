"""Local search of the GA: move estimates, tabu search and job moves."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptipe.japsp import evaluate, generate, lower_bound
from adaptipe.japsp.budget import SearchBudget
from adaptipe.japsp.evaluate import OpTable, critical_blocks, decode, longest_paths, semi_active
from adaptipe.japsp.local_search import block_moves, job_moves, move_estimate, tabu_search
from tests._japsp_brute import brute_force_optimum


def _reference_estimate(
    tab: OpTable, seq: list[int], i: int, j: int, head: list[float], tail: list[float]
) -> float:
    """The estimate spelt out: longest paths through the reordered segment in the graph
    with new stage arcs, heads and tails of everything outside it kept."""
    k2 = 2 * tab.stages
    lo, hi = min(i, j), max(i, j)
    seg = list(seq[lo : hi + 1])
    seg.insert(j - lo, seg.pop(i - lo))
    where = {o: p for p, o in enumerate(seg)}

    def gap(a: int, b: int) -> float:
        return tab.dur[a] + (tab.sw[a] if a // k2 != b // k2 else 0.0)

    new_head: dict[int, float] = {}
    for p, o in enumerate(seg):
        cands = []
        before = seg[p - 1] if p else (seq[lo - 1] if lo else None)
        if before is not None:
            cands.append(new_head.get(before, head[before]) + gap(before, o))
        if o % k2:
            if where.get(o - 1, -1) > p:
                return math.inf  # the block would run before its own chain predecessor
            cands.append(new_head.get(o - 1, head[o - 1]) + tab.lag[o - 1])
        new_head[o] = max(cands, default=0.0)
    new_tail: dict[int, float] = {}
    for p in reversed(range(len(seg))):
        o = seg[p]
        cands = [tab.dur[o]]
        after = seg[p + 1] if p + 1 < len(seg) else (seq[hi + 1] if hi + 1 < len(seq) else None)
        if after is not None:
            cands.append(gap(o, after) + new_tail.get(after, tail[after]))
        if (o + 1) % k2:
            cands.append(tab.lag[o] + new_tail.get(o + 1, tail[o + 1]))
        new_tail[o] = max(cands)
    return max(new_head[o] + new_tail[o] for o in seg)


def _random_orders(tab: OpTable, rng: random.Random) -> list[list[int]]:
    chromosome = [j for j in range(tab.jobs) for _ in range(2 * tab.stages)]
    rng.shuffle(chromosome)
    return decode(tab, chromosome)[0]


@settings(max_examples=60, deadline=None)
@given(
    jobs=st.integers(1, 6),
    stages=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    costs=st.sampled_from([(0.0, 0.0, 0.0), (0.1, 0.05, 0.1)]),
)
def test_move_estimate_is_the_longest_path_through_the_moved_blocks(
    jobs: int, stages: int, seed: int, costs: tuple[float, float, float]
) -> None:
    comm, switch, update = costs
    inst = generate(jobs, stages, seed=seed, jitter=0.1, comm=comm, switch=switch, update=update)
    tab = OpTable.of(inst)
    rng = random.Random(seed)
    seqs = _random_orders(tab, rng)
    paths = longest_paths(tab, seqs)
    assert paths is not None
    head, tail = paths
    for _ in range(20):
        m = rng.randrange(stages)
        i, j = rng.sample(range(len(seqs[m])), 2)
        estimate = move_estimate(tab, seqs[m], i, j, head, tail)
        # exact equality: generated costs are whole numbers, so sums in any order agree
        assert estimate == _reference_estimate(tab, seqs[m], i, j, head, tail)


def test_move_estimate_is_mostly_the_makespan_of_critical_block_moves() -> None:
    # It ranks tabu search's moves, so on those it must nearly always be the true makespan.
    rng = random.Random(0)
    exact = below = timed_moves = 0
    for seed in range(150):
        inst = generate(rng.randint(2, 8), rng.randint(2, 5), seed=seed, jitter=0.1, switch=0.05)
        tab = OpTable.of(inst)
        seqs = _random_orders(tab, rng)
        paths = longest_paths(tab, seqs)
        assert paths is not None
        for block in critical_blocks(tab, seqs, paths[0]):
            m = tab.machine[block[0]]
            first, last = seqs[m].index(block[0]), seqs[m].index(block[-1])
            for i, j in {(first, first + 1), (last, last - 1), (first, last), (last, first)}:
                moved = list(seqs[m])
                moved.insert(j, moved.pop(i))
                timed = semi_active(tab, [*seqs[:m], moved, *seqs[m + 1 :]])
                estimate = move_estimate(tab, seqs[m], i, j, *paths)
                if timed is None or estimate == math.inf:
                    continue
                timed_moves += 1
                exact += abs(estimate - timed[1]) < 1e-9
                below += estimate <= timed[1] + 1e-9
    assert timed_moves > 300
    assert exact >= 0.85 * timed_moves and below >= 0.98 * timed_moves


@given(first=st.integers(0, 5), size=st.integers(2, 7))
def test_block_moves_are_the_n5_n7_moves_each_order_once(first: int, size: int) -> None:
    last = first + size - 1
    seq = list(range(first + size + 2))

    def moved(i: int, j: int) -> tuple[int, ...]:
        out = list(seq)
        out.insert(j, out.pop(i))
        return tuple(out)

    orders = [moved(i, j) for i, j in block_moves(first, last)]
    assert len(set(orders)) == len(orders)  # none twice (it would be timed twice)
    # N5: the first two or the last two swap; N7: an inner block to either end, or an
    # end to the other end
    inner = range(first + 1, last)
    wanted = {moved(first, first + 1), moved(last, last - 1)}
    wanted |= {moved(p, end) for p in inner for end in (first, last)}
    if size > 2:
        wanted |= {moved(first, last), moved(last, first)}
    assert set(orders) == wanted
    assert len(orders) == (1 if size == 2 else 2 * size - 2)


def test_move_estimate_flags_a_backward_before_its_forward() -> None:
    tab = OpTable.of(generate(2, 1, seed=0))  # one stage: F0, B0 share it (ops 0, 1)
    seqs = [[0, 1, 2, 3]]
    paths = longest_paths(tab, seqs)
    assert paths is not None
    assert move_estimate(tab, seqs[0], 0, 1, *paths) == math.inf  # B0 before F0
    assert semi_active(tab, [[1, 0, 2, 3]]) is None


@settings(max_examples=30, deadline=None)
@given(jobs=st.integers(2, 4), stages=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_tabu_search_never_returns_worse_and_times_what_it_returns(
    jobs: int, stages: int, seed: int
) -> None:
    inst = generate(jobs, stages, seed=seed, jitter=0.1, switch=0.05, update=0.05)
    tab = OpTable.of(inst)
    seqs = _random_orders(tab, random.Random(seed))
    start = semi_active(tab, seqs)
    assert start is not None
    budget = SearchBudget(deadline=math.inf)
    found, starts, makespan = tabu_search(
        tab, seqs, iters=50, rng=random.Random(seed), floor=lower_bound(tab), budget=budget
    )
    assert makespan <= start[1]
    assert makespan >= lower_bound(tab) - 1e-9
    timeline = evaluate(inst, tab.orders(found))  # complete, acyclic orders
    assert timeline.makespan == makespan
    assert semi_active(tab, found) == (starts, makespan)


def test_tabu_search_improves_gpipe_order_and_never_beats_the_optimum() -> None:
    improved = 0
    for seed in range(8):
        inst = generate(3, 2, seed=seed, jitter=0.1, switch=0.05)
        tab = OpTable.of(inst)
        gpipe = [
            [j * 4 + (s if k == 0 else 3 - s) for k in (0, 1) for j in range(3)] for s in (0, 1)
        ]
        before = semi_active(tab, gpipe)
        assert before is not None
        _, _, makespan = tabu_search(
            tab,
            gpipe,
            iters=200,
            rng=random.Random(0),
            floor=lower_bound(tab),
            budget=SearchBudget(deadline=math.inf),
        )
        assert makespan >= brute_force_optimum(inst)[0] - 1e-9
        improved += makespan < before[1] - 1e-9
    assert improved >= 6


def test_local_search_stops_when_the_work_is_spent() -> None:
    inst = generate(20, 4, seed=0, jitter=0.05)
    tab = OpTable.of(inst)
    seqs = _random_orders(tab, random.Random(0))
    timed = semi_active(tab, seqs)
    assert timed is not None
    free, capped = (
        SearchBudget(deadline=math.inf),
        SearchBudget(deadline=math.inf, work_limit=5 * tab.n),
    )
    for budget in (free, capped):
        tabu_search(tab, seqs, iters=100, rng=random.Random(0), floor=0.0, budget=budget)
    assert capped.work < free.work / 10  # it ends at the first step past the limit
    budget = SearchBudget(deadline=math.inf, work_limit=3 * tab.n)
    job_moves(tab, seqs, timed[1], rng=random.Random(0), tries=500, budget=budget)
    moves = tab.jobs * (tab.jobs - 1) // 2 + 2 * tab.jobs * (tab.jobs - 1)
    assert budget.work <= 3 * tab.n + moves // 2  # past the limit by one shuffle at most


def _trajectory(
    monkeypatch: pytest.MonkeyPatch, tab: OpTable, seqs: list[list[int]], *, iters: int
) -> tuple[list[tuple[tuple[int, ...], ...]], list[int]]:
    """The orders tabu search stands on at each step, and how many moves each step timed."""
    import adaptipe.japsp.local_search as ls

    steps: list[tuple[tuple[int, ...], ...]] = []
    timed: list[int] = []
    real_blocks, real_timing = ls.critical_blocks, ls.semi_active

    def blocks(tab_: OpTable, current: list[list[int]], start: list[float]) -> list[list[int]]:
        steps.append(tuple(tuple(s) for s in current))
        timed.append(0)
        return real_blocks(tab_, current, start)

    def timing(tab_: OpTable, trial: list[list[int]]) -> tuple[list[float], float] | None:
        out = real_timing(tab_, trial)
        if timed and out is not None:
            timed[-1] += 1
        return out

    monkeypatch.setattr(ls, "critical_blocks", blocks)
    monkeypatch.setattr(ls, "semi_active", timing)
    tabu_search(
        tab,
        seqs,
        iters=iters,
        rng=random.Random(1),
        floor=0.0,
        budget=SearchBudget(deadline=math.inf),
        exact=2,
    )
    return steps, timed


def test_tabu_search_never_steps_straight_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # The move just made is tabu to undo (it could only come back as a new best, and the
    # order it left was no better than the best): no A -> B -> A in the walk. Without
    # the tabu list such two-cycles are what a best-move descent does at a local optimum.
    walked = 0
    for seed in range(6):
        inst = generate(5, 3, seed=seed, jitter=0.1, switch=0.05)
        tab = OpTable.of(inst)
        steps, _ = _trajectory(monkeypatch, tab, _random_orders(tab, random.Random(seed)), iters=60)
        walked += len(steps)
        assert all(steps[t] != steps[t + 2] for t in range(len(steps) - 2))
    assert walked > 100  # the walks went on past local optima


def test_tabu_search_times_at_most_exact_admissible_moves_a_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inst = generate(6, 4, seed=3, jitter=0.1, switch=0.05)
    tab = OpTable.of(inst)
    _, timed = _trajectory(monkeypatch, tab, _random_orders(tab, random.Random(3)), iters=40)
    # exact=2 admissible moves a step; a tabu move timed and found no new best is extra
    assert timed and max(timed) <= 2 + 3 and sum(t <= 2 for t in timed) >= 0.8 * len(timed)
