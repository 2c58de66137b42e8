"""What a stage's instruction list needs before it runs: the receives to pre-post (in
execution order, with their shapes) and, for versioned schedules, the weight versions
later instructions still use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from adaptipe.runtime.transport import ACTIVATION, GRADIENT, TensorSpec, TransferKey
from adaptipe.schedule.types import (
    Backward,
    Forward,
    Instruction,
    Recompute,
    RecvActivation,
    RecvGradient,
    Schedule,
)

__all__ = ["plan_receives", "versions_needed_after"]


def plan_receives(
    schedule: Schedule,
    stage: int,
    program: Sequence[Instruction],
    specs: Mapping[tuple[int, int], TensorSpec],
) -> list[tuple[TransferKey, int, TensorSpec]]:
    """``program``'s receives in order: key, source worker, and the boundary's shape
    (none before the shapes are negotiated: empty ``specs``)."""
    if not specs:
        return []
    out: list[tuple[TransferKey, int, TensorSpec]] = []
    for ins in program:
        match ins:
            case RecvActivation(job=j, microbatch=m, chunk=c, peer=p):
                b = schedule.vstage(stage, c)
                out.append((TransferKey(j, m, b, ACTIVATION), p, specs[(j, b)]))
            case RecvGradient(job=j, microbatch=m, chunk=c, peer=p):
                b = schedule.vstage(stage, c) + 1
                out.append((TransferKey(j, m, b, GRADIENT), p, specs[(j, b)]))
            case _:
                pass
    return out


def versions_needed_after(program: Sequence[Instruction]) -> list[set[int]]:
    """For each position, the (window-relative) versions later instructions use."""
    needed: list[set[int]] = [set() for _ in program]
    later: set[int] = set()
    for pos in range(len(program) - 1, -1, -1):
        needed[pos] = set(later)
        ins = program[pos]
        if isinstance(ins, Forward | Backward | Recompute):
            later.add(ins.version)
    return needed
