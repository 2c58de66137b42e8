"""1F1B (PipeDream-Flush) and the lowering every generator shares.

PipeDream-Flush (Narayanan's dissertation, ch. 3, §3.3 "PipeDream-Flush"; also the
"1F1B" schedule of PTD-P, ch. 4, §4.2.1): worker ``s`` of ``S`` runs
``min(S - s - 1, M)`` warm-up forwards, then steady-state (one forward, one backward)
pairs, then the cool-down backwards, then one flush-synchronous optimizer step. At most
``S - s`` micro-batches are in flight on worker ``s`` (versus ``M`` for GPipe), which is
the activation-memory saving of the schedule; the pipeline bubble is the same as GPipe's.

`add_transfers` turns a worker's compute order into its instruction list by placing the
communication next to the compute that needs it (a receive right before the forward or
backward that consumes it, a send right after the one that produces it), and a
`Recompute` before each backward when activation recomputation is on. `one_f_one_b_order`
is the (forward, backward) order PipeDream and PipeDream-2BW reuse (ch. 2 §2.3.1, ch. 3
§3.2).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from adaptipe.errors import PlanError
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

__all__ = [
    "ComputeOrder",
    "add_transfers",
    "check_count",
    "one_f_one_b",
    "one_f_one_b_order",
    "one_f_one_b_warmup",
]

ComputeOrder = list[tuple[Literal["F", "B"], int]]
"""A worker's compute order as ``("F" | "B", microbatch)`` pairs."""


def check_count(what: str, name: str, value: object, *, minimum: int = 1) -> int:
    """Return ``value`` if it is an int ``>= minimum``; else a `PlanError` naming the rule."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{what}: {name} must be an integer >= {minimum} (got {value!r})")
    if value < minimum:
        raise PlanError(f"{what}: {name} must be >= {minimum} (got {name}={value})")
    return value


def add_transfers(
    ops: Iterable[Forward | Backward | OptimizerStep],
    *,
    stage: int,
    num_stages: int,
    num_chunks: int = 1,
    recompute: bool = False,
) -> tuple[Instruction, ...]:
    """Lower worker ``stage``'s compute order to its instruction list.

    For virtual stage ``g = chunk * S + stage``: a `RecvActivation` right before each
    `Forward` with ``g > 0`` and a `SendActivation` right after each one with
    ``g < last``; a `RecvGradient` right before each `Backward` (before its `Recompute`
    when ``recompute``) with ``g < last`` and a `SendGradient` right after it with
    ``g > 0``. The last virtual stage computes the loss, so its backward receives nothing.
    """
    s_count = num_stages
    last = s_count * num_chunks - 1
    out: list[Instruction] = []
    for op in ops:
        match op:
            case Forward(job=j, microbatch=m, chunk=c):
                g = c * s_count + stage
                if g > 0:
                    out.append(RecvActivation(j, m, c, (g - 1) % s_count))
                out.append(op)
                if g < last:
                    out.append(SendActivation(j, m, c, (g + 1) % s_count))
            case Backward(job=j, microbatch=m, chunk=c, version=v):
                g = c * s_count + stage
                if g < last:
                    out.append(RecvGradient(j, m, c, (g + 1) % s_count))
                if recompute:
                    out.append(Recompute(j, m, c, v))
                out.append(op)
                if g > 0:
                    out.append(SendGradient(j, m, c, (g - 1) % s_count))
            case OptimizerStep():
                out.append(op)
    return tuple(out)


def one_f_one_b_warmup(stages: int, microbatches: int, stage: int) -> int:
    """Warm-up forwards of worker ``stage``: ``min(S - stage - 1, M)``."""
    return min(stages - stage - 1, microbatches)


def one_f_one_b_order(
    stages: int, microbatches: int, stage: int, *, warmup: int | None = None
) -> ComputeOrder:
    """Worker ``stage``'s 1F1B order: warm-up forwards, (F, B) pairs, cool-down backwards.

    ``S - stage`` micro-batches are in flight in the steady state (``min`` with ``M``);
    this is the NOAM-limited order of PipeDream (ch. 2 §2.3.1) and of PipeDream-Flush.
    ``warmup`` sets another number of warm-up forwards (at most ``M``).
    """
    if warmup is None:
        warmup = one_f_one_b_warmup(stages, microbatches, stage)
    warmup = min(warmup, microbatches)
    order: ComputeOrder = [("F", mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        order.append(("F", warmup + i))
        order.append(("B", i))
    order.extend(("B", mb) for mb in range(microbatches - warmup, microbatches))
    return order


def one_f_one_b(
    stages: int,
    microbatches: int,
    *,
    recompute: bool = False,
    warmups: Sequence[int] | None = None,
) -> Schedule:
    """PipeDream-Flush / 1F1B (dissertation §3.3): flush-synchronous, ``S - s`` in flight.

    One optimizer step after all ``M`` backwards, so every micro-batch uses weight
    version 0 (``weights="sync"``, ``update_every=M``). ``warmups`` sets each worker's
    warm-up forwards instead (replicated stages keep more in flight,
    `adaptipe.sim.replicas.replicated_one_f_one_b`).
    """
    what = "1F1B"
    check_count(what, "stages", stages)
    check_count(what, "microbatches", microbatches)
    if warmups is None:
        warmups = [one_f_one_b_warmup(stages, microbatches, s) for s in range(stages)]
    if len(warmups) != stages or any(w < 0 for w in warmups):
        raise PlanError(f"{what}: warmups must hold one count >= 0 per stage (got {warmups})")
    warmups = [min(w, microbatches) for w in warmups]
    program: list[tuple[Instruction, ...]] = []
    for s in range(stages):
        ops: list[Forward | Backward | OptimizerStep] = [
            Forward(0, mb) if kind == "F" else Backward(0, mb)
            for kind, mb in one_f_one_b_order(stages, microbatches, s, warmup=warmups[s])
        ]
        ops.append(OptimizerStep(0))
        program.append(add_transfers(ops, stage=s, num_stages=stages, recompute=recompute))
    return Schedule(
        name="1f1b",
        num_stages=stages,
        num_microbatches=microbatches,
        stages=tuple(program),
        weights="sync",
        update_every=microbatches,
        recompute=recompute,
        meta={"warmup": list(warmups)},
    )
