"""Branch-and-bound that proves JAPSP optima (the paper's B&B, Alg. 1, made exact).

Alg. 1 grows a schedule block by block, choosing at each step among the blocks that
could start first the one whose extended graph has the least bound (lines 5-17). Taking
only the best choice is a heuristic; this module keeps every choice open and searches
them depth first, which makes it exact:

- *Branching* (Giffler-Thompson): on the stage of the ready block ``o*`` that can end
  first, the children are the ready blocks that could start before ``o*`` ends (plus
  its switch, Eq. 8-9). Any other first block there would let ``o*`` go first without
  delaying anything, so some optimal completion starts with a child. That argument
  also needs every later block of the stage to wait until then; where a short lag
  (update, Eq. 6) or a switch breaks it, the next stage by earliest end is tried, and
  failing all, every ready block is a child.
- *Dominance*: a partial schedule is a state: blocks done per job, and the times from
  which the rest can start (per job its next start; per stage when it is free, for the
  job it served last and for the others; the makespan so far). Orders that complete a
  state complete one that is nowhere later at least as early, so a state no earlier
  anywhere than one already visited with the same blocks done is skipped.
- *Bounding*: `adaptipe.japsp.partial.PartialSchedule.bound` (heads and tails tightened
  against the incumbent, Jackson per stage, the pipeline drains).
- *Symmetry*: jobs with identical costs are interchangeable, so they enter the pipeline
  in index order, and without switches keep that order on every stage
  (`adaptipe.japsp.partial.twin_arcs`).
- *Both directions*: where the instance has a mirror image (`adaptipe.japsp.mirror`:
  the same optimum with time running backwards) a second search runs on it, in turns
  with the first and sharing the incumbent; the first to finish proves the optimum.
  Which end of a pipeline schedule is hard to bound varies by instance (the drain of
  long backward blocks, the fill of short forward ones), and a search bounds the end it
  decides last.
- *Upper bound*: the GA (or a given schedule); children are explored best bound first.
  ``optimal`` is True only when a search finished or the incumbent met the root bound;
  at the time limit the bound reported is the larger of the root bound (the bounds
  above, bisected) and the least bound of the unexplored nodes.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Generator

from adaptipe.japsp.bounds import lower_bound
from adaptipe.japsp.evaluate import OpTable, Orders, semi_active, to_seqs
from adaptipe.japsp.instance import JapspInstance
from adaptipe.japsp.mirror import mirror, mirror_orders
from adaptipe.japsp.partial import PartialSchedule, twin_ordered
from adaptipe.japsp.solve import Result

__all__ = ["solve_bnb"]

_EPS = 1e-9
_INF = float("inf")
# turns of the mirrored search per turn of the forward one, in nodes: on generated arrays
# the mirrored search needs fewer nodes more often than not
_TURNS = (8, 64)


class _Timeout(Exception):
    pass


class _Search(PartialSchedule):
    """One depth-first search; `run` yields before each node so two can take turns."""

    def __init__(self, tab: OpTable, ub: float, seqs: list[list[int]], deadline: float) -> None:
        super().__init__(tab, ub, deadline)
        self.best = [list(s) for s in seqs]
        self.found = ub  # the makespan of `best` (`ub` may come from the other search)
        self.nodes = 0
        self.open_bounds: list[float] = []
        self.memo: dict[tuple[int, ...], list[tuple[tuple[float, ...], tuple[int, ...]]]] = {}

    # -- search ------------------------------------------------------------------------

    def _dominated(self) -> bool:
        """Whether a visited state with the same blocks done is nowhere later; records
        this state otherwise.

        Each time is first raised to what it is anyway (a job's next start to its
        earliest start, a stage's free time to the earliest chain head of its remaining
        blocks, the makespan to the longest chain left), which makes more states
        comparable. With switches a stage has two times: for the job it served last
        (``free``) and for any other (``hi``).
        """
        tab, k2 = self.tab, self.k2
        machine, lag, sw, tail = tab.machine, tab.lag, tab.sw, tab.tail
        low = [_INF] * tab.stages
        vec: list[float] = []
        mk = self.makespan
        for e, o in self.ready():
            vec.append(e)
            if e + tail[o] > mk:
                mk = e + tail[o]
            end = (o // k2 + 1) * k2
            h = e
            while o < end:
                m = machine[o]
                if h < low[m]:
                    low[m] = h
                h += lag[o]
                o += 1
        vec.append(mk)
        lasts: list[int] = []
        for m in range(tab.stages):
            r = low[m]
            if r == _INF:
                continue
            free, lo = self.mend[m], self.last[m]
            hi = free + sw[lo] if lo >= 0 else free
            hi = hi if hi > r else r
            # after a job's backward block, none of its blocks is left on this stage
            free = hi if lo < 0 or lo % k2 >= tab.stages else (free if free > r else r)
            vec.append(hi)
            if self.any_sw:
                vec.append(free)
                lasts.append(lo // k2 if free < hi else -1)
        key = tuple(self.nxt)
        entry = (tuple(vec), tuple(lasts))
        seen = self.memo.get(key)
        if seen is None:
            self.memo[key] = [entry]
            return False
        n_vec = len(vec)
        for old, old_lasts in seen:
            if old_lasts != entry[1] and not _lasts_dominate(old, old_lasts, vec, lasts):
                continue
            for i in range(n_vec):
                if old[i] > vec[i]:
                    break
            else:
                return True
        seen.append(entry)
        return False

    def _allowed(self, o: int) -> bool:
        """Symmetry (`twin_arcs`): a job never overtakes its twin on a stage, or where
        switches forbid that, never enters the pipeline before it."""
        k2 = self.k2
        j = o // k2
        t = self.twin[j]
        if t < 0:
            return True
        pos = o - j * k2
        if pos and self.tw_pre[o] < 0:
            return True
        return self.nxt[t] > t * k2 + pos

    def _branch(self, ready: list[tuple[float, int]]) -> list[tuple[float, int]]:
        """Giffler-Thompson's conflict set on the first stage (by earliest end) where it
        provably holds an optimal completion's next block there, else every ready block."""
        tab, k2 = self.tab, self.k2
        machine, dur, sw, chain = tab.machine, tab.dur, tab.sw, tab.head
        end_on = [_INF] * tab.stages
        first_on = [-1] * tab.stages
        allowed = [(e, o) for e, o in ready if self._allowed(o)]
        for e, o in allowed:
            c = e + dur[o]
            m = machine[o]
            if c < end_on[m]:
                end_on[m], first_on[m] = c, o
        for m in sorted(range(tab.stages), key=end_on.__getitem__):
            ostar = first_on[m]
            if ostar < 0:
                break
            reach = end_on[m] + sw[ostar]
            for e, o in ready:  # a later block on m of a job now elsewhere must wait
                if machine[o] == m:
                    continue
                pos = o % k2
                nxt_on_m = o - pos + (m if pos <= m else k2 - 1 - m)
                if pos <= k2 - 1 - m and e + chain[nxt_on_m] - chain[o] < reach:
                    break
            else:
                return [(e, o) for e, o in allowed if machine[o] == m and (o == ostar or e < reach)]
        return allowed

    def run(self, remaining: int) -> Generator[None, None, None]:
        yield
        if remaining == 0:
            if self.makespan < self.ub - _EPS:
                self.ub = self.found = self.makespan
                self.best = [list(s) for s in self.seqs]
            return
        self.nodes += 1
        if time.perf_counter() > self.deadline:
            raise _Timeout
        scored = []
        for es, o in self._branch(self.ready()):
            undo = self.push(o, es)
            lb = _INF if self._dominated() else self.bound()
            self.pop(o, undo)
            if lb < self.ub - _EPS:
                scored.append((lb, es, o))
        scored.sort()
        for idx, (lb, es, o) in enumerate(scored):
            if lb >= self.ub - _EPS:
                break
            undo = self.push(o, es)
            try:
                yield from self.run(remaining - 1)
            except _Timeout:
                self.open_bounds.append(min(b for b, _, _ in scored[idx:]))
                raise
            finally:
                self.pop(o, undo)


