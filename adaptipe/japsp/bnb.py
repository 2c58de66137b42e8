"""Branch-and-bound that proves JAPSP optima (the paper's B&B, Alg. 1, made exact).

Alg. 1 grows a schedule block by block, choosing at each step among the blocks that
could start first the one whose extended graph has the least bound
``makespan + 1|r_j|L_max`` (lines 5-17). Taking only the best choice is a heuristic;
this module keeps every choice open and searches them depth first, which makes it exact:

- *Branching* (active-schedule generation, Giffler-Thompson style): blocks are appended
  in non-decreasing start time. A ready block ``o`` is a child unless some other ready
  block ``o'`` could start earlier and finish, with its switch, by ``o``'s start: then
  ``o'`` could be left-shifted into the idle time and the schedule would not be active.
  An optimal schedule is active, so the search stays complete, and each active schedule
  is generated once (equal starts are taken in operation order).
- *Bounding*: heads from the partial schedule (chain, stage availability with switch,
  the current start time) and tails from the chains are first tightened against the
  incumbent: two blocks of a stage that cannot run in one order without reaching it
  are fixed in the other (immediate selection), to a fixed point. The bound is then the
  largest of every stage's Jackson preemptive schedule (the ``1|r_j|L_max`` of Alg. 1
  line 14, `adaptipe.japsp.bounds.jackson`) and of two-machine flow-shop bounds of
  neighbouring stages (Johnson's rule on the forward and the backward pass).
- *Symmetry*: jobs with identical costs are interchangeable, so they enter the pipeline
  in index order.
- *Initial upper bound*: the GA (or a given schedule); children are explored best bound
  first. ``optimal`` is True only when the search finished; at the time limit the bound
  reported is the least bound of the unexplored nodes.
"""

from __future__ import annotations

import sys
import time

from adaptipe.japsp.bounds import integral, jackson, lower_bound, round_bound
from adaptipe.japsp.evaluate import OpTable, Orders, semi_active, to_seqs
from adaptipe.japsp.instance import JapspInstance
from adaptipe.japsp.solve import Result

__all__ = ["solve_bnb"]

_EPS = 1e-9
_INF = float("inf")


class _Timeout(Exception):
    pass


