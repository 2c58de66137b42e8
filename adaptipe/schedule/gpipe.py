"""GPipe: all forwards, then all backwards, then one synchronous optimizer step.

GPipe (Huang et al. 2019; Narayanan's dissertation, ch. 3 §3.1 and ch. 4 §4.2.1, where
it is the baseline flush schedule): every worker runs the forwards of all ``M``
micro-batches in order, then their backwards in order, then a pipeline flush and one
optimizer step. All ``M`` micro-batches are in flight on every worker at the turn,
which is why 1F1B (`adaptipe.schedule.onefoneb`) exists; the bubble is the same,
``(S - 1) / (M + S - 1)`` of the time with uniform stages.
"""

from __future__ import annotations

from adaptipe.schedule.onefoneb import add_transfers, check_count
from adaptipe.schedule.types import Backward, Forward, Instruction, OptimizerStep, Schedule

__all__ = ["gpipe"]


def gpipe(stages: int, microbatches: int, *, recompute: bool = False) -> Schedule:
    """GPipe with ``stages`` workers and ``microbatches`` micro-batches per step.

    ``weights="sync"``, ``update_every=M``: one weight version, one step at the flush.
    With ``recompute`` each backward is preceded by a `Recompute` of its forward (GPipe's
    re-materialisation), so only stage inputs are kept between the two passes.
    """
    what = "GPipe"
    check_count(what, "stages", stages)
    check_count(what, "microbatches", microbatches)
    program: list[tuple[Instruction, ...]] = []
    for s in range(stages):
        ops: list[Forward | Backward | OptimizerStep] = [
            Forward(0, mb) for mb in range(microbatches)
        ]
        ops.extend(Backward(0, mb) for mb in range(microbatches))
        ops.append(OptimizerStep(0))
        program.append(add_transfers(ops, stage=s, num_stages=stages, recompute=recompute))
    return Schedule(
        name="gpipe",
        num_stages=stages,
        num_microbatches=microbatches,
        stages=tuple(program),
        weights="sync",
        update_every=microbatches,
        recompute=recompute,
    )
