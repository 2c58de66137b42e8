"""Execute a compiled `Schedule` under a `CostModel`: `simulate`, `simulate_iterations`.

Each worker runs its instruction list in order, exactly like the runtime's stage loop:
compute (`Forward`, `Backward`, `Recompute`) and `OptimizerStep` advance the worker's
clock by their cost (times its slowdown, plus a job-switch cost); a send posts a
transfer at the worker's current time and costs the worker nothing; a receive blocks
until its transfer has arrived. Each directed link moves one transfer at a time, in the
order its sender posted them (FIFO). `adaptipe.sim.dag.compile_schedule` turns the
schedule into a static, topologically ordered DAG of operations once; `simulate`
evaluates it with one pass.

One iteration is then a max-plus linear map ``x' = A (x)`` on the state ``x`` = (per
worker finish times, per link busy-until times) (Cohen et al., max-plus algebra of
timed event graphs). `simulate_iterations` evaluates the DAG once, vectorised over all
iterations, carrying each quantity's dependence on every initial state component, to
get one matrix ``A_i`` per iteration, then chains ``x_{i+1} = A_i (x)`` cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError
from adaptipe.schedule.types import Schedule
from adaptipe.sim.costs import CostModel, FloatArray
from adaptipe.sim.dag import (
    COMP,
    COMPUTE,
    COMPUTE_NAME,
    GRAD,
    JOB,
    KIND,
    LINK,
    RECV,
    SEND,
    STEP,
    SWITCH,
    VSTAGE,
    WORKER,
    XFER,
    CompiledSchedule,
    Link,
    compile_schedule,
)
from adaptipe.sim.memory import activation_peaks, job_index, weight_peaks
from adaptipe.sim.result import Event, IterationsResult, SimResult

# `CompiledSchedule` and `compile_schedule` are re-exported from `adaptipe.sim.dag`.
__all__ = ["CompiledSchedule", "compile_schedule", "simulate", "simulate_iterations"]


def _durations(c: CompiledSchedule, costs: CostModel) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per op: unscaled work (compute/step), switch cost, and transfer time (sends)."""
    o, sv = c.ops, c.stage_vstages
    j, g = job_index(o[JOB], costs), o[VSTAGE]
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
            name = COMPUTE_NAME[comp] if kind == COMPUTE else "step"
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
        peak_activation_bytes=activation_peaks(c, costs),
        peak_weight_bytes=weight_peaks(c, costs),
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
