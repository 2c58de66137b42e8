"""Compile job-array block orders into the one schedule form (`adaptipe.schedule.types`).

Each job's mini-batch is one block per stage, so the schedule has ``num_jobs = J``,
``num_microbatches = 1`` and ``update_every = 1`` with ``weights = "sync"``: every
stage applies a job's optimizer step right after that job's backward block there (the
paper's just-in-time update, §IV-A and Eq. 9). Receives and sends are placed next to
the compute that needs them by `adaptipe.schedule.onefoneb.add_transfers`.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaptipe.errors import PlanError
from adaptipe.japsp.evaluate import OpTable, checked_seqs
from adaptipe.japsp.instance import JapspInstance
from adaptipe.schedule.onefoneb import add_transfers
from adaptipe.schedule.types import Backward, Forward, OptimizerStep, Schedule

__all__ = ["to_schedule"]


def to_schedule(
    instance_or_num_stages: JapspInstance | int,
    orders: Sequence[Sequence[object]],
    *,
    recompute: bool | None = None,
    name: str = "japsp",
) -> Schedule:
    """The `Schedule` that runs ``orders`` (per stage, ``("F"|"B", job)`` or ``"F3"``).

    ``recompute`` defaults to whether the instance has any re-materialisation cost (the
    schedule form recomputes all jobs or none). Raises `PlanError` if ``orders`` is not a
    complete, acyclic set of stage orders.
    """
    if isinstance(instance_or_num_stages, JapspInstance):
        inst = instance_or_num_stages
        stages, jobs = inst.num_stages, inst.num_jobs
        if recompute is None:
            recompute = any(any(row) for row in inst.recompute)
    else:
        stages = instance_or_num_stages
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise PlanError(f"to_schedule: num_stages must be an integer >= 1 (got {stages!r})")
        if len(orders) != stages:
            raise PlanError(
                f"to_schedule: orders must hold {stages} stage lists (got {len(orders)})"
            )
        jobs = len(orders[0]) // 2
        if jobs < 1:
            raise PlanError("to_schedule: stage 0 has no blocks")
        ones = [[1.0] * stages for _ in range(jobs)]
        inst = JapspInstance.build(ones, ones)
    tab = OpTable.of(inst)
    seqs = checked_seqs(tab, orders, where="to_schedule")
    program = []
    for s, seq in enumerate(seqs):
        ops: list[Forward | Backward | OptimizerStep] = []
        for kind, j in tab.orders([seq])[0]:
            if kind == "F":
                ops.append(Forward(j, 0))
            else:
                ops.extend((Backward(j, 0), OptimizerStep(j)))
        program.append(add_transfers(ops, stage=s, num_stages=stages, recompute=bool(recompute)))
    return Schedule(
        name=name,
        num_stages=stages,
        num_microbatches=1,
        num_jobs=jobs,
        stages=tuple(program),
        weights="sync",
        update_every=1,
        recompute=bool(recompute),
        meta={"orders": [[f"{k}{j}" for k, j in stage] for stage in tab.orders(seqs)]},
    )
