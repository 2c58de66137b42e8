"""Memory accounting of a `Schedule`: stashed activations and live weight versions.

`memory_events` scans each worker's instruction list once (at compile time, see
`adaptipe.sim.dag`) for its activation stash / free events and the most weight versions
each chunk keeps live; `activation_peaks` and `weight_peaks` price them under a
`CostModel` to give each worker's peak bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from adaptipe.schedule.types import Backward, Forward, OptimizerStep, Recompute, Schedule
from adaptipe.sim.costs import CostModel

if TYPE_CHECKING:
    from adaptipe.sim.dag import CompiledSchedule

__all__ = ["activation_peaks", "job_index", "memory_events", "weight_peaks"]

IntArray = npt.NDArray[np.int64]

_WGRAD = 2  # stash table of batched weight gradients (0: saved, 1: input under recompute)


def job_index(jobs: IntArray, costs: CostModel) -> IntArray:
    """Row of the cost tables for each job (a one-job model is shared by all jobs)."""
    return jobs if costs.num_jobs > 1 else np.zeros_like(jobs)


def memory_events(schedule: Schedule) -> tuple[list[list[int]], IntArray]:
    """Activation stash events ``[worker, sign, table, job, vstage]`` in instruction
    order, and per ``(worker, chunk, job)`` the most extra weight versions kept live.

    A forward stashes ``saved`` (``input`` under recompute), a recompute stashes
    ``saved``, a backward frees what its micro-batch holds and stashes ``wgrad`` (what
    batched weight gradients keep; zero without them) until the job's next optimizer
    step on that worker frees it. Live weight versions of a
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
        wgrad: list[list[int]] = [[] for _ in range(J)]  # per job: vstages with a stash
        for ins in stage:
            if isinstance(ins, OptimizerStep):
                steps[ins.job] += 1
                events += [[s, -1, _WGRAD, ins.job, g] for g in wgrad[ins.job]]
                wgrad[ins.job] = []
            elif isinstance(ins, Forward | Backward | Recompute):
                key, g = (ins.job, ins.microbatch, ins.chunk), schedule.vstage(s, ins.chunk)
                if isinstance(ins, Backward):
                    events += [[s, -1, table, ins.job, g] for table in held.pop(key, [])]
                    inflight[(ins.chunk, ins.job)].pop(ins.microbatch, None)
                    events.append([s, 1, _WGRAD, ins.job, g])
                    wgrad[ins.job].append(g)
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


def activation_peaks(c: CompiledSchedule, costs: CostModel) -> tuple[int, ...]:
    """Most stashed activation bytes per worker (running sum of stash/free events)."""
    tables = np.stack(
        [costs.array("saved_bytes"), costs.array("input_bytes"), costs.array("wgrad_bytes")]
    )
    _, sign, table, job, g = c.mem
    vals = sign * tables[table, job_index(job, costs), g]
    lo, hi = c.mem_start[:-1], c.mem_start[1:]
    return tuple(
        round(float(np.cumsum(vals[a:b]).max(initial=0.0))) for a, b in zip(lo, hi, strict=True)
    )


def weight_peaks(c: CompiledSchedule, costs: CostModel) -> tuple[int, ...]:
    """Params + optimizer state of each worker's chunks (one copy per job) plus one
    parameter copy per extra live weight version (PipeDream stashing, 2BW)."""
    param = costs.array("param_bytes")[c.stage_vstages]
    opt = costs.array("optimizer_bytes")[c.stage_vstages]
    base = c.schedule.num_jobs * (param + opt).sum(axis=1)
    extra = (c.extra_versions * param[:, :, None]).sum(axis=(1, 2))
    return tuple(round(float(v)) for v in base + extra)