class _Search:
    """Mutable search state; `run` is the depth-first recursion with undo."""

    def __init__(self, tab: OpTable, ub: float, seqs: list[list[int]], deadline: float) -> None:
        self.tab = tab
        self.k2 = 2 * tab.stages
        self.ub = ub
        self.best = [list(s) for s in seqs]
        self.deadline = deadline
        self.integral = integral(tab)
        self.nodes = 0
        self.open_bounds: list[float] = []
        k2, s_count = self.k2, tab.stages
        self.dext = [tab.dur[o] + (tab.sw[o] if o % k2 >= s_count else 0.0) for o in range(tab.n)]
        self.ties_by_id = min(tab.dur) > 0
        self.twin = _twins(tab)
        self.nxt = [j * k2 for j in range(tab.jobs)]
        self.rdy = [0.0] * tab.jobs
        self.start = [0.0] * tab.n
        self.last = [-1] * tab.stages
        self.mend = [0.0] * tab.stages
        self.seqs: list[list[int]] = [[] for _ in range(tab.stages)]
        self.makespan = 0.0
        self.head = [0.0] * tab.n
        self.step = 1.0 if self.integral else _EPS
        self.flow_pairs = tab.stages > 1

    def bound(self, t: float) -> float:
        """A bound on any completion better than the incumbent (``inf``: none exists).

        Heads come from the partial schedule (chain, stage availability with switch, and
        ``t``), tails are static. Then, against the target ``ub - 1`` (integer data) or
        ``ub``, pairs of a stage's blocks that cannot go in one order are fixed in the
        other (disjunctive immediate selection) and heads and tails are pushed along the
        chains, to a fixed point; finally every stage's Jackson bound.
        """
        tab, k2 = self.tab, self.k2
        machine, lag, sw, dur = tab.machine, tab.lag, tab.sw, tab.dur
        last, mend = self.last, self.mend
        head = self.head
        tail = list(tab.tail)
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
                if t > r:
                    r = t
                head[o] = r
                ops_on[m].append(o)
                r += lag[o]
                o += 1
        target = self.ub - self.step
        for _ in range(8):
            changed = False
            for ops in ops_on:
                n_ops = len(ops)
                for x in range(n_ops):
                    a = ops[x]
                    ja = a // k2
                    ra, pa, ta = head[a], dur[a], tail[a]
                    if ra + ta > target:
                        return _INF
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
                            return _INF
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
            if not changed:
                break
            for first, end in chains:
                for o in range(first, end - 1):
                    v = head[o] + lag[o]
                    if v > head[o + 1]:
                        head[o + 1] = v
                for o in range(end - 2, first - 1, -1):
                    v = lag[o] + tail[o + 1]
                    if v > tail[o]:
                        tail[o] = v
        dext = self.dext
        lb = self.makespan
        for ops in ops_on:
            if ops:
                v = jackson([(head[o], dext[o], tail[o] - dext[o]) for o in ops])
                if v > lb:
                    lb = v
        if self.flow_pairs:
            v = self.flow_bound(head, tail)
            if v > lb:
                lb = v
        return round_bound(lb, self.integral)

    def flow_bound(self, head: list[float], tail: list[float]) -> float:
        """Two-machine flow-shop bounds of neighbouring stages, by Johnson's rule.

        The backward pass crosses stage ``s+1`` then ``s``: each job still to run its
        backward block on ``s`` first needs its remaining work on ``s+1`` (machine 1, less
        the update, which runs after the gradient left, Eq. 6), then that block (machine
        2), then its least tail; the forward pass likewise
        crosses ``s`` then ``s+1``. Dropping the other constraints leaves F2||C_max with
        ready times, which Johnson's rule solves (splitting a job's work on one machine
        is preemption, which does not help in F2), so this bounds the makespan.
        """
        k2, nxt, dur, rel = self.k2, self.nxt, self.tab.dur, self.tab.rel
        best = 0.0
        for s in range(self.tab.stages - 1):
            for backward in (True, False):
                a: list[float] = []
                b: list[float] = []
                t1 = t2 = q = _INF
                for j in range(self.tab.jobs):
                    base, done = j * k2, nxt[j] - j * k2
                    f_up, b_up = base + s + 1, base + k2 - 2 - s  # F, B on stage s+1
                    f_lo, b_lo = base + s, base + k2 - 1 - s  # F, B on stage s
                    last = b_lo if backward else b_up
                    if done > last - base:
                        continue
                    w_up = (dur[f_up] if done <= s + 1 else 0.0) + dur[b_up]
                    if backward:  # machine 1: stage s+1, machine 2: B(j, s)
                        # the update of B(j, s+1) runs after its gradient left: drop it
                        w1 = w_up - dur[b_up] + rel[b_up] if done <= b_up - base else 0.0
                        first, m2, w2 = (f_up if done <= s + 1 else b_up), b_lo, dur[b_lo]
                    else:  # machine 1: F(j, s), machine 2: the rest on stage s+1
                        w1 = dur[f_lo] if done <= s else 0.0
                        first, m2, w2 = f_lo, (f_up if done <= s + 1 else b_up), w_up
                    a.append(w1)
                    b.append(w2)
                    # a job done on machine 1 reaches machine 2 by its head there
                    t1 = min(t1, head[first] if w1 > 0 else head[m2])
                    t2 = min(t2, head[m2])
                    q = min(q, tail[last] - dur[last])
                if a:
                    v = _johnson(a, b, 0.0 if t1 == _INF else t1, t2) + q
                    if v > best:
                        best = v
        return best

    def run(self, t_last: float, last_op: int, remaining: int) -> None:
        if remaining == 0:
            if self.makespan < self.ub - _EPS:
                self.ub = self.makespan
                self.best = [list(s) for s in self.seqs]
            return
        self.nodes += 1
        if not self.nodes & 255 and time.perf_counter() > self.deadline:
            raise _Timeout
        tab, k2 = self.tab, self.k2
        machine, dur, sw = tab.machine, tab.dur, tab.sw
        nxt, last, mend, rdy = self.nxt, self.last, self.mend, self.rdy
        ready: list[tuple[float, int]] = []
        for j in range(tab.jobs):
            o = nxt[j]
            if o == (j + 1) * k2:
                continue
            tw = self.twin[j]
            if o == j * k2 and tw >= 0 and nxt[tw] == tw * k2:
                continue  # an identical job with a lower index enters first
            m = machine[o]
            lo = last[m]
            a = mend[m] + sw[lo] if lo >= 0 and lo // k2 != j else mend[m]
            ready.append((a if a > rdy[j] else rdy[j], o))
        ready.sort()
        children: list[tuple[float, float, int]] = []
        window = float("inf")
        i = 0
        while i < len(ready):
            es = ready[i][0]
            group = i
            while i < len(ready) and ready[i][0] == es:
                i += 1
            if es >= window:
                break  # a block that starts earlier fits, with its switch, before this one
            for es_o, o in ready[group:i]:
                if es_o < t_last or (es_o == t_last and self.ties_by_id and o < last_op):
                    continue
                children.append((0.0, es_o, o))
            for es_o, o in ready[group:i]:
                window = min(window, es_o + dur[o] + sw[o])
        scored = []
        for _, es, o in children:
            undo = self._push(o, es)
            lb = self.bound(es)
            self._pop(o, undo)
            if lb < self.ub - _EPS:
                scored.append((lb, es, o))
        scored.sort()
        for idx, (lb, es, o) in enumerate(scored):
            if lb >= self.ub - _EPS:
                break
            undo = self._push(o, es)
            try:
                self.run(es, o, remaining - 1)
            except _Timeout:
                self.open_bounds.append(min(b for b, _, _ in scored[idx:]))
                raise
            finally:
                self._pop(o, undo)

    def _push(self, o: int, es: float) -> tuple[float, int, float, float]:
        m, j = self.tab.machine[o], o // self.k2
        undo = (self.rdy[j], self.last[m], self.mend[m], self.makespan)
        self.start[o] = es
        end = es + self.tab.dur[o]
        self.rdy[j] = es + self.tab.lag[o]
        self.last[m] = o
        self.mend[m] = end
        self.nxt[j] = o + 1
        self.seqs[m].append(o)
        if end > self.makespan:
            self.makespan = end
        return undo

    def _pop(self, o: int, undo: tuple[float, int, float, float]) -> None:
        m, j = self.tab.machine[o], o // self.k2
        self.rdy[j], self.last[m], self.mend[m], self.makespan = undo
        self.nxt[j] = o
        self.seqs[m].pop()


def _johnson(a: list[float], b: list[float], t1: float, t2: float) -> float:
    """Optimal F2 makespan (Johnson's rule) with machines free from ``t1`` and ``t2``."""
    order = sorted(range(len(a)), key=lambda j: (0, a[j]) if a[j] <= b[j] else (1, -b[j]))
    c1, c2 = t1, t2
    for j in order:
        c1 += a[j]
        c2 = (c2 if c2 > c1 else c1) + b[j]
    return c2


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
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, tab.n + 200))
        try:
            search.run(-1.0, -1, tab.n)
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
