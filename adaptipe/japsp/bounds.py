"""Lower bounds on the JAPSP makespan (Eq. 3-9), from the disjunctive graph of Fig. 6.

Three relaxations, each valid on its own; `lower_bound` is their maximum:

- *chain*: one job alone, its conjunctive arcs only (Eq. 5-7);
- *load*: a stage runs all ``2J`` of its blocks one at a time, cannot start before the
  earliest head of any of them, must pay at least ``sum(w) - max(w)`` of switches (every
  job but the last one it serves is left once, Eq. 8-9) and ends no earlier than the
  least tail after one of them;
- *one machine*: the paper's ``1|r_j|L_max`` sub-problem of Alg. 1 line 14, relaxed to
  preemption and solved exactly by Jackson's preemptive schedule (largest tail first):
  each stage with release times ``r`` (chain heads), processing times and delivery
  times ``q`` (chain tails). A job's last block on a stage is always followed by a
  switch (or nothing), so its switch is folded into its processing time and taken off
  its delivery time, which keeps the relaxation valid.

The branch-and-bound (`adaptipe.japsp.bnb`) reuses `jackson` with heads from its partial
schedule, and adds two tools of its own that test a target rather than give a number:
`edge_find` (one stage's heads and tails tightened by edge finding) and `drain_fits`
(the pipeline drain: jobs leave a stage one after another and then queue through the
backward blocks of two lower stages, a relaxation that keeps three stages).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

from adaptipe.japsp.evaluate import OpTable
from adaptipe.japsp.instance import JapspInstance

__all__ = [
    "bounds",
    "drain_fits",
    "edge_find",
    "jackson",
    "johnson_key",
    "lower_bound",
    "round_bound",
    "schrage",
]

_EPS = 1e-9


def jackson(items: Iterable[tuple[float, float, float]]) -> float:
    """Optimal ``max_o (C_o + q_o)`` of one machine, preemptive, items ``(r, p, q)``.

    Jackson's rule (Carlier 1982): at every release or completion run the released item
    with the largest delivery time ``q``; this is optimal for ``1|r_j, pmtn|L_max`` and a
    lower bound for the non-preemptive ``1|r_j|L_max`` of Alg. 1 (line 14).
    """
    jobs = sorted(items)
    n = len(jobs)
    if not n:
        return 0.0
    heap: list[tuple[float, float]] = []  # (-q, remaining p)
    t = jobs[0][0]
    i = 0
    best = -math.inf
    while i < n or heap:
        if not heap and t < jobs[i][0]:
            t = jobs[i][0]
        while i < n and jobs[i][0] <= t:
            heapq.heappush(heap, (-jobs[i][2], jobs[i][1]))
            i += 1
        nq, p = heapq.heappop(heap)
        nxt = jobs[i][0] if i < n else math.inf
        if t + p <= nxt:
            t += p
            if t - nq > best:
                best = t - nq
        else:  # preempted by the next release
            heapq.heappush(heap, (nq, p - (nxt - t)))
            t = nxt
    return best


def drain_fits(
    work: Sequence[tuple[float, float, float, float, int]],
    fixed: Sequence[tuple[float, int]],
    flow: Sequence[tuple[float, float, float]],
    target: float,
    *,
    effort: int = 500,
) -> bool:
    """Whether the pipeline drain can end by ``target``: jobs leave an upstream stage
    ``M`` one after another, then cross a two-stage flow ``Y -> Z`` (Eq. 6 chains).

    ``flow[i]`` is ``(y, z, q)`` of flow item ``i``: its time on ``Y`` (0 if it only
    needs ``Z``), on ``Z``, and the least time from ``Z`` to the end; ``flow`` must be
    in Johnson's order (`johnson_key`). ``fixed`` holds ``(release, i)`` of items no
    longer on ``M``. ``work`` holds, per job still on ``M``, ``(h, w, l, floor, i)``: its
    remaining work ``w`` there (not before ``h``) and the lag ``l`` from its completion
    there to the release of its item ``i`` on ``Y``, never before ``floor``.

    Whatever the order in which jobs finish on ``M``, the ``k``-th cannot finish before
    ``M`` has done all the work of the first ``k`` (``E``: their work in order of ``h``),
    so its item is released at ``E + l`` or later. The flow with releases ``r`` then ends
    no earlier than ``tau + F2(items released at tau or later) + their least q`` for
    every ``tau`` (F2 by Johnson's rule, optimal for ``F2||C_max``). If no order fits,
    no schedule does. Orders are searched depth first, longest drain first; a partial
    order is pruned when the bound with unplaced jobs at their earliest release misses.
    After ``effort`` partial orders the answer is True (not proven infeasible).
    """
    drain = _Drain(work, fixed, flow, target, effort)
    if not work:
        return drain.value() <= target
    # the longest drains first: try that order whole before searching
    order = sorted(range(len(work)), key=lambda x: -(work[x][2] + sum(flow[work[x][4]])))
    return drain.fits_in(order) or drain.search(len(work))


class _Drain:
    """One `drain_fits` search: the flow items' releases (inf: not yet released) and the
    ``(h, w)`` of the jobs placed on ``M`` so far, by ``h``."""

    def __init__(
        self,
        work: Sequence[tuple[float, float, float, float, int]],
        fixed: Sequence[tuple[float, int]],
        flow: Sequence[tuple[float, float, float]],
        target: float,
        effort: int,
    ) -> None:
        self.work, self.flow, self.target, self.effort = work, flow, target, effort
        self.rel = [math.inf] * len(flow)
        for r, i in fixed:
            self.rel[i] = r
        self.hws: list[tuple[float, float]] = []
        self.used = [False] * len(work)
        self.spent = 0

    def value(self) -> float:
        """The flow's least end over every release time ``tau`` (Johnson's F2 bound)."""
        rel, flow, n = self.rel, self.flow, len(self.flow)
        best = -math.inf
        for tau in set(rel):
            if tau == math.inf:
                continue
            c1 = c2 = tau
            qmin = math.inf
            for i in range(n):
                if rel[i] >= tau and rel[i] != math.inf:
                    y, z, q = flow[i]
                    c1 += y
                    c2 = (c2 if c2 > c1 else c1) + z
                    if q < qmin:
                        qmin = q
            if c2 + qmin > best:
                best = c2 + qmin
        return best

    def finish(self, h0: float, w0: float) -> float:
        """When ``M`` ends the placed jobs' work and ``w0`` (not before ``h0``), by ``h``."""
        t = -math.inf
        placed = False
        for h, w in self.hws:
            if not placed and h0 < h:
                t = (t if t > h0 else h0) + w0
                placed = True
            t = (t if t > h else h) + w
        if not placed:
            t = (t if t > h0 else h0) + w0
        return t

    def release(self, x: int) -> int:
        """Release job ``x``'s item as if it left ``M`` after the placed jobs; its index."""
        h, w, lag, floor, i = self.work[x]
        r = self.finish(h, w) + lag
        self.rel[i] = r if r > floor else floor
        return i

    def place(self, x: int) -> int:
        """Add job ``x``'s ``(h, w)`` to the placed jobs; its position there."""
        h, w = self.work[x][0], self.work[x][1]
        pos = 0
        while pos < len(self.hws) and self.hws[pos][0] <= h:
            pos += 1
        self.hws.insert(pos, (h, w))
        return pos

    def fits_in(self, order: Sequence[int]) -> bool:
        """Whether the jobs leaving ``M`` in ``order`` fit; the state is reset after."""
        for x in order:
            self.release(x)
            self.place(x)
        if self.value() <= self.target:
            return True
        self.hws.clear()
        for x in order:
            self.rel[self.work[x][4]] = math.inf
        return False

    def search(self, left: int) -> bool:
        """Depth first over which unplaced job leaves ``M`` next, longest drain first."""
        self.spent += 1
        if self.spent > self.effort:
            return True
        kids: list[tuple[float, int]] = []
        for x in range(len(self.work)):
            if not self.used[x]:
                i = self.release(x)
                y, z, q = self.flow[i]
                kids.append((-(self.work[x][2] + y + z + q), x))
        fits = self.value() <= self.target
        for _, x in kids:
            self.rel[self.work[x][4]] = math.inf
        if not fits or left == 1:
            return fits
        kids.sort()
        for _, x in kids:
            i = self.release(x)
            self.used[x] = True
            pos = self.place(x)
            fits = self.search(left - 1)
            self.rel[i] = math.inf
            self.hws.pop(pos)
            self.used[x] = False
            if fits:
                return True
        return False


