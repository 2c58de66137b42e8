"""PipeDream-2BW: 1F1B over a stream with double-buffered weights.

Narayanan's dissertation, ch. 3 §3.2 ("PipeDream-2BW"): the workers run the 1F1B order
over a stream of inputs and coalesce the gradients of ``m`` consecutive micro-batches
(``update_every``, ``m >= S``) into one optimizer step, taken right after the backward
of each micro-batch with ``(mb + 1) % m == 0``. Input ``k`` (1-indexed) uses weight
version ``max(floor((k - 1) / m) - 1, 0)`` for both its forward and its backward
(§3.2.1), i.e. the gradient is applied with a delay of one step; so only two weight
versions are ever live on a worker (the newest, and the one in-flight inputs use).
"""

from __future__ import annotations

from adaptipe.errors import PlanError
from adaptipe.schedule.onefoneb import (
    add_transfers,
    check_count,
    one_f_one_b_order,
    one_f_one_b_warmup,
)
from adaptipe.schedule.types import Backward, Forward, Instruction, OptimizerStep, Schedule

__all__ = ["two_bw", "two_bw_version"]


def two_bw_version(microbatch: int, update_every: int) -> int:
    """Weight version of 0-indexed ``microbatch``: ``max(microbatch // m - 1, 0)``."""
    return max(microbatch // update_every - 1, 0)


def two_bw(
    stages: int, microbatches: int, *, update_every: int | None = None, recompute: bool = False
) -> Schedule:
    """PipeDream-2BW (``weights="2bw"``) with ``update_every`` (default ``stages``)
    micro-batches per step; needs ``update_every >= stages`` and ``microbatches`` a
    multiple of ``update_every``."""
    what = "PipeDream-2BW"
    check_count(what, "stages", stages)
    check_count(what, "microbatches", microbatches)
    m = stages if update_every is None else check_count(what, "update_every", update_every)
    if m < stages:
        raise PlanError(
            f"{what} needs update_every >= stages so at most two weight versions are live "
            f"(got update_every={m}, S={stages})"
        )
    if microbatches % m != 0:
        raise PlanError(
            f"{what} needs microbatches to be a multiple of update_every "
            f"(got M={microbatches}, update_every={m})"
        )
    program: list[tuple[Instruction, ...]] = []
    for s in range(stages):
        ops: list[Forward | Backward | OptimizerStep] = []
        for kind, mb in one_f_one_b_order(stages, microbatches, s):
            v = two_bw_version(mb, m)
            if kind == "F":
                ops.append(Forward(0, mb, 0, v))
            else:
                ops.append(Backward(0, mb, 0, v))
                if (mb + 1) % m == 0:
                    ops.append(OptimizerStep(0))
        program.append(add_transfers(ops, stage=s, num_stages=stages, recompute=recompute))
    return Schedule(
        name="2bw",
        num_stages=stages,
        num_microbatches=microbatches,
        stages=tuple(program),
        weights="2bw",
        update_every=m,
        recompute=recompute,
        meta={
            "in_flight": stages,
            "warmup": [one_f_one_b_warmup(stages, microbatches, s) for s in range(stages)],
        },
    )
