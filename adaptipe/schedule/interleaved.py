"""Interleaved 1F1B (PTD-P): ``V`` model chunks per worker to shrink the bubble.

Narayanan's dissertation, ch. 4 §4.2.2 ("Schedule with Interleaved Stages"), with the
ordering of Megatron-LM's ``forward_backward_pipelining_with_interleaving``: worker
``r`` runs ``M * V`` forward and ``M * V`` backward steps. The ``k``-th forward step is
local chunk ``(k // S) % V`` of micro-batch ``(k // (S * V)) * S + k % S``; the ``k``-th
backward step is chunk ``V - 1 - (k // S) % V`` of the same micro-batch formula. Worker
``r`` first runs ``min(2 * (S - r - 1) + (V - 1) * S, M * V)`` warm-up forwards, then
alternates one forward and one backward, then runs the remaining backwards, then one
flush-synchronous optimizer step. With uniform chunks (forward ``1/V``, backward ``2/V``
of a stage) the bubble is ``(S - 1) / (V * M + S - 1)`` of the time, ``V`` times smaller
than 1F1B's, at the cost of ``V`` times more point-to-point messages.
"""

from __future__ import annotations

from adaptipe.errors import PlanError
from adaptipe.schedule.onefoneb import add_transfers, check_count
from adaptipe.schedule.types import Backward, Forward, Instruction, OptimizerStep, Schedule

__all__ = ["interleaved", "interleaved_warmup"]


def interleaved_warmup(stages: int, microbatches: int, chunks: int, stage: int) -> int:
    """Megatron's warm-up forward count for worker ``stage``."""
    return min((stages - stage - 1) * 2 + (chunks - 1) * stages, microbatches * chunks)


def interleaved(
    stages: int, microbatches: int, chunks: int, *, recompute: bool = False
) -> Schedule:
    """Interleaved 1F1B with ``chunks`` model chunks per worker (virtual stage ``g`` lives
    on worker ``g % S`` as chunk ``g // S``).

    Needs ``chunks >= 2`` (use `one_f_one_b` for one), ``stages >= 2`` and ``microbatches``
    a multiple of ``stages`` (micro-batches advance through the chunks in groups of ``S``).
    """
    what = "interleaved 1F1B"
    check_count(what, "stages", stages)
    check_count(what, "microbatches", microbatches)
    check_count(what, "chunks", chunks)
    if chunks < 2:
        raise PlanError(
            f"{what} needs chunks >= 2 model chunks per stage (got chunks={chunks}); "
            "use the '1f1b' schedule for one chunk"
        )
    if stages < 2:
        raise PlanError(f"{what} needs stages >= 2 (got stages={stages})")
    if microbatches % stages != 0:
        raise PlanError(
            f"{what} needs microbatches to be a multiple of stages "
            f"(got M={microbatches}, S={stages})"
        )
    total = microbatches * chunks
    group = stages * chunks

    def step(k: int, *, forward: bool) -> tuple[int, int]:
        """(microbatch, chunk) of the ``k``-th forward or backward step."""
        in_group = (k // stages) % chunks
        mb = (k // group) * stages + k % stages
        return mb, in_group if forward else chunks - 1 - in_group

    program: list[tuple[Instruction, ...]] = []
    warmups: list[int] = []
    for r in range(stages):
        warmup = interleaved_warmup(stages, microbatches, chunks, r)
        warmups.append(warmup)
        ops: list[Forward | Backward | OptimizerStep] = []
        for k in range(warmup):
            mb, c = step(k, forward=True)
            ops.append(Forward(0, mb, c))
        for i in range(total - warmup):
            mb, c = step(warmup + i, forward=True)
            ops.append(Forward(0, mb, c))
            mb, c = step(i, forward=False)
            ops.append(Backward(0, mb, c))
        for k in range(total - warmup, total):
            mb, c = step(k, forward=False)
            ops.append(Backward(0, mb, c))
        ops.append(OptimizerStep(0))
        program.append(
            add_transfers(ops, stage=r, num_stages=stages, num_chunks=chunks, recompute=recompute)
        )
    return Schedule(
        name="interleaved",
        num_stages=stages,
        num_microbatches=microbatches,
        num_chunks=chunks,
        stages=tuple(program),
        weights="sync",
        update_every=microbatches,
        recompute=recompute,
        meta={"warmup": warmups},
    )
