"""Discrete-event simulation of a `Schedule` under a `CostModel`.

Each worker runs its instruction list in order, exactly like the runtime's stage loop:
compute (`Forward`, `Backward`, `Recompute`) and `OptimizerStep` advance the worker's
clock by their cost (times its slowdown, plus a job-switch cost); a send posts a
transfer at the worker's current time and costs the worker nothing; a receive blocks
until its transfer has arrived. Each directed link moves one transfer at a time, in the
order its sender posted them (FIFO), so the whole run is a *static* dependency DAG:
`compile_schedule` builds it once (cached per schedule) as a topologically ordered list
of operations, and `simulate` evaluates it with one pass.

One iteration is then a max-plus linear map ``x' = A (x)`` on the state ``x`` = (per
worker finish times, per link busy-until times) (Cohen et al., max-plus algebra of
timed event graphs). `simulate_iterations` evaluates the DAG once, vectorised over all
iterations, carrying each quantity's dependence on every initial state component, to
get one matrix ``A_i`` per iteration, then chains ``x_{i+1} = A_i (x)`` cheaply.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError, ScheduleError
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
from adaptipe.sim.costs import CostModel, FloatArray
from adaptipe.sim.result import Event, IterationsResult, SimResult

__all__ = ["CompiledSchedule", "compile_schedule", "simulate", "simulate_iterations"]

IntArray = npt.NDArray[np.int64]
Link = tuple[int, int]
COMPUTE, STEP, SEND, RECV = 0, 1, 2, 3
_COMPUTE_KIND = {Forward: 0, Backward: 1, Recompute: 2}
_COMPUTE_NAME = ("forward", "backward", "recompute")
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
    bad = ins.job >= J or getattr(ins, "chunk", 0) >= V or getattr(ins, "peer", 0) >= S
    if bad:
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
    pc = [0] * schedule.num_stages
    posted: set[int] = set()
    order: list[tuple[int, int]] = []
    while True:
        progress = False
        for s, stage in enumerate(schedule.stages):
            while pc[s] < len(stage):
                i = pc[s]
                if i in recvs[s] and recvs[s][i] not in posted:
                    break
                if (s, i) in sends:
                    posted.add(sends[(s, i)][0])
                order.append((s, i))
                pc[s] += 1
                progress = True
        if not progress:
            break
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


def _memory_events(schedule: Schedule) -> tuple[list[list[int]], IntArray]:
    """Activation stash events ``[worker, sign, table, job, vstage]`` in instruction
    order, and per ``(worker, chunk, job)`` the most extra weight versions kept live.

    A forward stashes ``saved`` (``input`` under recompute), a recompute stashes
    ``saved``, a backward frees what its micro-batch holds. Live weight versions of a
    chunk: the newest (one per `OptimizerStep` taken) plus each version an in-flight
    micro-batch uses (PipeDream stashing; at most two under 2BW).
    """
    S, V, J = schedule.num_stages, schedule.num_chunks, schedule.num_jobs
    events: list[list[int]] = []
    extra = np.zeros((S, V, J), dtype=np.int64)
    for s, stage in enumerate(schedule.stages):
        held: dict[tuple[int, int, int], list[int]] = {}
        inflight: dict[tuple[int, int], dict[int, int]] = {
            (c, j): {} for c in range(V) for j in range(J)
        }
        steps = [0] * J
        for ins in stage:
            if isinstance(ins, OptimizerStep):
                steps[ins.job] += 1
            elif isinstance(ins, Forward | Backward | Recompute):
                key, g = (ins.job, ins.microbatch, ins.chunk), schedule.vstage(s, ins.chunk)
                if isinstance(ins, Backward):
                    events += [[s, -1, table, ins.job, g] for table in held.pop(key, [])]
                    inflight[(ins.chunk, ins.job)].pop(ins.microbatch, None)
                else:
                    table = 1 if isinstance(ins, Forward) and schedule.recompute else 0
                    held.setdefault(key, []).append(table)
                    events.append([s, 1, table, ins.job, g])
                    if isinstance(ins, Forward):
                        inflight[(ins.chunk, ins.job)][ins.microbatch] = ins.version
            else:
                continue
            for c in range(V):
                live = len(set(inflight[(c, ins.job)].values()) | {steps[ins.job]})
                extra[s, c, ins.job] = max(int(extra[s, c, ins.job]), live - 1)
    if schedule.weights == "2bw":
        np.minimum(extra, 1, out=extra)
    return events, extra


def compile_schedule(schedule: Schedule) -> CompiledSchedule:
    """Build (or fetch from the per-schedule cache) the static DAG of ``schedule``."""
    hit = _CACHE.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        _CACHE.move_to_end(id(schedule))
        return hit[1]
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
    ev, extra = _memory_events(schedule)
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


def _job_index(jobs: IntArray, costs: CostModel) -> IntArray:
    """Row of the cost tables for each job (a one-job model is shared by all jobs)."""
    return jobs if costs.num_jobs > 1 else np.zeros_like(jobs)


def _durations(c: CompiledSchedule, costs: CostModel) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per op: unscaled work (compute/step), switch cost, and transfer time (sends)."""
    o, sv = c.ops, c.stage_vstages
    j, g = _job_index(o[JOB], costs), o[VSTAGE]
    table = np.stack([costs.array(n) for n in ("forward_s", "backward_s", "recompute_s")])
    work = np.where(o[KIND] == COMPUTE, table[np.maximum(o[COMP], 0), j, g], 0.0)
    step = o[KIND] == STEP  # a worker's step costs the sum over its chunks
    work[step] = costs.array("update_s")[j[step, None], sv[o[WORKER, step]]].sum(axis=1)
    switch = np.where(o[SWITCH] > 0, costs.array("switch_s")[j, g], 0.0)
    act, grad = costs.array("activation_bytes")[j, g], costs.array("gradient_bytes")[j, g]
    nbytes = np.where(o[GRAD] > 0, grad, act)
    bw_lat = np.asarray([costs.link(*lk) for lk in c.links] + [(math.inf, 0.0)])
    bw, lat = bw_lat[o[LINK], 0], bw_lat[o[LINK], 1]  # LINK -1 (a send to itself) is free
    xfer = np.where(o[KIND] == SEND, lat + np.where(nbytes > 0, nbytes / bw, 0.0), 0.0)
    return work, switch, xfer


