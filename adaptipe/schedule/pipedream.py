"""PipeDream: asynchronous 1F1B with weight stashing (and optional vertical sync).

Narayanan's dissertation, ch. 2 §2.3 ("1F1B" scheduling, §2.3.1; weight stashing and
vertical sync, §2.3.2). Each micro-batch here is one PipeDream minibatch: the workers
run the 1F1B order over a stream of ``M`` inputs with NOAM = ``S`` in flight at the
(unreplicated) input stage and ``S - s`` at worker ``s``, and apply an optimizer step
right after *every* backward (``update_every=1``), with no flush.

Weight stashing (``weights="stash"``): the forward of an input uses the newest weights
on its worker, i.e. version = number of optimizer steps already run there, and its
backward uses the same stashed version. Vertical sync (``weights="vertical"``): every
worker uses, for input ``m``, the version worker 0 used (``max(m - S + 1, 0)`` in the
steady state), which always exists locally because later workers have run at least as
many steps by then.
"""

from __future__ import annotations

from adaptipe.schedule.onefoneb import (
    ComputeOrder,
    add_transfers,
    check_count,
    one_f_one_b_order,
    one_f_one_b_warmup,
)
from adaptipe.schedule.types import Backward, Forward, Instruction, OptimizerStep, Schedule

__all__ = ["pipedream", "stash_versions"]


def stash_versions(order: ComputeOrder) -> dict[int, int]:
    """Micro-batch -> weight version under stashing when a step follows every backward."""
    done = 0
    versions: dict[int, int] = {}
    for kind, mb in order:
        if kind == "F":
            versions[mb] = done
        else:
            done += 1
    return versions


def pipedream(
    stages: int, microbatches: int, *, vertical_sync: bool = False, recompute: bool = False
) -> Schedule:
    """PipeDream over a stream of ``microbatches`` inputs (``weights="stash"``, or
    ``"vertical"`` with ``vertical_sync``), ``update_every=1``, ``meta["in_flight"] = S``."""
    what = "PipeDream"
    check_count(what, "stages", stages)
    check_count(what, "microbatches", microbatches)
    orders = [one_f_one_b_order(stages, microbatches, s) for s in range(stages)]
    first = stash_versions(orders[0])
    program: list[tuple[Instruction, ...]] = []
    for s, order in enumerate(orders):
        versions = first if vertical_sync else stash_versions(order)
        ops: list[Forward | Backward | OptimizerStep] = []
        for kind, mb in order:
            if kind == "F":
                ops.append(Forward(0, mb, 0, versions[mb]))
            else:
                ops.append(Backward(0, mb, 0, versions[mb]))
                ops.append(OptimizerStep(0))
        program.append(add_transfers(ops, stage=s, num_stages=stages, recompute=recompute))
    return Schedule(
        name="pipedream",
        num_stages=stages,
        num_microbatches=microbatches,
        stages=tuple(program),
        weights="vertical" if vertical_sync else "stash",
        update_every=1,
        recompute=recompute,
        meta={
            "in_flight": stages,
            "warmup": [one_f_one_b_warmup(stages, microbatches, s) for s in range(stages)],
        },
    )
