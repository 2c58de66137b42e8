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
schedule.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

from adaptipe.japsp.evaluate import OpTable
from adaptipe.japsp.instance import JapspInstance

__all__ = ["bounds", "jackson", "lower_bound", "round_bound", "schrage"]

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
