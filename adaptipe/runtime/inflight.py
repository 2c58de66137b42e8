"""Fewer micro-batches in flight on one stage: its instruction list with forwards delayed.

A stage near its memory limit (`adaptipe.runtime.memory_guard`) admits fewer forwards
ahead of their backwards: every forward stash it holds is activation memory (DynPipe's
memory model; the dissertation's ch. 3 §3.3 in-flight count). `admit` delays each
forward, with the receive of its input and the send of its output, until fewer than
``cap`` forwards wait for their backward; every other instruction keeps its place in
the order, so the backwards, and with them the order gradients accumulate in, are those
of the original list, and a forward still runs between the same optimizer steps: the
numbers are bitwise those of the uncapped run. Only the stage's own list changes: its
neighbours' sends are buffered and its receives pre-posted, and `capped` keeps a cap
only when `adaptipe.schedule.validate` finds the whole schedule still deadlock-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from adaptipe.errors import ScheduleError
from adaptipe.runtime.windowcut import rounds_of
from adaptipe.schedule.types import (
    Backward,
    Forward,
    Instruction,
    Recompute,
    RecvActivation,
    Schedule,
    SendActivation,
    SendGradient,
)
from adaptipe.schedule.validate import in_flight, validate

__all__ = ["Capped", "admit", "capped"]

_Key = tuple[int, int, int]  # (job, micro-batch, chunk)


@dataclass(frozen=True, slots=True, kw_only=True)
class Capped:
    """A stage's capped instruction list and its peak in flight before and after."""

    program: tuple[Instruction, ...]
    before: int
    after: int


def _forward_key(ins: Instruction) -> _Key | None:
    if isinstance(ins, RecvActivation | Forward | SendActivation):
        return (ins.job, ins.microbatch, ins.chunk)
    return None


def admit(program: Sequence[Instruction], cap: int) -> tuple[Instruction, ...]:
    """``program`` with forwards delayed so that at most ``cap`` wait for their backward
    (more only where a backward needs a forward that the cap holds back)."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1 (got {cap})")
    blocks: dict[_Key, list[Instruction]] = {}
    forwards: list[tuple[int, _Key]] = []  # (position of its first instruction, key)
    others: list[tuple[int, Instruction]] = []
    for pos, ins in enumerate(program):
        key = _forward_key(ins)
        if key is None:
            others.append((pos, ins))
            continue
        if key not in blocks:
            forwards.append((pos, key))
        blocks.setdefault(key, []).append(ins)
    out: list[Instruction] = []
    live: set[_Key] = set()
    emitted: set[_Key] = set()
    f = o = 0
    while f < len(forwards) or o < len(others):
        nxt = others[o] if o < len(others) else None
        needs = (
            (nxt[1].job, nxt[1].microbatch, nxt[1].chunk)
            if nxt is not None and isinstance(nxt[1], Backward | Recompute)
            else None
        )
        if f < len(forwards) and (
            nxt is None
            or (needs is not None and needs not in emitted)
            or (
                len(live) < cap
                and forwards[f][0] < nxt[0]
                and not isinstance(nxt[1], SendGradient)  # a gradient leaves at once
            )
        ):
            key = forwards[f][1]
            out += blocks[key]
            live.add(key)
            emitted.add(key)
            f += 1
            continue
        assert nxt is not None
        out.append(nxt[1])
        if isinstance(nxt[1], Backward):
            live.discard((nxt[1].job, nxt[1].microbatch, nxt[1].chunk))
        o += 1
    return tuple(out)


def capped(schedule: Schedule, stage: int, *, per_round: int | None = None) -> Capped | None:
    """Stage ``stage``'s list with about half its peak in flight (the fewest the whole
    schedule runs with, trying caps from half the peak up); None when no cap below the
    peak keeps the schedule valid (a last stage of 1F1B holds one already).

    ``per_round``: a job-array window's micro-batches per round; its rounds must stay
    in order (`adaptipe.runtime.windowcut` cuts a window between rounds).
    """
    if schedule.weights != "sync":
        return None  # weight versions follow the order of forwards and steps
    before = in_flight(schedule)[stage]
    for cap in range(max(1, math.ceil(before / 2)), before):
        program = admit(schedule.stages[stage], cap)
        if per_round is not None:
            rounds = rounds_of(program, per_round)
            if rounds != sorted(rounds):
                continue
        stages = tuple(program if s == stage else p for s, p in enumerate(schedule.stages))
        trial = replace(schedule, stages=stages)
        try:
            validate(trial)
        except ScheduleError:
            continue
        after = in_flight(trial)[stage]
        if after < before:
            return Capped(program=program, before=before, after=after)
    return None
