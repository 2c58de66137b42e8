"""A partial JAPSP schedule and its bound, the node of the branch-and-bound (`adaptipe.japsp.bnb`).

A partial schedule appends blocks stage by stage, each at its earliest start: per job the
blocks done and when the next may start, per stage its last block and when it is free.
`PartialSchedule.bound` bounds every completion better than the incumbent ``ub``,
against the target ``ub - 1`` (integer data) or ``ub``:

- heads from the state, tails from the chains, both pushed along the *twin arcs*: a job
  identical to an earlier one follows it on every stage (`twin_arcs`);
- on every stage, pairs of blocks that cannot run in one order without missing the
  target are fixed in the other (immediate selection), and edge finding
  (`adaptipe.japsp.bounds.edge_find`) raises heads and tails, pushed along the chains
  to a fixed point;
- every stage's Jackson preemptive schedule (Alg. 1 line 14's ``1|r_j|L_max``);
- the pipeline *drains* (`adaptipe.japsp.bounds.drain_fits`): jobs leave a stage one
  after another and queue through the backward blocks of two lower stages, which sees
  what one stage alone cannot: the last jobs through the pipeline still have to cross it.
"""

from __future__ import annotations

import time

from adaptipe.japsp.bounds import drain_fits, edge_find, integral, jackson, johnson_key, round_bound
from adaptipe.japsp.evaluate import OpTable, semi_active

__all__ = ["PartialSchedule", "twin_arcs", "twin_ordered"]

_EPS = 1e-9
_ROUNDS = 8
_INF = float("inf")
Undo = tuple[float, int, float, float]