def edge_find(
    ops: Sequence[int],
    head: list[float],
    tail: list[float],
    dext: Sequence[float],
    target: float,
) -> int:
    """Edge finding on one stage against ``target`` (Carlier and Pinson's rules).

    ``head[o]`` is the earliest start of block ``o``, ``tail[o]`` the least time from its
    start to the end, ``dext[o]`` its time with its switch folded in. A block that cannot
    come before or within a set ``S`` of the stage's blocks without some block of ``S``
    missing ``target`` must follow all of ``S``: its head rises to the earliest end of
    every subset of ``S`` (and, mirrored in time, a block that must precede ``S`` gets its
    tail raised). The sets are those of blocks with deadlines up to one block's and heads
    from one block's on, O(n^2) per stage. Returns -1 if the stage cannot meet
    ``target`` at all, 1 if a head or tail rose, else 0. Both rules hold for any
    schedule that ends by ``target``, so the caller may prune or tighten with them.
    """
    n = len(ops)
    if not n:
        return 0
    psuf = [0.0] * n
    csuf = [0.0] * n
    changed = 0
    for side in (0, 1):
        if side == 0:  # releases and deadlines
            keyed = sorted([(head[o], target - tail[o] + dext[o], dext[o], o) for o in ops])
        else:  # the mirror image: delivery times and latest starts
            keyed = sorted([(tail[o] - dext[o], target - head[o], dext[o], o) for o in ops])
        r, d, p, _ = map(list, zip(*keyed, strict=True))  # all by release
        new_r = list(r)
        for dk in set(d):
            # suffix sums over blocks by release: work with deadline <= dk, and the
            # latest end E(S) of those sets
            acc, c = 0.0, -math.inf
            p_out = 0.0  # the longest block outside
            for pos in range(n - 1, -1, -1):
                if d[pos] <= dk:
                    acc += p[pos]
                    if r[pos] + acc > c:
                        c = r[pos] + acc
                elif p[pos] > p_out:
                    p_out = p[pos]
                psuf[pos], csuf[pos] = acc, c
            if c > dk:
                return -1
            # both rules below compare dk with an outside block's p plus some r + psuf of
            # a set, which is at most c: nothing rises unless c + p_out exceeds dk
            if c + p_out <= dk:
                continue
            best, best_c = -math.inf, -math.inf  # the tightest set released earlier
            for pos in range(n):
                rx = r[pos]
                if d[pos] > dk:
                    px = p[pos]
                    if rx + px + psuf[pos] > dk and csuf[pos] > new_r[pos]:
                        new_r[pos] = csuf[pos]
                    if best + px > dk and best_c > new_r[pos]:
                        new_r[pos] = best_c
                if rx + psuf[pos] > best:
                    best, best_c = rx + psuf[pos], csuf[pos]
        for pos in range(n):
            if new_r[pos] > r[pos]:
                changed = 1
                o = keyed[pos][3]
                if side == 0:
                    head[o] = new_r[pos]
                else:
                    tail[o] = new_r[pos] + dext[o]
    return changed