def _lasts_dominate(
    old: tuple[float, ...], old_lasts: tuple[int, ...], vec: list[float], lasts: list[int]
) -> bool:
    """Where the stages' last jobs differ, the old state's time for any job (``hi``)
    must not exceed the new state's time for its own last job (``free``); the caller
    compares the rest element by element."""
    base = len(vec) - 2 * len(lasts)
    for i, (lo_old, lo_new) in enumerate(zip(old_lasts, lasts, strict=True)):
        if lo_old != lo_new and lo_new >= 0 and old[base + 2 * i] > vec[base + 2 * i + 1]:
            return False
    return True


def _race(searches: list[_Search], n: int, root_lb: float) -> bool:
    """Run the searches in turns (`_TURNS` nodes each), sharing the incumbent; True when
    one finished or the incumbent meets ``root_lb`` (it is optimal), False at the
    deadline."""
    runs = [s.run(n) for s in searches]
    try:
        while True:
            for run, turn in zip(runs, _TURNS, strict=False):
                for _ in range(turn):
                    next(run)
                ub = min(s.ub for s in searches)
                if ub <= root_lb + _EPS:
                    return True
                for other in searches:
                    other.ub = ub
    except StopIteration:
        return True
    except _Timeout:
        for run in runs:  # the others record the bounds of their unexplored nodes
            with contextlib.suppress(_Timeout, StopIteration):
                run.throw(_Timeout)
        return False
    finally:
        for run in runs:
            run.close()


