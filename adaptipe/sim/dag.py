"""Compile a `Schedule` into the static dependency DAG the simulator evaluates.

Each worker runs its instruction list in order; a send posts a transfer without
blocking, a receive blocks until its transfer has arrived, and each directed link moves
one transfer at a time in the order its sender posted them (FIFO). So the whole run is
a *static* DAG: `compile_schedule` builds it once (cached per schedule) as a
topologically ordered list of operations, one per instruction, plus the schedule's
memory events (`adaptipe.sim.memory`); `adaptipe.sim.engine` evaluates it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from adaptipe.errors import ScheduleError
from adaptipe.schedule.types import (
    Backward,
    Forward,
    Instruction,
    OptimizerStep,
    Recompute,
    RecvActivation,
    RecvGradient,
    Schedule,
    SendActivation,
    SendGradient,
)
from adaptipe.schedule.walk import walk
from adaptipe.sim.memory import memory_events

__all__ = ["CompiledSchedule", "compile_schedule"]

IntArray = npt.NDArray[np.int64]
Link = tuple[int, int]
# Values of the ``KIND`` row; ``COMP`` indexes ``COMPUTE_NAME``.
COMPUTE, STEP, SEND, RECV = 0, 1, 2, 3
COMPUTE_NAME = ("forward", "backward", "recompute")
_COMPUTE_KIND = {Forward: 0, Backward: 1, Recompute: 2}
_CACHE: OrderedDict[int, tuple[Schedule, CompiledSchedule]] = OrderedDict()
_CACHE_SIZE = 32


# Rows of `CompiledSchedule.ops`, one column per operation.
KIND, WORKER, COMP, JOB, MB, CHUNK, VSTAGE, SWITCH, LINK, XFER, GRAD = range(11)


@dataclass(frozen=True, eq=False)
class CompiledSchedule:
    """A schedule as a topologically ordered list of operations (one per instruction).

    ``ops[row, k]`` describes operation k; rows: ``KIND`` (COMPUTE/STEP/SEND/RECV),
    ``WORKER``, ``COMP`` (0 forward, 1 backward, 2 recompute), ``JOB``, ``MB``,
    ``CHUNK``, ``VSTAGE``, ``SWITCH`` (a job change precedes it), ``LINK`` (index into
    ``links`` for a send; -1 for a send to itself), ``XFER`` (transfer id of a send or
    recv), ``GRAD`` (the send carries a gradient). ``mem[:, e]`` = (worker, +1 stash /
    -1 free, table 0 saved / 1 input, job, vstage) per activation-memory event, in
    each worker's order (``mem_start[s]`` is worker s's first);
    ``extra_versions[s, c, j]`` the most extra weight versions chunk c of job j keeps.
    """

    schedule: Schedule
    links: tuple[Link, ...]
    ops: IntArray
    stage_vstages: IntArray
    mem: IntArray
    mem_start: IntArray
    extra_versions: IntArray

    @property
    def num_ops(self) -> int:
        return int(self.ops.shape[1])

    @property
    def num_state(self) -> int:
        return self.schedule.num_stages + len(self.links)


def _check_fields(schedule: Schedule, s: int, i: int, ins: Instruction) -> None:
    S, V, J = schedule.num_stages, schedule.num_chunks, schedule.num_jobs
    job, chunk, peer = ins.job, getattr(ins, "chunk", 0), getattr(ins, "peer", 0)
    if min(job, chunk, peer) < 0 or job >= J or chunk >= V or peer >= S:
        raise ScheduleError(
            f"schedule {schedule.name!r}: stage {s} instruction {i} {ins} is out of range (S={S}, V={V}, jobs={J})"
        )


def _transfer_keys(
    schedule: Schedule,
) -> tuple[dict[tuple[int, int], tuple[int, Link]], list[dict[int, int]]]:
    """Number every send in its sender's order and match each recv to its send.

    Returns ``sends[(s, i)] = (transfer id, link)`` and, per worker, ``recvs[s][i] =
    transfer id`` (-1: no matching send). A transfer's key is ``(gradient?, src, dst,
    job, microbatch, sender's vstage)``; the n-th recv of a key matches its n-th send.
    """
    sends: dict[tuple[int, int], tuple[int, Link]] = {}
    ids: dict[tuple[object, int], int] = {}
    posted: dict[object, int] = {}
    wanted: dict[object, int] = {}
    recvs: list[dict[int, int]] = []
    pending: list[tuple[int, int, object, int]] = []
    for s, stage in enumerate(schedule.stages):
        recvs.append({})
        for i, ins in enumerate(stage):
            _check_fields(schedule, s, i, ins)
            if isinstance(ins, SendActivation | SendGradient):
                g = schedule.vstage(s, ins.chunk)
                key: object = (
                    isinstance(ins, SendGradient),
                    s,
                    ins.peer,
                    ins.job,
                    ins.microbatch,
                    g,
                )
                n = posted.get(key, 0)
                posted[key] = n + 1
                ids[(key, n)] = len(ids)
                sends[(s, i)] = (ids[(key, n)], (s, ins.peer))
            elif isinstance(ins, RecvActivation | RecvGradient):
                grad = isinstance(ins, RecvGradient)
                g = schedule.vstage(s, ins.chunk) + (1 if grad else -1)
                key = (grad, ins.peer, s, ins.job, ins.microbatch, g)
                n = wanted.get(key, 0)
                wanted[key] = n + 1
                pending.append((s, i, key, n))
    for s, i, key, n in pending:
        recvs[s][i] = ids.get((key, n), -1)
    return sends, recvs


def _topological_order(
    schedule: Schedule, sends: dict[tuple[int, int], tuple[int, Link]], recvs: list[dict[int, int]]
) -> list[tuple[int, int]]:
    """Advance every worker until it blocks on a transfer not yet posted; raise on deadlock."""
    posts: list[dict[int, int]] = [{} for _ in schedule.stages]
    for (s, i), (xid, _) in sends.items():
        posts[s][i] = xid
    order, pc = walk([len(stage) for stage in schedule.stages], recvs, posts)
    blocked = [s for s, stage in enumerate(schedule.stages) if pc[s] < len(stage)]
    if blocked:
        parts = []
        for s in blocked:
            ins, missing = schedule.stages[s][pc[s]], recvs[s].get(pc[s], 0) < 0
            parts.append(
                f"worker {s} at instruction {pc[s]} {ins}"
                + (" (no matching send anywhere)" if missing else "")
            )
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: blocked " + "; ".join(parts))
    return order


def compile_schedule(schedule: Schedule) -> CompiledSchedule:
    """Build (or fetch from the per-schedule cache) the static DAG of ``schedule``."""
    hit = _CACHE.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        _CACHE.move_to_end(id(schedule))
        return hit[1]
    if len(schedule.stages) != schedule.num_stages:
        raise ScheduleError(
            f"schedule {schedule.name!r}: has {len(schedule.stages)} instruction lists for "
            f"num_stages={schedule.num_stages} workers"
        )
    sends, recvs = _transfer_keys(schedule)
    order = _topological_order(schedule, sends, recvs)
    links = tuple(sorted({lk for _, lk in sends.values() if lk[0] != lk[1]}))
    link_index = {lk: n for n, lk in enumerate(links)}
    rows: list[list[int]] = []
    last_job: list[int | None] = [None] * schedule.num_stages
    for s, i in order:
        ins = schedule.stages[s][i]
        chunk = getattr(ins, "chunk", -1)
        mb = getattr(ins, "microbatch", -1)
        g = schedule.vstage(s, chunk) if chunk >= 0 else 0
        row = [COMPUTE, s, -1, ins.job, mb, chunk, g, 0, -1, -1, 0]
        if isinstance(ins, Forward | Backward | Recompute):
            row[COMP] = _COMPUTE_KIND[type(ins)]
            row[SWITCH] = int(last_job[s] is not None and last_job[s] != ins.job)
            last_job[s] = ins.job
        elif isinstance(ins, OptimizerStep):
            row[KIND] = STEP
        elif (s, i) in sends:
            xid, lk = sends[(s, i)]
            row[KIND], row[LINK], row[XFER] = SEND, link_index.get(lk, -1), xid
            row[GRAD] = int(isinstance(ins, SendGradient))
        else:
            row[KIND], row[XFER] = RECV, recvs[s][i]
        rows.append(row)
    ev, extra = memory_events(schedule)
    mem = np.asarray(ev, dtype=np.int64).reshape(-1, 5).T
    S, V = schedule.num_stages, schedule.num_chunks
    compiled = CompiledSchedule(
        schedule=schedule,
        links=links,
        ops=np.asarray(rows, dtype=np.int64).reshape(-1, 11).T.copy(),
        stage_vstages=np.asarray([[schedule.vstage(s, c) for c in range(V)] for s in range(S)]),
        mem=mem,
        mem_start=np.searchsorted(mem[0], np.arange(S + 1)),
        extra_versions=extra,
    )
    _CACHE[id(schedule)] = (schedule, compiled)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return compiled