def johnson_key(y: float, z: float) -> tuple[int, float]:
    """Sort key of Johnson's rule for ``F2||C_max``: short ``y`` first among ``y <= z``,
    then long ``z`` first."""
    return (0, y) if y <= z else (1, -z)


def stage_items(
    tab: OpTable, ops: Sequence[int], release: Sequence[float]
) -> list[tuple[float, float, float]]:
    """``(r, p, q)`` of ``ops`` on one stage with the switch folded into each job's
    last block there (processing ``+w``, delivery ``-w``)."""
    k2 = 2 * tab.stages
    s_count = tab.stages
    out = []
    for o in ops:
        extra = tab.sw[o] if o % k2 >= s_count else 0.0
        d = tab.dur[o]
        out.append((release[o], d + extra, tab.tail[o] - d - extra))
    return out


def bounds(inst: JapspInstance | OpTable) -> dict[str, float]:
    """The chain, load and one-machine bounds of the module doc, by name."""
    tab = inst if isinstance(inst, OpTable) else OpTable.of(inst)
    k2 = 2 * tab.stages
    chain = max(tab.tail[j * k2] for j in range(tab.jobs))
    load = 0.0
    one = 0.0
    for ops in tab.machine_ops:
        sws = [tab.sw[o] for o in ops if o % k2 >= tab.stages]
        total = (
            min(tab.head[o] for o in ops)
            + sum(tab.dur[o] for o in ops)
            + sum(sws)
            - max(sws)
            + min(tab.tail[o] - tab.dur[o] for o in ops)
        )
        load = max(load, total)
        one = max(one, jackson(stage_items(tab, ops, tab.head)))
    return {"chain": chain, "load": load, "one_machine": one}