def solve_bnb(
    inst: JapspInstance,
    *,
    time_limit_s: float = 10.0,
    initial: Orders | None = None,
    seed: int = 0,
) -> Result:
    """Prove an optimal schedule (or stop at ``time_limit_s`` with the remaining gap).

    ``initial`` gives the first upper bound; without it a short GA run does (about 2 ms
    per block, at most a tenth of the time limit; cut short when it meets the bound).
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    tab = OpTable.of(inst)
    root_lb = lower_bound(tab)
    if initial is None:
        from adaptipe.japsp.genetic import solve_ga

        budget = min(0.5, time_limit_s / 10, 0.02 + 0.002 * tab.n)
        initial = solve_ga(inst, seed=seed, time_limit_s=budget).orders
    seqs = to_seqs(tab, initial)
    res = semi_active(tab, seqs)
    if res is None:
        raise ValueError("initial orders are cyclic")
    searches = [_Search(tab, res[1], seqs, deadline)]
    back = mirror(inst) if inst.num_jobs > 1 else None
    if back is not None:
        btab = OpTable.of(back)
        searches.append(_Search(btab, res[1], to_seqs(btab, mirror_orders(initial)), deadline))
    for search in searches:
        if search.ub > root_lb + _EPS:
            root_lb = max(root_lb, search.root_bound(root_lb))
    finished = True
    if searches[0].ub > root_lb + _EPS:
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, 2 * tab.n + 200))
        try:
            finished = _race(searches, tab.n, root_lb)
        finally:
            sys.setrecursionlimit(old)
    best = min(searches, key=lambda s: s.found)
    ub = best.found
    lb = ub if finished else root_lb
    if not finished:
        for search in searches:
            if search.open_bounds:  # empty if it stopped at its root (or never ran)
                lb = max(lb, min([ub, *search.open_bounds]))
    orders = best.tab.orders(best.best)
    if best is not searches[0]:
        orders = mirror_orders(orders)
    seqs = to_seqs(tab, orders)
    final = semi_active(tab, seqs)
    assert final is not None
    ordered = twin_ordered(tab, seqs)  # twins in index order, whichever search found it
    again = semi_active(tab, ordered) if ordered is not None else None
    if ordered is not None and again is not None and again[1] <= final[1]:
        orders, final = tab.orders(ordered), again
    return Result(
        solver="bb",
        orders=orders,
        makespan=final[1],
        lower_bound=lb,
        optimal=finished or final[1] <= lb + _EPS,
        seconds=time.perf_counter() - t0,
        nodes=sum(s.nodes for s in searches),
        stopped_by="bound" if final[1] <= root_lb + _EPS else "search" if finished else "clock",
    )
