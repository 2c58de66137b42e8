"""ArrayPipe's genetic algorithm for large job-arrays (§IV-B "Genetic Algorithm").

A chromosome is the paper's vector of length ``J x 2S`` in which job ``j`` appears once
per block: its ``n``-th occurrence is the ``n``-th block of ``j``'s chain, so every
permutation is feasible and crossover and mutation never repair. It is decoded into an
active schedule (`adaptipe.japsp.evaluate.decode`). Each generation keeps the elite,
picks parents by tournament, recombines them with the precedence operation crossover
(POX: the genes of a random job subset keep their places from one parent, the others
follow the second parent's order), mutates (swap, move, or shift all genes of one job),
and improves the best child, and a copy of the best individual kicked by a random job
move (iterated local search), by alternating *job moves* (two jobs trade places, or one
moves before or after another, on every stage at once) with a short tabu search on the
critical path (N5 swaps at the ends of critical blocks, N7 moves of an operation to its
block's ends); the improved order is written back into the chromosome (Lamarckian).

The initial population holds the baselines, shifting-bottleneck schedules (plain and
randomised, `adaptipe.japsp.baselines.shifting_bottleneck`) and, on small arrays, 1F1B
over the best few of all distinct job orders (jobs of equal costs are one kind); a tabu
search from those runs beside the GA, and the better answer wins. The search runs on a
budget of counted work (`adaptipe.japsp.budget`), not on the clock, so a seed gives the
same schedule on every run and machine (with one Python version: `random` keeps its
sequences across versions only for `random.random`), unless a machine too slow for the work hits the
time limit first (``Result.stopped_by == "clock"``); it stops as soon as the makespan
meets the lower bound.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

from adaptipe.japsp.baselines import BASELINES, shifting_bottleneck
from adaptipe.japsp.bounds import lower_bound
from adaptipe.japsp.budget import (
    DEFAULT_CLOCK_SLACK,
    WORK_PER_SECOND,
    SearchBudget,
    default_work,
)
from adaptipe.japsp.evaluate import OpTable, Orders, decode, semi_active, to_seqs
from adaptipe.japsp.instance import JapspInstance
from adaptipe.japsp.local_search import job_moves, kick, tabu_search
from adaptipe.japsp.solve import Result
from adaptipe.schedule.onefoneb import one_f_one_b_order

__all__ = ["solve_ga"]

_EPS = 1e-9
Seqs = list[list[int]]


def _chromosome(tab: OpTable, start: Sequence[float]) -> list[int]:
    """Operations sorted by start time (chain order breaks ties), as job ids."""
    k2 = 2 * tab.stages
    return [o // k2 for o in sorted(range(tab.n), key=lambda o: (start[o], o % k2, o))]


def _pox(rng: random.Random, p1: list[int], p2: list[int], jobs: int) -> list[int]:
    keep = {j for j in range(jobs) if rng.random() < 0.5}
    rest = iter([g for g in p2 if g not in keep])
    return [g if g in keep else next(rest) for g in p1]


def _mutate(rng: random.Random, ch: list[int], jobs: int) -> None:
    n = len(ch)
    kind = rng.random()
    if kind < 0.4:
        i, j = rng.randrange(n), rng.randrange(n)
        ch[i], ch[j] = ch[j], ch[i]
    elif kind < 0.8:
        ch.insert(rng.randrange(n), ch.pop(rng.randrange(n)))
    else:  # shift every gene of one job by the same offset: the job enters earlier or later
        j = rng.randrange(jobs)
        shift = rng.randint(-n // 3, n // 3)
        places = [min(max(i + shift, 0), n - 1) for i, g in enumerate(ch) if g == j]
        rest = [g for g in ch if g != j]
        for p in places:
            rest.insert(p, j)
        ch[:] = rest


def _job_sequences(tab: OpTable, limit: int) -> list[list[int]] | None:
    """Every distinct order of the jobs, jobs with equal costs counted as one (the paper's
    arrays hold few batch sizes), or None when there are more than ``limit``."""
    k2 = 2 * tab.stages
    kinds: dict[tuple[float, ...], list[int]] = {}
    for j in range(tab.jobs):
        ops = range(j * k2, (j + 1) * k2)
        key = tuple(v for o in ops for v in (tab.dur[o], tab.lag[o], tab.sw[o], tab.rel[o]))
        kinds.setdefault(key, []).append(j)
    groups = list(kinds.values())
    count, placed = 1, 0
    for g in groups:  # the multinomial coefficient, built up group by group
        placed += len(g)
        count = count * math.comb(placed, len(g))
        if count > limit:
            return None
    out: list[list[int]] = []
    left = [len(g) for g in groups]

    def extend(prefix: list[int]) -> None:
        if len(prefix) == tab.jobs:
            out.append(list(prefix))
            return
        for i, g in enumerate(groups):
            if left[i]:
                left[i] -= 1
                prefix.append(g[len(g) - 1 - left[i]])
                extend(prefix)
                prefix.pop()
                left[i] += 1

    extend([])
    return out


def _sequence_seeds(
    tab: OpTable, budget: SearchBudget, *, limit: int = 720, keep: int = 3
) -> list[Seqs]:
    """On small arrays, 1F1B over every distinct job order: the ``keep`` best (of those
    scored before ``budget`` ran out).

    Which jobs fill and drain the pipeline matters most on few jobs (short jobs at both
    ends, say), and a crossover rarely moves a whole job from one end to the other.
    """
    orders = _job_sequences(tab, limit)
    if orders is None:
        return []
    template = [one_f_one_b_order(tab.stages, tab.jobs, s) for s in range(tab.stages)]
    scored: list[tuple[float, int, Seqs]] = []
    for i, perm in enumerate(orders):
        if scored and budget.exhausted():
            break
        seqs = to_seqs(tab, [[(k, perm[j]) for k, j in stage] for stage in template])
        res = semi_active(tab, seqs)
        budget.spend(tab.n)
        assert res is not None
        scored.append((res[1], i, seqs))
    scored.sort(key=lambda x: (x[0], x[1]))
    return [seqs for _, _, seqs in scored[:keep]]


def _seeds(
    tab: OpTable,
    inst: JapspInstance,
    initial: Orders | None,
    rng: random.Random,
    budget: SearchBudget,
    by_job_order: list[Seqs],
) -> list[Seqs]:
    """Starting schedules: ``initial``, the baselines, 1F1B over the best job orders (small
    arrays), shifting bottleneck, and up to six randomised shifting-bottleneck runs (fewer
    on big instances, where one costs more)."""
    out = [] if initial is None else [to_seqs(tab, initial)]
    out.extend(to_seqs(tab, make(inst).orders) for make in BASELINES.values())
    budget.spend(tab.n * (tab.jobs + 40))  # the three baselines (round-robin's dispatch)
    out.extend(by_job_order)
    out.append(shifting_bottleneck(tab, spend=budget.spend))
    for _ in range(min(6, 200_000 // (tab.stages * tab.stages * tab.n))):
        if budget.exhausted():
            break
        out.append(shifting_bottleneck(tab, noise=0.3, rng=rng, spend=budget.spend))
    return out


_Individual = tuple[float, list[int]]  # (makespan, chromosome)


class _Ga:
    """What the GA's steps share: the table, its lower bound, the work budget and the
    population's random stream (one stream, drawn in a fixed order: a seed's schedule)."""

    ts_iters = 150

    def __init__(
        self,
        tab: OpTable,
        budget: SearchBudget,
        lb: float,
        rng: random.Random,
        local_search: bool,
    ) -> None:
        self.tab, self.budget, self.lb, self.rng = tab, budget, lb, rng
        self.local_search = local_search

    def decoded(self, ch: list[int]) -> _Individual:
        self.budget.spend(2 * self.tab.n)  # the decoder's gap search costs about two passes
        return decode(self.tab, ch)[2], ch

    def orders_of(self, ch: list[int]) -> Seqs:
        self.budget.spend(2 * self.tab.n)
        return decode(self.tab, ch)[0]

    def polish(self, seqs: Seqs) -> _Individual:
        """Macro job moves and tabu search, alternating while the moves pay."""
        tab, budget, rng = self.tab, self.budget, self.rng
        res = semi_active(tab, seqs)
        assert res is not None
        budget.spend(tab.n)
        start, mk = res
        for rnd in range(3 if self.local_search else 0):
            seqs, moved = job_moves(tab, seqs, mk, rng=rng, tries=200, budget=budget)
            if rnd and moved >= mk - _EPS:
                break
            seqs, start, mk = tabu_search(
                tab, seqs, iters=self.ts_iters, rng=rng, floor=self.lb, budget=budget
            )
        ch = _chromosome(tab, start)
        budget.spend(tab.n)  # the sort by start
        return self.decoded(ch)  # decoding left-shifts, so never worse than mk


def solve_ga(
    inst: JapspInstance,
    *,
    seed: int = 0,
    time_limit_s: float | None = None,
    population: int | None = None,
    generations: int | None = None,
    initial: Orders | None = None,
    local_search: bool = True,
    work: int | None = None,
) -> Result:
    """Run the GA (population 30 unless ``population``) on ``work`` units of counted work
    (`adaptipe.japsp.budget`), by default ``time_limit_s`` worth (one million a second)
    or, without a time limit, `default_work`: 10,000 per job x stage, between one and
    ten million (3 million for 30 jobs x 10 stages, 4.8 million for 30 x 16). Without a
    time limit, the clock backstop is three times what the work stands for (9 s and
    14.4 s there; `DEFAULT_CLOCK_SLACK`).

    Ends when the work is spent (`adaptipe.japsp.budget`: the same seed gives the same
    schedule on any machine fast enough), after ``generations`` generations, at the lower bound, or,
    on a machine too slow for the work, at the time limit (``Result.stopped_by`` then
    says ``"clock"``). The constructive seeds (baselines, one shifting-bottleneck run,
    and on small arrays 1F1B over the best job orders, scored while work is left) are
    always built, also for the plain GA, so a limit below their cost (0.2-0.3 s for
    64 jobs x 8 stages) is overrun by it.
    ``initial`` adds a schedule to the first population; ``local_search=False`` leaves
    out the job moves and the tabu search (a plain GA).
    """
    t0 = time.perf_counter()
    tab = OpTable.of(inst)
    if time_limit_s is None:
        work = default_work(inst.num_jobs, inst.num_stages) if work is None else work
        time_limit_s = DEFAULT_CLOCK_SLACK * work / WORK_PER_SECOND
    # the clock's deadline leaves room for the final decoding (about 2 ms per 1000 blocks)
    budget = SearchBudget.for_limit(
        time_limit_s, start=t0, reserve_s=0.05 * time_limit_s + 3e-6 * tab.n, work=work
    )
    lb = lower_bound(tab)
    rng = random.Random(seed)
    ga = _Ga(tab, budget, lb, rng, local_search)
    size = population or 30
    cap = generations if generations is not None else 1 << 30
    by_job_order = _sequence_seeds(tab, budget)
    side = _side_search(ga, by_job_order, random.Random(seed ^ 0x5EED))
    if side is not None and side[0] <= lb + _EPS:  # met the lower bound: nothing to find
        return _result(tab, side[1], lb, t0, budget, "clock" if budget.clock_hit else "bound")
    pop = _first_population(ga, inst, initial, by_job_order, size)
    best = pop[0]
    elite = max(2, size // 10)
    gen = stale = 0
    while gen < cap and best[0] > lb + _EPS and not budget.exhausted():
        gen += 1
        pop = _next_generation(ga, pop, best, size, elite)
        if pop[0][0] < best[0] - _EPS:
            best, stale = pop[0], 0
        else:
            stale += 1
        if stale >= 25:  # restart around the best: keep it, re-randomise the rest
            stale = 0
            pop = [best] + [ga.decoded(_shuffled(rng, best[1], tab.jobs)) for _ in range(size - 1)]
            pop.sort(key=lambda x: x[0])
    seqs, _, _ = decode(tab, best[1])
    if side is not None and side[0] < best[0] - _EPS:
        seqs = side[1]
    # what ended it: the clock cutting any search short (a rerun may end elsewhere) first
    ended = "bound" if best[0] <= lb + _EPS else "generations" if gen >= cap else "work"
    return _result(tab, seqs, lb, t0, budget, "clock" if budget.clock_hit else ended)


def _side_search(
    ga: _Ga, by_job_order: list[Seqs], side_rng: random.Random
) -> tuple[float, Seqs] | None:
    """Small arrays: tabu search from the best job orders' 1F1B, on the side.

    Kept out of the population (polished seeds there pull it into their basin) and out
    of its random stream; the better of the two answers is returned.
    """
    side: tuple[float, Seqs] | None = None
    # The best order gets three tries (tabu's tie-breaks are random), the others one.
    starts = [*by_job_order[:1], *by_job_order[:1], *by_job_order]
    for seqs in starts if ga.local_search else []:
        if ga.budget.exhausted() or (side is not None and side[0] <= ga.lb + _EPS):
            break
        found, _, mk = tabu_search(
            ga.tab,
            [list(s) for s in seqs],
            iters=ga.ts_iters,
            rng=side_rng,
            floor=ga.lb,
            budget=ga.budget,
        )
        if side is None or mk < side[0] - _EPS:
            side = (mk, found)
    return side


def _first_population(
    ga: _Ga,
    inst: JapspInstance,
    initial: Orders | None,
    by_job_order: list[Seqs],
    size: int,
) -> list[_Individual]:
    """The seeds (`_seeds`), the best four polished, then random chromosomes up to
    ``size``; sorted by makespan."""
    tab = ga.tab
    pop = []
    for seqs in _seeds(tab, inst, initial, ga.rng, ga.budget, by_job_order):
        res = semi_active(tab, seqs)
        assert res is not None
        ga.budget.spend(tab.n)
        pop.append(ga.decoded(_chromosome(tab, res[0])))
    pop.sort(key=lambda x: x[0])
    for i in range(min(4, len(pop))):  # polish the best seeds
        if i and (ga.budget.exhausted() or pop[0][0] <= ga.lb + _EPS):
            break
        pop[i] = ga.polish(ga.orders_of(pop[i][1]))
    base = [g for j in range(tab.jobs) for g in [j] * (2 * tab.stages)]
    while len(pop) < size:
        ch = list(base)
        ga.rng.shuffle(ch)
        pop.append(ga.decoded(ch))
    pop.sort(key=lambda x: x[0])
    return pop


def _next_generation(
    ga: _Ga, pop: list[_Individual], best: _Individual, size: int, elite: int
) -> list[_Individual]:
    """The elite, then children of tournament parents (POX, mutation); the best child is
    polished and a random one replaced by the best, kicked and polished. Sorted."""
    tab, rng, jobs = ga.tab, ga.rng, ga.tab.jobs
    nxt = pop[:elite]
    while len(nxt) < size and not ga.budget.exhausted():
        a = min(rng.sample(pop, 3), key=lambda x: x[0])
        b = min(rng.sample(pop, 3), key=lambda x: x[0])
        child = _pox(rng, a[1], b[1], jobs) if rng.random() < 0.9 else list(a[1])
        if rng.random() < 0.4:
            _mutate(rng, child, jobs)
        ga.budget.spend(tab.n)  # the crossover and mutation pass over the genes
        nxt.append(ga.decoded(child))
    k = min(range(elite, len(nxt)), key=lambda i: nxt[i][0], default=0)
    nxt[k] = ga.polish(ga.orders_of(nxt[k][1]))
    if len(nxt) > elite + 1:
        k = rng.randrange(elite, len(nxt))
        nxt[k] = ga.polish(kick(tab, ga.orders_of(best[1]), rng, ga.budget))
    return sorted(nxt, key=lambda x: x[0])


def _result(
    tab: OpTable, seqs: Seqs, lb: float, t0: float, budget: SearchBudget, stopped_by: str
) -> Result:
    out = semi_active(tab, seqs)
    assert out is not None
    return Result(
        solver="ga",
        orders=tab.orders(seqs),
        makespan=out[1],
        lower_bound=lb,
        optimal=out[1] <= lb + _EPS,
        seconds=time.perf_counter() - t0,
        nodes=budget.work,
        stopped_by=stopped_by,
    )


def _shuffled(rng: random.Random, ch: list[int], jobs: int) -> list[int]:
    child = list(ch)
    for _ in range(3):
        _mutate(rng, child, jobs)
    return child