def _activation_peaks(c: CompiledSchedule, costs: CostModel) -> tuple[int, ...]:
    """Most stashed activation bytes per worker (running sum of stash/free events)."""
    tables = np.stack([costs.array("saved_bytes"), costs.array("input_bytes")])
    _, sign, table, job, g = c.mem
    vals = sign * tables[table, _job_index(job, costs), g]
    lo, hi = c.mem_start[:-1], c.mem_start[1:]
    return tuple(
        round(float(np.cumsum(vals[a:b]).max(initial=0.0))) for a, b in zip(lo, hi, strict=True)
    )


def _weight_peaks(c: CompiledSchedule, costs: CostModel) -> tuple[int, ...]:
    """Params + optimizer state of each worker's chunks (one copy per job) plus one
    parameter copy per extra live weight version (PipeDream stashing, 2BW)."""
    param = costs.array("param_bytes")[c.stage_vstages]
    opt = costs.array("optimizer_bytes")[c.stage_vstages]
    base = c.schedule.num_jobs * (param + opt).sum(axis=1)
    extra = (c.extra_versions * param[:, :, None]).sum(axis=(1, 2))
    return tuple(round(float(v)) for v in base + extra)


def _events(
    c: CompiledSchedule, start: list[float], end: list[float], switch: list[float]
) -> tuple[Event, ...]:
    """Timeline events sorted by start: worker compute/step/switch boxes, link transfers."""
    out: list[Event] = []
    for k, (kind, s, comp, job, mb, chunk, _, _, link, _, grad) in enumerate(c.ops.T.tolist()):
        t = start[k]
        if kind == SEND and link >= 0:
            src, dst = c.links[link]
            out.append(
                Event(
                    "link",
                    src,
                    dst,
                    "gradient" if grad else "activation",
                    job,
                    mb,
                    chunk,
                    t,
                    end[k],
                )
            )
        elif kind in (COMPUTE, STEP):
            if switch[k] > 0:
                out.append(Event("worker", s, -1, "switch", job, mb, chunk, t, t + switch[k]))
                t += switch[k]
            name = _COMPUTE_NAME[comp] if kind == COMPUTE else "step"
            out.append(Event("worker", s, -1, name, job, mb, chunk, t, end[k]))
    out.sort(key=lambda e: (e.start, e.where != "worker", e.worker))
    return tuple(out)