class PartialSchedule:
    """Blocks appended per stage from time 0, with undo; `bound` against ``ub``."""

    def __init__(self, tab: OpTable, ub: float, deadline: float) -> None:
        self.tab = tab
        k2 = self.k2 = 2 * tab.stages
        self.ub = ub
        self.deadline = deadline
        self.integral = integral(tab)
        self.step = 1.0 if self.integral else _EPS
        # a job's last block on a stage is followed by its switch (or nothing): fold it in
        self.dext = [
            tab.dur[o] + (tab.sw[o] if o % k2 >= tab.stages else 0.0) for o in range(tab.n)
        ]
        self.qtail = [tab.tail[o] - tab.dur[o] for o in range(tab.n)]
        self.p_max = [max(tab.dur[o] + tab.sw[o] for o in ops) for ops in tab.machine_ops]
        self.twin, self.tw_pre = twin_arcs(tab)
        self.tw_post = [-1] * tab.n
        for o, t in enumerate(self.tw_pre):
            if t >= 0:
                self.tw_post[t] = o
        self.any_twin = max(self.tw_pre) >= 0
        self.any_sw = any(tab.sw)
        self.nxt = [j * k2 for j in range(tab.jobs)]
        self.rdy = [0.0] * tab.jobs
        self.last = [-1] * tab.stages
        self.mend = [0.0] * tab.stages
        self.seqs: list[list[int]] = [[] for _ in range(tab.stages)]
        self.makespan = 0.0
        self.head = [0.0] * tab.n
        # drains (upstream stage m, downstream stage a) and how often each one pruned
        self.drains = [(m, a) for m in range(tab.stages - 1, 0, -1) for a in range(m)]
        self.drain_stats = [[0, 0] for _ in self.drains]

    # -- state -------------------------------------------------------------------------

    def ready(self) -> list[tuple[float, int]]:
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

    def push(self, o: int, es: float) -> Undo:
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

    def pop(self, o: int, undo: Undo) -> None:
        m, j = self.tab.machine[o], o // self.k2
        self.rdy[j], self.last[m], self.mend[m], self.makespan = undo
        self.nxt[j] = o
        self.seqs[m].pop()

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
        if self.any_twin:
            self._push_chains(chains, tail, None)
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
        sw, dur = tab.sw, tab.dur
        head, dext, p_max = self.head, self.dext, self.p_max
        dirty = [True] * tab.stages
        for _ in range(_ROUNDS):
            changed = False
            for m, ops in enumerate(ops_on):
                if not dirty[m] or not ops:
                    continue
                dirty[m] = False
                n_ops = len(ops)
                # if no two blocks of the stage can clash with the target, skip the pairs
                r_max = max([head[o] for o in ops])
                t_max = max([tail[o] for o in ops])
                for x in range(n_ops if r_max + p_max[m] + t_max > target else 0):
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
                    min([head[o] for o in ops])
                    + sum([dext[o] for o in ops])
                    + max([tail[o] - dext[o] for o in ops])
                    > target
                ):
                    found = edge_find(ops, head, tail, dext, target)
                    if found < 0:
                        return False
                    changed = changed or found > 0
            if not changed:
                break
            self._push_chains(chains, tail, dirty)
        return True

    def _push_chains(
        self, chains: list[tuple[int, int]], tail: list[float], dirty: list[bool] | None
    ) -> None:
        """Heads forward and tails backward along the chains and the twin arcs (a job
        identical to an earlier one follows it on every stage), marking changed stages."""
        tab, k2 = self.tab, self.k2
        machine, lag, dur, head, nxt = tab.machine, tab.lag, tab.dur, self.head, self.nxt
        pre, post = self.tw_pre, self.tw_post
        for first, end in chains:  # by job: a twin's chain is done before its follower's
            for o in range(first, end):
                v = head[o - 1] + lag[o - 1] if o > first else head[o]
                t = pre[o]
                if t >= 0 and t >= nxt[t // k2] and head[t] + dur[t] > v:
                    v = head[t] + dur[t]
                if v > head[o]:
                    head[o] = v
                    if dirty is not None:
                        dirty[machine[o]] = True
        for first, end in reversed(chains):
            for o in range(end - 1, first - 1, -1):
                v = lag[o] + tail[o + 1] if o < end - 1 else tail[o]
                t = post[o]
                if t >= 0 and t >= nxt[t // k2] and dur[o] + tail[t] > v:
                    v = dur[o] + tail[t]
                if v > tail[o]:
                    tail[o] = v
                    if dirty is not None:
                        dirty[machine[o]] = True

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


def twin_arcs(tab: OpTable) -> tuple[list[int], list[int]]:
    """Per job the previous job with identical costs (its *twin*, or -1), and per block
    the block it follows on its stage by symmetry (or -1).

    Twins are interchangeable, so some optimal schedule lets the lower index enter the
    pipeline first. Without switches more holds: give, at every chain position, the
    earlier of the two starts to the lower index. That keeps every chain (each position
    is no earlier than the previous one plus its lag, for both order statistics) and
    every stage's busy intervals, so the schedule stays feasible with the same makespan,
    and the lower index goes first on every stage. A switch would not survive the swap
    (a job's forward and backward blocks on a stage could change hands), so twins with
    switches only keep the entry order.
    """
    k2 = 2 * tab.stages
    seen: dict[tuple[float, ...], int] = {}
    twin = []
    pre = [-1] * tab.n
    for j in range(tab.jobs):
        ops = range(j * k2, (j + 1) * k2)
        key = tuple(v for o in ops for v in (tab.dur[o], tab.lag[o], tab.sw[o]))
        t = seen.get(key, -1)
        twin.append(t)
        seen[key] = j
        if t >= 0 and not any(tab.sw[o] for o in ops):
            for k in range(k2):
                pre[j * k2 + k] = t * k2 + k
    return twin, pre


def twin_ordered(tab: OpTable, seqs: list[list[int]]) -> list[list[int]] | None:
    """The schedule of ``seqs`` relabelled as in `twin_arcs`: at every chain position the
    twins' starts in index order, and the stage orders that follow (None on a cycle).
    The makespan is the same, or less where the new orders let blocks start earlier."""
    res = semi_active(tab, seqs)
    if res is None:
        return None
    start = res[0]
    k2 = 2 * tab.stages
    _, pre = twin_arcs(tab)
    group = list(range(tab.jobs))  # the first job of each group of twins
    members: dict[int, list[int]] = {}
    for j in range(tab.jobs):
        if pre[j * k2] >= 0:
            group[j] = group[pre[j * k2] // k2]
        members.setdefault(group[j], []).append(j)
    new = list(start)
    for jobs in members.values():
        for k in range(k2 if len(jobs) > 1 else 0):
            times = sorted(start[j * k2 + k] for j in jobs)
            for j, t in zip(jobs, times, strict=True):
                new[j * k2 + k] = t
    # a block of no length goes first at its start, as does the earlier chain position
    return [
        sorted(ops, key=lambda o: (new[o], tab.dur[o] > 0, o % k2, o)) for ops in tab.machine_ops
    ]