def integral(tab: OpTable) -> bool:
    """Whether every time is an integer (so the makespan is one and bounds round up)."""
    return all(float(v).is_integer() for vals in (tab.dur, tab.lag, tab.sw) for v in vals)


def round_bound(value: float, is_integral: bool) -> float:
    return float(math.ceil(value - _EPS)) if is_integral else value


def lower_bound(inst: JapspInstance | OpTable) -> float:
    """The best of the chain, load and one-machine bounds (rounded up on integer data)."""
    tab = inst if isinstance(inst, OpTable) else OpTable.of(inst)
    return round_bound(max(bounds(tab).values()), integral(tab))


def schrage(
    tab: OpTable, ops: Sequence[int], head: Sequence[float], tail: Sequence[float]
) -> tuple[list[int], float]:
    """Schrage's rule for one stage's ``1|r_j|L_max`` (the non-preemptive Jackson rule).

    Whenever the stage is free it starts, among the blocks that can start by the
    earliest possible start, the one with the longest tail; switches (Eq. 8-9) count in
    when a block can start, and a job's backward block waits for its forward block plus
    the chain between them. ``tail`` runs from a block's start to the end (so the rule
    compares ``tail - duration``). Returns the order and its ``max(start + tail)``.
    """
    k2, s_count = 2 * tab.stages, tab.stages
    dur, sw = tab.dur, tab.sw
    rel = {o: head[o] for o in ops}
    waiting = {o - (o % k2) + (k2 - 1 - o % k2) for o in ops if o % k2 < s_count}
    waiting &= set(rel)
    todo = [o for o in ops if o not in waiting]
    free, last, value = -math.inf, -1, -math.inf
    seq: list[int] = []
    while todo:
        best, best_t, best_q = -1, math.inf, -math.inf
        avail = []
        for o in todo:
            a = free + sw[last] if last >= 0 and last // k2 != o // k2 else free
            r = rel[o]
            avail.append(a if a > r else r)
        t = min(avail)
        for o, a in zip(todo, avail, strict=True):
            q = tail[o] - dur[o]
            if a <= t and (q > best_q or (q == best_q and o < best)):
                best, best_t, best_q = o, a, q
        todo.remove(best)
        seq.append(best)
        free, last = best_t + dur[best], best
        value = max(value, best_t + tail[best])
        if best % k2 < s_count:
            sib = best - best % k2 + (k2 - 1 - best % k2)
            if sib in waiting:
                waiting.discard(sib)
                rel[sib] = max(rel[sib], best_t + tab.head[sib] - tab.head[best])
                todo.append(sib)
    return seq, value
