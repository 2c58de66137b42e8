"""The shape handshake: what crosses each pipeline boundary, found by running the layers.

Boundary shapes are passed down the pipeline, job by job; each worker infers its own
chunks' outputs by running its real layers once, without autograd, on a zero input of
the negotiated shape (zeros are valid token ids too). That is exact for the device and
dtype in use, costs one micro-batch forward, and is run again whenever the partition
changes (a boundary then sits after another layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaptipe.runtime.stage import StageExecutor
from adaptipe.runtime.transport import TensorSpec, recv_spec, send_spec
from adaptipe.schedule.replicate import ReplicaLayout
from adaptipe.schedule.types import Schedule

__all__ = ["boundary_specs_in_process", "negotiate_shapes", "output_spec"]

BoundarySpecs = dict[tuple[int, int], TensorSpec]


def output_spec(
    executor: StageExecutor, job: int, chunk: int, in_spec: TensorSpec, device: torch.device
) -> TensorSpec:
    """What ``chunk`` of ``executor`` outputs for ``job`` on an input of ``in_spec``."""
    with torch.no_grad():
        x = torch.zeros(in_spec.shape, dtype=in_spec.dtype, device=device)
        y = executor.forward_only(job, chunk, x)
    return TensorSpec(tuple(y.shape), y.dtype)


def negotiate_shapes(
    executor: StageExecutor,
    schedule: Schedule,
    rank: int,
    first_inputs: dict[int, TensorSpec],
    device: torch.device,
    wire: torch.device,
    jobs: Sequence[int] | None = None,
    layout: ReplicaLayout | None = None,
) -> BoundarySpecs:
    """This worker's boundary specs, agreed with its neighbours over ``torch.distributed``.

    ``first_inputs`` (job -> input spec) is needed only on the worker holding virtual
    stage 0; ``jobs`` are the jobs to agree for (default: all of the schedule's). Every
    worker must call this at the same point with the same jobs. With replicated stages
    (``layout``) replica k hears from replica ``k mod r`` of the stage before it and
    tells each replica of the next stage that hears from it.
    """
    out: BoundarySpecs = {}
    last = schedule.num_virtual_stages - 1
    layout = layout or ReplicaLayout((1,) * schedule.num_stages)
    stage, replica = layout.place(rank)
    reps = layout.replicas
    for job in range(schedule.num_jobs) if jobs is None else jobs:
        for chunk in range(schedule.num_chunks):
            g = schedule.vstage(stage, chunk)
            if g == 0:
                in_spec = first_inputs[job]
            else:
                src = schedule.place(g - 1)[0]
                in_spec = recv_spec(layout.rank(src, replica % reps[src]), wire=wire)
                out[(job, g)] = in_spec
            if g < last:
                spec = output_spec(executor, job, chunk, in_spec, device)
                dst = schedule.place(g + 1)[0]
                for k in range(reps[dst]):
                    if k % reps[stage] == replica:
                        send_spec(spec, layout.rank(dst, k), wire=wire)
                out[(job, g + 1)] = spec
    return out


def boundary_specs_in_process(
    executors: Sequence[StageExecutor],
    schedule: Schedule,
    first_inputs: dict[int, TensorSpec],
    device: torch.device,
) -> list[BoundarySpecs]:
    """Every stage's boundary specs when all stages run in this process (one executor
    per stage, in stage order)."""
    out: list[BoundarySpecs] = [{} for _ in executors]
    for job in range(schedule.num_jobs):
        spec = first_inputs[job]
        for g in range(schedule.num_virtual_stages - 1):
            rank, chunk = schedule.place(g)
            spec = output_spec(executors[rank], job, chunk, spec, device)
            out[rank][(job, g + 1)] = spec
            out[schedule.place(g + 1)[0]][(job, g + 1)] = spec
    return out