def _run(
    c: CompiledSchedule, dur: list[float], T: list[float], L: list[float]
) -> tuple[list[float], list[float]]:
    """Evaluate the DAG once, updating worker clocks ``T`` and link times ``L`` in place;
    return each op's start and end."""
    kinds, workers, links, xfers = (c.ops[r].tolist() for r in (KIND, WORKER, LINK, XFER))
    arrival = [0.0] * (max(xfers, default=-1) + 1)
    start, end = [0.0] * c.num_ops, [0.0] * c.num_ops
    for k, kind in enumerate(kinds):
        s = workers[k]
        t = T[s]
        if kind == SEND:
            lk = links[k]
            if lk >= 0:  # FIFO: wait for the link's previous transfer
                t = max(t, L[lk])
                L[lk] = t + dur[k]
            arrival[xfers[k]] = e = t + dur[k]
        elif kind == RECV:
            e = T[s] = max(t, arrival[xfers[k]])
        else:
            e = T[s] = t + dur[k]
        start[k], end[k] = t, e
    return start, end


def simulate(
    schedule: Schedule,
    costs: CostModel,
    *,
    record: bool = True,
    start_s: Sequence[float] | None = None,
    link_free_s: Mapping[Link, float] | None = None,
) -> SimResult:
    """Run ``schedule`` once under ``costs``; raise `ScheduleError` if it deadlocks.

    ``start_s`` (per worker) and ``link_free_s`` (per directed link) continue from an
    earlier run's ``end_s`` / ``link_free_s`` to chain iterations; default all 0.
    """
    costs.check_schedule(schedule)
    c = compile_schedule(schedule)
    S = schedule.num_stages
    begin = [0.0] * S if start_s is None else [float(v) for v in start_s]
    if len(begin) != S:
        raise PlanError(f"simulate: start_s has {len(begin)} entries for {S} workers")
    free = dict(link_free_s or {})
    T, L = list(begin), [float(free.get(lk, 0.0)) for lk in c.links]
    work, switch, xfer = _durations(c, costs)
    scaled = work * costs.slowdowns(S)[c.ops[WORKER]]
    start, end = _run(c, (scaled + switch + xfer).tolist(), T, L)
    makespan = max(T) - min(begin)
    busy = np.bincount(c.ops[WORKER], weights=scaled, minlength=S)
    tput = schedule.num_jobs * schedule.num_microbatches / makespan if makespan > 0 else math.inf
    free.update(zip(c.links, L, strict=True))
    return SimResult(
        schedule=schedule.name,
        num_stages=S,
        num_microbatches=schedule.num_microbatches,
        num_jobs=schedule.num_jobs,
        makespan=makespan,
        busy_s=tuple(busy.tolist()),
        bubble_ratio=1.0 - float(busy.sum()) / (S * makespan) if makespan > 0 else 0.0,
        throughput=tput,
        samples_per_s=tput * costs.samples_per_microbatch,
        peak_activation_bytes=_activation_peaks(c, costs),
        peak_weight_bytes=_weight_peaks(c, costs),
        start_s=tuple(begin),
        end_s=tuple(T),
        link_free_s=free,
        timeline=_events(c, start, end, switch.tolist()) if record else (),
    )


