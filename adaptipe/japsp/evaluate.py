"""Schedules of a JAPSP instance: per-stage block orders and their timelines.

A schedule is, per stage, the order of its ``2J`` blocks (``("F", j)`` / ``("B", j)``).
Internally every block is an *operation* ``o = j * 2S + k``: position ``k`` of job
``j``'s chain ``F0 -> F1 -> ... -> F(S-1) -> B(S-1) -> ... -> B0`` (so its stage is
``k`` for ``k < S`` and ``2S-1-k`` after). Per operation (the disjunctive graph of
Fig. 6, node and arc weights):

- ``dur[o]``: how long it occupies its stage: ``r_f``, or ``r_b + re + u`` (Eq. 9);
- ``lag[o]``: start of ``o`` to the earliest start of its chain successor: ``r_f + eta``
  (Eq. 5), ``r_b + re + eta`` (Eq. 6; the update runs after the gradient left);
- ``sw[o]``: the switch ``w`` its stage pays after it if the next block there belongs to
  another job (Eq. 8-9).

`evaluate` computes the semi-active schedule of given orders (every block starts as soon
as its chain predecessor and its stage predecessor allow) and the makespan ``T`` of
Eq. 3. `decode` is the GA's active-schedule decoder.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

from adaptipe.errors import PlanError, ScheduleError
from adaptipe.japsp.instance import JapspInstance

__all__ = [
    "Block",
    "OpTable",
    "Orders",
    "Timeline",
    "checked_seqs",
    "critical_blocks",
    "decode",
    "evaluate",
    "longest_paths",
    "parse_block",
    "semi_active",
]

Block = tuple[Literal["F", "B"], int]
Orders = tuple[tuple[Block, ...], ...]


@dataclass(frozen=True, slots=True)
class OpTable:
    """The instance flattened to per-operation lists (the solvers' working form)."""

    jobs: int
    stages: int
    machine: list[int]
    job: list[int]
    dur: list[float]
    lag: list[float]
    sw: list[float]
    rel: list[float]  # start to the moment its output leaves (dur without the update)
    head: list[float]  # earliest start along the job chain alone
    tail: list[float]  # least time from the start of o to the end of the schedule
    machine_ops: list[list[int]]

    @property
    def n(self) -> int:
        return len(self.dur)

    @classmethod
    def of(cls, inst: JapspInstance) -> OpTable:
        jobs, stages = inst.num_jobs, inst.num_stages
        k2 = 2 * stages
        machine, job, dur, lag, sw, rel = [], [], [], [], [], []
        for j in range(jobs):
            for k in range(k2):
                s = k if k < stages else k2 - 1 - k
                machine.append(s)
                job.append(j)
                sw.append(inst.switch[j][s])
                if k < stages:
                    rel.append(inst.forward[j][s])
                    dur.append(inst.forward[j][s])
                    lag.append(inst.forward[j][s] + (inst.comm[j][s] if k < stages - 1 else 0.0))
                else:
                    busy = inst.backward[j][s] + inst.recompute[j][s]
                    rel.append(busy)
                    dur.append(busy + inst.update[j][s])
                    lag.append(busy + (inst.comm[j][s - 1] if s > 0 else 0.0))
        n = jobs * k2
        head = [0.0] * n
        tail = [0.0] * n
        for j in range(jobs):
            base = j * k2
            for k in range(1, k2):
                head[base + k] = head[base + k - 1] + lag[base + k - 1]
            tail[base + k2 - 1] = dur[base + k2 - 1]
            for k in range(k2 - 2, -1, -1):
                o = base + k
                tail[o] = max(dur[o], lag[o] + tail[o + 1])
        machine_ops = [[o for o in range(n) if machine[o] == m] for m in range(stages)]
        return cls(jobs, stages, machine, job, dur, lag, sw, rel, head, tail, machine_ops)

    def block(self, o: int) -> Block:
        k = o % (2 * self.stages)
        return ("F" if k < self.stages else "B", o // (2 * self.stages))

    def op(self, block: Block, stage: int) -> int:
        kind, j = block
        return j * 2 * self.stages + (stage if kind == "F" else 2 * self.stages - 1 - stage)

    def orders(self, seqs: Sequence[Sequence[int]]) -> Orders:
        return tuple(tuple(self.block(o) for o in seq) for seq in seqs)


@dataclass(frozen=True, slots=True)
class Timeline:
    """Start and end of every block, aligned with ``orders``; ``makespan`` is Eq. 3's T."""

    orders: Orders
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    makespan: float


def parse_block(raw: object) -> Block:
    """``("F", 3)``, ``["B", 0]`` or ``"F3"`` -> ``("F", 3)``."""
    if isinstance(raw, str) and len(raw) > 1 and raw[0] in "FB" and raw[1:].isdigit():
        return ("F" if raw[0] == "F" else "B", int(raw[1:]))
    if isinstance(raw, tuple | list) and len(raw) == 2 and raw[0] in ("F", "B"):
        j = raw[1]
        if isinstance(j, int) and not isinstance(j, bool):
            return ("F" if raw[0] == "F" else "B", j)
    raise ScheduleError(f"block {raw!r} must be ('F' | 'B', job) or a string like 'F3'")


def semi_active(tab: OpTable, seqs: Sequence[Sequence[int]]) -> tuple[list[float], float] | None:
    """Starts of the semi-active schedule of machine sequences ``seqs``; None on a cycle."""
    # The GA and the tabu search spend about half their time here: local names, and the
    # job list instead of divisions (the same pass and order, so the same floats).
    n, k2 = tab.n, 2 * tab.stages
    dur, lag, sw, job = tab.dur, tab.lag, tab.sw, tab.job
    succ_m = [-1] * n
    cnt = [1] * n
    for o in range(0, n, k2):  # a chain's first block waits for no chain predecessor
        cnt[o] = 0
    for seq in seqs:
        for prev, o in pairwise(seq):
            succ_m[prev] = o
            cnt[o] += 1
    ready = [0.0] * n
    start = [0.0] * n
    stack = [o for o in range(0, n, k2) if cnt[o] == 0]
    pop, push = stack.pop, stack.append
    done = 0
    makespan = 0.0
    while stack:
        o = pop()
        done += 1
        s = ready[o]
        start[o] = s
        e = s + dur[o]
        if e > makespan:
            makespan = e
        c = o + 1
        if c % k2:
            v = s + lag[o]
            if v > ready[c]:
                ready[c] = v
            cnt[c] -= 1
            if not cnt[c]:
                push(c)
        m = succ_m[o]
        if m >= 0:
            v = e + sw[o] if job[m] != job[o] else e
            if v > ready[m]:
                ready[m] = v
            cnt[m] -= 1
            if not cnt[m]:
                push(m)
    return (start, makespan) if done == n else None


def to_seqs(tab: OpTable, orders: Sequence[Sequence[object]]) -> list[list[int]]:
    """Check ``orders`` holds every block of every stage once; return operation ids."""
    if len(orders) != tab.stages:
        raise ScheduleError(f"orders must hold {tab.stages} stage lists (got {len(orders)})")
    seqs: list[list[int]] = []
    for s, order in enumerate(orders):
        seen: dict[Block, int] = {}
        seq: list[int] = []
        for i, raw in enumerate(order):
            blk = parse_block(raw)
            if not 0 <= blk[1] < tab.jobs:
                raise ScheduleError(
                    f"stage {s}, position {i}: job {blk[1]} out of range (J={tab.jobs})"
                )
            if blk in seen:
                raise ScheduleError(f"stage {s}, position {i}: {blk} repeats position {seen[blk]}")
            if blk[0] == "B" and ("F", blk[1]) not in seen:
                raise ScheduleError(
                    f"stage {s}, position {i}: B{blk[1]} comes before F{blk[1]} on this stage"
                )
            seen[blk] = i
            seq.append(tab.op(blk, s))
        if len(seq) != 2 * tab.jobs:
            missing = [f"{k}{j}" for j in range(tab.jobs) for k in "FB" if (k, j) not in seen]
            raise ScheduleError(f"stage {s}: missing blocks {', '.join(missing)}")
        seqs.append(seq)
    return seqs


def checked_seqs(
    tab: OpTable, orders: Sequence[Sequence[object]], *, where: str
) -> list[list[int]]:
    """`to_seqs` of orders that must also be acyclic; `PlanError` named ``where`` if not."""
    try:
        seqs = to_seqs(tab, orders)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from None
    if semi_active(tab, seqs) is None:
        raise PlanError(f"{where}: the stage orders are cyclic (they would deadlock)")
    return seqs


def evaluate(inst: JapspInstance | OpTable, orders: Sequence[Sequence[object]]) -> Timeline:
    """The semi-active timeline of per-stage ``orders`` (Eq. 5-9) and its makespan (Eq. 3).

    Raises `ScheduleError` if a stage misses or repeats a block, or the orders are
    cyclic (some block waits on a block ordered after one of its own successors).
    """
    tab = inst if isinstance(inst, OpTable) else OpTable.of(inst)
    seqs = to_seqs(tab, orders)
    res = semi_active(tab, seqs)
    if res is None:
        raise ScheduleError(_cycle_message(tab, seqs))
    start, makespan = res
    return Timeline(
        orders=tab.orders(seqs),
        start=tuple(tuple(start[o] for o in seq) for seq in seqs),
        end=tuple(tuple(start[o] + tab.dur[o] for o in seq) for seq in seqs),
        makespan=makespan,
    )


def _cycle_message(tab: OpTable, seqs: list[list[int]]) -> str:
    """Run the orders until stuck and name what every stage's next block waits for."""
    k2 = 2 * tab.stages
    pos = [0] * tab.stages
    done: set[int] = set()
    progress = True
    while progress:
        progress = False
        for m, seq in enumerate(seqs):
            while pos[m] < len(seq) and (seq[pos[m]] % k2 == 0 or seq[pos[m]] - 1 in done):
                done.add(seq[pos[m]])
                pos[m] += 1
                progress = True
    parts = []
    for m, seq in enumerate(seqs):
        if pos[m] < len(seq):
            o = seq[pos[m]]
            kind, j = tab.block(o)
            pk, _ = tab.block(o - 1)
            parts.append(f"stage {m} waits at {kind}{j} for {pk}{j} on stage {tab.machine[o - 1]}")
    return "orders are cyclic (no stage can advance): " + "; ".join(parts)


def decode(tab: OpTable, chromosome: Sequence[int]) -> tuple[list[list[int]], list[float], float]:
    """Active-schedule decoder (the GA's): ``chromosome`` lists job ids, each ``2S``
    times; the ``k``-th occurrence of ``j`` is operation ``k`` of job ``j``.

    Operations are placed in chromosome order, each at the earliest time its chain
    predecessor allows *and* a gap on its stage fits it with its switches (Eq. 8-9) to
    both neighbours, so no block can be left-shifted into an idle gap: the schedule is
    active (listing an active schedule's blocks by start time decodes back to it).
    Returns machine sequences, start times and the makespan.
    """
    k2 = 2 * tab.stages
    dur, lag, sw, machine = tab.dur, tab.lag, tab.sw, tab.machine
    nxt = [j * k2 for j in range(tab.jobs)]
    start = [0.0] * tab.n
    m_start: list[list[float]] = [[] for _ in range(tab.stages)]
    m_end: list[list[float]] = [[] for _ in range(tab.stages)]
    m_ops: list[list[int]] = [[] for _ in range(tab.stages)]
    makespan = 0.0
    for j in chromosome:
        o = nxt[j]
        nxt[j] = o + 1
        r = start[o - 1] + lag[o - 1] if o % k2 else 0.0
        m = machine[o]
        st, en, ops = m_start[m], m_end[m], m_ops[m]
        d = dur[o]
        p = bisect.bisect_left(en, r)  # a gap before an earlier block closes before r
        size = len(ops)
        while True:
            if p > 0:
                prev = ops[p - 1]
                t = en[p - 1] + (sw[prev] if prev // k2 != j else 0.0)
                t = t if t > r else r
            else:
                t = r
            if p == size:
                break
            nx = ops[p]
            if t + d + (sw[o] if nx // k2 != j else 0.0) <= st[p]:
                break
            p += 1
        st.insert(p, t)
        en.insert(p, t + d)
        ops.insert(p, o)
        start[o] = t
        if t + d > makespan:
            makespan = t + d
    return m_ops, start, makespan


def longest_paths(
    tab: OpTable, seqs: Sequence[Sequence[int]]
) -> tuple[list[float], list[float]] | None:
    """Heads and tails in the disjunctive graph with the arcs of ``seqs`` fixed.

    ``seqs[m]`` may be empty (stage ``m`` not sequenced yet). ``head[o]`` is the longest
    path to the start of ``o``, ``tail[o]`` the longest from its start to the end (so
    ``max(head + tail)`` is the makespan of the selection); None if the arcs form a cycle.
    """
    # Hot in the tabu search: local names and the job list, as in `semi_active`.
    n, k2 = tab.n, 2 * tab.stages
    dur, lag, sw, job = tab.dur, tab.lag, tab.sw, tab.job
    succ_m = [-1] * n
    cnt = [1] * n
    for o in range(0, n, k2):
        cnt[o] = 0
    for seq in seqs:
        for prev, o in pairwise(seq):
            succ_m[prev] = o
            cnt[o] += 1
    order: list[int] = []
    stack = [o for o in range(0, n, k2) if cnt[o] == 0]
    pop, push, visit = stack.pop, stack.append, order.append
    while stack:
        o = pop()
        visit(o)
        c = o + 1
        if c % k2:
            cnt[c] -= 1
            if not cnt[c]:
                push(c)
        m = succ_m[o]
        if m >= 0:
            cnt[m] -= 1
            if not cnt[m]:
                push(m)
    if len(order) < n:
        return None
    head = [0.0] * n
    for o in order:
        h = head[o]
        c = o + 1
        if c % k2 and h + lag[o] > head[c]:
            head[c] = h + lag[o]
        m = succ_m[o]
        if m >= 0:
            v = h + dur[o] + (sw[o] if job[m] != job[o] else 0.0)
            if v > head[m]:
                head[m] = v
    tail = [0.0] * n
    for o in reversed(order):
        v = dur[o]
        c = o + 1
        if c % k2 and lag[o] + tail[c] > v:
            v = lag[o] + tail[c]
        m = succ_m[o]
        if m >= 0:
            w = dur[o] + (sw[o] if job[m] != job[o] else 0.0) + tail[m]
            if w > v:
                v = w
        tail[o] = v
    return head, tail


def critical_blocks(
    tab: OpTable, seqs: Sequence[Sequence[int]], start: Sequence[float]
) -> list[list[int]]:
    """One critical path of a semi-active schedule, cut into *blocks*: maximal runs of
    consecutive operations on one stage (the N5/N7 neighbourhoods move within them)."""
    k2 = 2 * tab.stages
    dur, lag, sw = tab.dur, tab.lag, tab.sw
    mpred = [-1] * tab.n
    for seq in seqs:
        for i in range(1, len(seq)):
            mpred[seq[i]] = seq[i - 1]
    o = max(range(tab.n), key=lambda x: start[x] + dur[x])
    blocks: list[list[int]] = [[o]]
    while True:
        s = start[o]
        p = mpred[o]
        if p >= 0 and abs(start[p] + dur[p] + (sw[p] if p // k2 != o // k2 else 0.0) - s) < 1e-9:
            blocks[-1].append(p)
            o = p
        elif o % k2 and abs(start[o - 1] + lag[o - 1] - s) < 1e-9:
            o -= 1
            blocks.append([o])
        else:
            break
    return [b[::-1] for b in blocks[::-1] if len(b) > 1]
