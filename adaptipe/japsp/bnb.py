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
- *Bounding*, against the target ``incumbent - 1`` (integer data) or ``incumbent``:
  heads from the state, tails from the chains; on every stage, pairs of blocks that
  cannot run in one order without missing the target are fixed in the other
  (immediate selection) and edge finding (`adaptipe.japsp.bounds.edge_find`) raises
  heads and tails, pushed along the chains to a fixed point. Then every stage's Jackson
  preemptive schedule (Alg. 1 line 14's ``1|r_j|L_max``) and the pipeline *drains*
  (`adaptipe.japsp.bounds.drain_fits`: jobs leave a stage one after another and queue
  through the backward blocks of two lower stages), which see what one stage alone
  cannot: the last jobs through the pipeline still have to cross it.
- *Symmetry*: jobs with identical costs are interchangeable, so they enter the pipeline
  in index order.
- *Upper bound*: the GA (or a given schedule); children are explored best bound first.
  ``optimal`` is True only when the search finished; at the time limit the bound reported
  is the larger of the root bound (the bounds above, bisected) and the least bound of
  the unexplored nodes.
"""

from __future__ import annotations

import sys
import time

from adaptipe.japsp.bounds import (
    drain_fits,
    edge_find,
    integral,
    jackson,
    johnson_key,
    lower_bound,
    round_bound,
)
from adaptipe.japsp.evaluate import OpTable, Orders, semi_active, to_seqs
from adaptipe.japsp.instance import JapspInstance
from adaptipe.japsp.solve import Result

__all__ = ["solve_bnb"]

_EPS = 1e-9
_INF = float("inf")
Undo = tuple[float, int, float, float]


class _Timeout(Exception):
    pass


class _Search:
    """Mutable search state; `run` is the depth-first recursion with undo."""

    def __init__(self, tab: OpTable, ub: float, seqs: list[list[int]], deadline: float) -> None:
        self.tab = tab
        k2 = self.k2 = 2 * tab.stages
        self.ub = ub
        self.best = [list(s) for s in seqs]
        self.deadline = deadline
        self.integral = integral(tab)
        self.step = 1.0 if self.integral else _EPS
        self.nodes = 0
        self.open_bounds: list[float] = []
        # a job's last block on a stage is followed by its switch (or nothing): fold it in
        self.dext = [
            tab.dur[o] + (tab.sw[o] if o % k2 >= tab.stages else 0.0) for o in range(tab.n)
        ]
        self.qtail = [tab.tail[o] - tab.dur[o] for o in range(tab.n)]
        self.twin = _twins(tab)
        self.any_sw = any(tab.sw)
        self.nxt = [j * k2 for j in range(tab.jobs)]
        self.rdy = [0.0] * tab.jobs
        self.last = [-1] * tab.stages
        self.mend = [0.0] * tab.stages
        self.seqs: list[list[int]] = [[] for _ in range(tab.stages)]
        self.makespan = 0.0
        self.head = [0.0] * tab.n
        self.memo: dict[tuple[int, ...], list[tuple[tuple[float, ...], tuple[int, ...]]]] = {}
        # drains (upstream stage m, downstream stage a) and how often each one pruned
        self.drains = [(m, a) for m in range(tab.stages - 1, 0, -1) for a in range(m)]
        self.drain_stats = [[0, 0] for _ in self.drains]

    # -- state -------------------------------------------------------------------------

    def _ready(self) -> list[tuple[float, int]]:
        """``(earliest start, block)`` of each job's next block."""
        tab, k2 = self.tab, self.k2
        machine, sw = tab.machine, tab.sw
        nxt, last, mend, rdy = self.nxt, self.last, self.mend, self.rdy
        out = []
        for j in range(tab.jobs):
            o = nxt[j]
            if o == (j + 1) * k2:
                continue
            m = machine[o]
            lo = last[m]
            a = mend[m] + sw[lo] if lo >= 0 and lo // k2 != j else mend[m]
            r = rdy[j]
            out.append((a if a > r else r, o))
        return out

    def _push(self, o: int, es: float) -> Undo:
        m, j = self.tab.machine[o], o // self.k2
        undo = (self.rdy[j], self.last[m], self.mend[m], self.makespan)
        end = es + self.tab.dur[o]
        self.rdy[j] = es + self.tab.lag[o]
        self.last[m] = o
        self.mend[m] = end
        self.nxt[j] = o + 1
        self.seqs[m].append(o)
        if end > self.makespan:
            self.makespan = end
        return undo

    def _pop(self, o: int, undo: Undo) -> None:
        m, j = self.tab.machine[o], o // self.k2
        self.rdy[j], self.last[m], self.mend[m], self.makespan = undo
        self.nxt[j] = o
        self.seqs[m].pop()

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
        for e, o in self._ready():
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

    # -- bounds ------------------------------------------------------------------------

    def bound(self) -> float:
        """A bound on any completion better than the incumbent (``inf``: none exists).

        Heads come from the state (chain and stage availability with switch), tails from
        the chains; `_propagate` tightens both against the target, then every stage's
        Jackson bound and the drains.
        """
        tab, k2 = self.tab, self.k2
        machine, lag, sw = tab.machine, tab.lag, tab.sw
        last, mend, head = self.last, self.mend, self.head
        ops_on: list[list[int]] = [[] for _ in range(tab.stages)]
        chains: list[tuple[int, int]] = []
        for j in range(tab.jobs):
            o = self.nxt[j]
            end = (j + 1) * k2
            if o < end:
                chains.append((o, end))
            r = self.rdy[j]
            while o < end:
                m = machine[o]
                lo = last[m]
                a = mend[m] + sw[lo] if lo >= 0 and lo // k2 != j else mend[m]
                if a > r:
                    r = a
                head[o] = r
                ops_on[m].append(o)
                r += lag[o]
                o += 1
        target = self.ub - self.step
        tail = list(tab.tail)
        if not self._propagate(ops_on, chains, tail, target):
            return _INF
        dext = self.dext
        lb = self.makespan
        for ops in ops_on:
            if ops:
                v = jackson([(head[o], dext[o], tail[o] - dext[o]) for o in ops])
                if v > lb:
                    lb = v
        lb = round_bound(lb, self.integral)
        if lb <= target and not self._drains_fit(target):
            return _INF
        return lb

    def _propagate(
        self,
        ops_on: list[list[int]],
        chains: list[tuple[int, int]],
        tail: list[float],
        target: float,
    ) -> bool:
        """Immediate selection and edge finding per stage, heads and tails pushed along
        the chains, until nothing changes; False if some stage cannot meet ``target``."""
        tab, k2 = self.tab, self.k2
        machine, lag, sw, dur = tab.machine, tab.lag, tab.sw, tab.dur
        head, dext = self.head, self.dext
        dirty = [True] * tab.stages
        for _ in range(8):
            changed = False
            for m, ops in enumerate(ops_on):
                if not dirty[m] or not ops:
                    continue
                dirty[m] = False
                n_ops = len(ops)
                # if no two blocks of the stage can clash with the target, skip the pairs
                r_max = max(head[o] for o in ops)
                t_max = max(tail[o] for o in ops)
                p_max = max(dur[o] + sw[o] for o in ops)
                for x in range(n_ops if r_max + p_max + t_max > target else 0):
                    a = ops[x]
                    ja = a // k2
                    ra, pa, ta = head[a], dur[a], tail[a]
                    if ra + ta > target:
                        return False
                    for y in range(x + 1, n_ops):
                        b = ops[y]
                        if b // k2 == ja:
                            continue
                        rb, tb = head[b], tail[b]
                        ab = ra + pa + sw[a] + tb <= target
                        ba = rb + dur[b] + sw[b] + ta <= target
                        if ab and ba:
                            continue
                        if not (ab or ba):
                            return False
                        if ab:  # a must come before b
                            v = ra + pa + sw[a]
                            if v > rb:
                                head[b] = v
                                changed = True
                            v = pa + sw[a] + tb
                            if v > ta:
                                tail[a] = ta = v
                                changed = True
                        else:
                            v = rb + dur[b] + sw[b]
                            if v > ra:
                                head[a] = ra = v
                                changed = True
                            v = dur[b] + sw[b] + ta
                            if v > tb:
                                tail[b] = v
                                changed = True
                # edge finding only where the stage's whole load can clash with the target
                if n_ops > 2 and (
                    min(head[o] for o in ops)
                    + sum(dext[o] for o in ops)
                    + max(tail[o] - dext[o] for o in ops)
                    > target
                ):
                    found = edge_find(ops, head, tail, dext, target)
                    if found < 0:
                        return False
                    changed = changed or found > 0
            if not changed:
                break
            for first, end in chains:
                for o in range(first, end - 1):
                    v = head[o] + lag[o]
                    if v > head[o + 1]:
                        head[o + 1] = v
                        dirty[machine[o + 1]] = True
                for o in range(end - 2, first - 1, -1):
                    v = lag[o] + tail[o + 1]
                    if v > tail[o]:
                        tail[o] = v
                        dirty[machine[o]] = True
        return True

    def _drains_fit(self, target: float) -> bool:
        """`drain_fits` from each stage ``m`` through each lower stage ``a``'s backward
        blocks, with ``a + 1``'s in between (``a`` alone right below ``m``).

        A drain that has pruned less than once in 64 calls after 256 is tried only on
        every 16th call: skipping a bound is always sound, and most nodes pass them all.
        """
        tab, k2 = self.tab, self.k2
        dur, lag, chain, nxt, head = tab.dur, tab.lag, tab.head, self.nxt, self.head
        for (m, a), stats in zip(self.drains, self.drain_stats, strict=True):
            stats[0] += 1
            if stats[0] > 256 and stats[1] * 64 < stats[0] and stats[0] % 16:
                continue
            if time.perf_counter() > self.deadline:  # large arrays: keep to the limit
                return True
            b = a + 1 if a + 1 < m else -1  # the Y stage, if any
            items: list[tuple[tuple[int, float], float, float, float, int, int]] = []
            for j in range(tab.jobs):
                done = nxt[j] - j * k2
                za = j * k2 + k2 - 1 - a
                if done > k2 - 1 - a:
                    continue
                z, q = dur[za], self.qtail[za]
                if b < 0 or done > k2 - 1 - b:  # the job enters at Z
                    items.append(((0, 0.0), 0.0, z, q, j, za))
                    continue
                # its Z block may start before its Y block ends (update, Eq. 6)
                y = dur[za - 1] if dur[za - 1] < lag[za - 1] else lag[za - 1]
                items.append((johnson_key(y, z), y, z, q, j, za - 1))
            items.sort()
            fixed: list[tuple[float, int]] = []
            work: list[tuple[float, float, float, float, int]] = []
            for i, (_, _, _, _, j, entry) in enumerate(items):
                done = nxt[j] - j * k2
                if done > k2 - 1 - m:  # past m
                    fixed.append((head[entry], i))
                    continue
                fm, bm = j * k2 + m, j * k2 + k2 - 1 - m
                first = fm if done <= m else bm
                w = dur[bm] + (dur[fm] if done <= m else 0.0)
                lag_in = chain[entry] - chain[bm] - dur[bm]
                work.append((head[first], w, lag_in, head[entry], i))
            flow = [(y, z, q) for _, y, z, q, _, _ in items]
            if not drain_fits(work, fixed, flow, target):
                stats[1] += 1
                return False
        return True

    def root_bound(self, lo: float) -> float:
        """The least target the root's bounds accept (bisection from ``lo``)."""
        saved, hi = self.ub, self.ub
        step = self.step if self.integral else max(1e-6, 1e-6 * hi)
        while hi - lo > step * 1.5 and time.perf_counter() < self.deadline:
            mid = round_bound((lo + hi) / 2, self.integral)
            self.ub = mid + self.step  # target: mid
            if self.bound() <= mid:
                hi = mid
            else:
                lo = mid + (self.step if self.integral else 0.0)
        self.ub = saved
        return lo

    # -- search ------------------------------------------------------------------------

    def _branch(self, ready: list[tuple[float, int]]) -> list[tuple[float, int]]:
        """Giffler-Thompson's conflict set on the first stage (by earliest end) where it
        provably holds an optimal completion's next block there, else every ready block."""
        tab, k2 = self.tab, self.k2
        machine, dur, sw, chain = tab.machine, tab.dur, tab.sw, tab.head
        end_on = [_INF] * tab.stages
        first_on = [-1] * tab.stages
        for e, o in ready:
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
                return [(e, o) for e, o in ready if machine[o] == m and (o == ostar or e < reach)]
        return ready

    def run(self, remaining: int) -> None:
        if remaining == 0:
            if self.makespan < self.ub - _EPS:
                self.ub = self.makespan
                self.best = [list(s) for s in self.seqs]
            return
        self.nodes += 1
        if time.perf_counter() > self.deadline:
            raise _Timeout
        k2, nxt, twin = self.k2, self.nxt, self.twin
        kids = [
            (e, o)
            for e, o in self._branch(self._ready())
            # an identical job with a lower index enters first
            if o % k2 or twin[o // k2] < 0 or nxt[twin[o // k2]] != twin[o // k2] * k2
        ]
        scored = []
        for es, o in kids:
            undo = self._push(o, es)
            lb = _INF if self._dominated() else self.bound()
            self._pop(o, undo)
            if lb < self.ub - _EPS:
                scored.append((lb, es, o))
        scored.sort()
        for idx, (lb, es, o) in enumerate(scored):
            if lb >= self.ub - _EPS:
                break
            undo = self._push(o, es)
            try:
                self.run(remaining - 1)
            except _Timeout:
                self.open_bounds.append(min(b for b, _, _ in scored[idx:]))
                raise
            finally:
                self._pop(o, undo)


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


def _twins(tab: OpTable) -> list[int]:
    """For each job, the previous job with identical costs (or -1)."""
    k2 = 2 * tab.stages
    seen: dict[tuple[float, ...], int] = {}
    out = []
    for j in range(tab.jobs):
        ops = range(j * k2, (j + 1) * k2)
        key = tuple(v for o in ops for v in (tab.dur[o], tab.lag[o], tab.sw[o]))
        out.append(seen.get(key, -1))
        seen[key] = j
    return out


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
    search = _Search(tab, res[1], seqs, t0 + time_limit_s)
    finished = True
    if search.ub > root_lb + _EPS:
        root_lb = max(root_lb, search.root_bound(root_lb))
    if search.ub > root_lb + _EPS:
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, tab.n + 200))
        try:
            search.run(tab.n)
        except _Timeout:
            finished = False
        finally:
            sys.setrecursionlimit(old)
    ub = search.ub
    lb = ub if finished else max(root_lb, min([ub, *search.open_bounds]))
    final = semi_active(tab, search.best)
    assert final is not None
    return Result(
        solver="bb",
        orders=tab.orders(search.best),
        makespan=final[1],
        lower_bound=lb,
        optimal=finished or final[1] <= lb + _EPS,
        seconds=time.perf_counter() - t0,
        nodes=search.nodes,
    )