def _maxplus_block(c: CompiledSchedule, work: FloatArray, xfer: list[float]) -> FloatArray:
    """One max-plus matrix per row of ``work`` ((B, ops) scaled work + switch costs).

    Every worker clock / link / arrival is a (B, n_state) array whose entry [i, j] is
    the longest path from initial state component j in iteration i (-inf: none).
    Consecutive compute ops of one worker are first summed into one column.
    """
    S, n, B = c.schedule.num_stages, c.num_state, work.shape[0]
    kinds, workers, links, xfers = (c.ops[r].tolist() for r in (KIND, WORKER, LINK, XFER))
    comp = [k for k, kind in enumerate(kinds) if kind <= STEP]
    pos = [
        j
        for j, k in enumerate(comp)
        if j == 0 or comp[j - 1] != k - 1 or workers[k] != workers[k - 1]
    ]
    merged = np.add.reduceat(work[:, comp], pos, axis=1) if comp else work[:, :0]
    column = {comp[p]: merged[:, j : j + 1] for j, p in enumerate(pos)}
    eye = np.full((n, n), -math.inf)
    np.fill_diagonal(eye, 0.0)
    T = [np.repeat(eye[None, s], B, axis=0) for s in range(S)]
    L: list[FloatArray] = [np.broadcast_to(eye[S + j], (B, n)) for j in range(len(c.links))]
    arrival: dict[int, FloatArray] = {}
    for k, kind in enumerate(kinds):
        s = workers[k]
        if kind <= STEP:
            if k in column:
                T[s] += column[k]
        elif kind == SEND:
            lk = links[k]
            if lk < 0:
                arrival[xfers[k]] = T[s] + xfer[k]
            else:  # L arrays are replaced, never written in place: arrivals alias them
                v = np.maximum(T[s], L[lk])
                v += xfer[k]
                L[lk] = arrival[xfers[k]] = v
        else:
            np.maximum(T[s], arrival.pop(xfers[k]), out=T[s])
    return np.stack(T + L, axis=1)


def simulate_iterations(
    schedule: Schedule,
    costs: CostModel,
    iterations: int,
    *,
    slowdown: npt.ArrayLike | None = None,
) -> IterationsResult:
    """Run ``iterations`` back to back: iteration i+1 on a worker starts when that worker
    finished iteration i, and links keep their busy-until times (exactly what chaining
    `simulate` with ``start_s`` / ``link_free_s`` gives).

    ``slowdown``: optional (iterations, S) per-iteration factors, multiplied with
    ``costs.slowdown``. Cost: one vectorised DAG pass per block of iterations plus one
    small max-plus matrix-vector product per iteration.
    """
    if iterations < 1:
        raise PlanError(f"simulate_iterations: iterations must be >= 1 (got {iterations})")
    costs.check_schedule(schedule)
    c = compile_schedule(schedule)
    S, n = schedule.num_stages, c.num_state
    slow = np.broadcast_to(costs.slowdowns(S), (iterations, S)).astype(np.float64)
    if slowdown is not None:
        extra = np.asarray(slowdown, dtype=np.float64)
        if extra.shape != (iterations, S) or not np.all(np.isfinite(extra)) or np.any(extra <= 0):
            raise PlanError(
                f"simulate_iterations: slowdown must be a positive ({iterations}, {S}) array (got shape {extra.shape})"
            )
        slow = slow * extra
    work, switch, xfer = _durations(c, costs)
    block = int(np.clip(2**22 // max(n * n, c.num_ops, 1), 1, iterations))
    x = np.zeros(n)
    worker_end = np.empty((iterations, S))
    for b0 in range(0, iterations, block):
        rows = slow[b0 : b0 + block]
        A = _maxplus_block(c, work * rows[:, c.ops[WORKER]] + switch, xfer.tolist())
        for i in range(rows.shape[0]):
            x = (A[i] + x).max(axis=1)
            worker_end[b0 + i] = x[:S]
    end = worker_end.max(axis=1)
    return IterationsResult(
        schedule=schedule.name,
        num_stages=S,
        microbatches_per_iteration=schedule.num_jobs * schedule.num_microbatches,
        samples_per_microbatch=costs.samples_per_microbatch,
        iteration_s=np.diff(end, prepend=0.0),
        end_s=end,
        worker_end_s=worker_end,
    )
