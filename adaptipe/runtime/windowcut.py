"""Ending a job-array window at the next iteration when a plan is committed mid-window.

A window of R iterations (rounds) is one instruction list per stage, so a plan version
committed while it runs (a re-partition, a stop) would otherwise wait up to R
iterations for the next boundary. Instead, rank 0 decides before each round r >= 1 of a
window whether the window goes on (no newer version committed) or ends before round r,
and tells every other stage (`WindowCut`, a tiny message on a gloo group of its own).
Every stage then runs exactly the instructions of rounds < r (`WindowRounds`).

Why every stage can wait for that word without slowing down, and why the cut is safe:

- a round's first instruction on any stage depends on rank 0's forward of that round
  (a job's blocks flow from the first stage), and rank 0 decides right before its own
  first instruction of the round, so the word is on its way before any stage could
  start the round anyway; no receive placed after a round's first instruction is posted
  before the word for that round arrives (`Transport.hold_posts`), so a cut leaves no
  receive posted that nobody sends;
- rounds < r never depend on rounds >= r (a job's round r + 1 follows its round r
  on every stage), so the instructions of rounds < r, kept in their order, are a
  complete, deadlock-free schedule of r rounds: every job trains exactly as it would
  have, one iteration less far.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from adaptipe.runtime.transport import Transport
from adaptipe.schedule.types import Backward, Instruction, OptimizerStep

__all__ = ["RoundGate", "WindowCut", "WindowRounds", "rounds_of"]


class RoundGate(Protocol):
    """Says, at the first instruction of each round ``r >= 1`` of a window, whether the
    round runs (every stage gets the same answer)."""

    per_round: int  # micro-batches of a job per round

    def enter(self, round_index: int) -> bool: ...


def rounds_of(program: Sequence[Instruction], per_round: int) -> list[int]:
    """The round of each instruction of a window's stage program.

    Transfers and blocks carry their micro-batch (round ``microbatch // per_round``); a
    job's optimizer step belongs to the round of its last backward before it.
    """
    last: dict[int, int] = {}
    out = []
    for ins in program:
        if isinstance(ins, OptimizerStep):
            out.append(last.get(ins.job, 0))
            continue
        r = ins.microbatch // per_round
        if isinstance(ins, Backward):
            last[ins.job] = r
        out.append(r)
    return out


class WindowRounds:
    """One stage's pass over a window's program, round by round through a `RoundGate`.

    ``runs(pos)`` says whether the instruction at ``pos`` runs; at the first instruction
    of each round it asks the gate, and it lets the transport post a round's receives
    only once the round is known to run.
    """

    def __init__(
        self,
        rounds: Sequence[int],
        receive_positions: Sequence[int],
        gate: RoundGate,
        transport: Transport,
    ) -> None:
        self._at = rounds
        self._gate = gate
        self._transport = transport
        self._first: dict[int, int] = {}  # round -> position of its first instruction
        for pos, r in enumerate(rounds):
            self._first.setdefault(r, pos)
        # While round r runs and round r + 1 is undecided, only the receives placed before
        # round r + 1's first instruction may be posted: a later one may be round r + 1's
        # (a stage can take a later round's block before an earlier round's).
        self._posts: dict[int, int] = {}
        for r in self._first:
            after = self._first.get(r + 1)
            self._posts[r] = (
                len(receive_positions)
                if after is None
                else bisect.bisect_left(receive_positions, after)
            )
        self.cut: int | None = None  # the first round that did not run

    @property
    def first_posts(self) -> int:
        """How many of the window's receives may be posted before round 1 is decided:
        round 0's (`Transport.start_iteration`'s ``hold``)."""
        return self._posts.get(0, 0)

    def start(self) -> None:
        """Before the first instruction: only round 0's receives may be posted (for a
        transport whose iteration has begun without ``hold``)."""
        self._transport.hold_posts(self.first_posts)

    def runs(self, pos: int) -> bool:
        r = self._at[pos]
        if self.cut is not None:
            return r < self.cut
        if r > 0 and self._first[r] == pos:
            if not self._gate.enter(r):
                self.cut = r
                per_round = self._gate.per_round
                self._transport.drop_unposted(lambda k: k.microbatch // per_round < r)
                return False
            self._transport.hold_posts(self._posts[r])
        return True


class WindowCut:
    """Rank 0's word, before each round of a window, on whether the window goes on.

    Rank 0 checks ``newer()`` (a plan version newer than the one the window runs has
    been committed) and sends 1 (go on) or 0 (end before this round) to every other
    rank on ``group`` (a gloo group for these words alone); the others wait for it at
    their own first instruction of the round. ``begin`` before a window, ``end`` after.
    """

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        per_round: int,
        newer: Callable[[], bool],
        group: Any,
        max_rounds: int,
    ) -> None:
        self.rank, self.world, self.per_round = rank, world, per_round
        self._newer = newer
        self._group = group
        self._span = max_rounds + 1
        self._epoch = 0
        self._rounds = 1
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._pending: Any = None  # the posted receive of the next round's word
        self._word = torch.zeros(1, dtype=torch.int32)

    def begin(self, epoch: int, rounds: int) -> None:
        """A window of ``rounds`` rounds starts (``epoch``: windows run so far)."""
        self._epoch, self._rounds = epoch, rounds
        if self.rank != 0 and rounds > 1:
            self._post(1)

    def enter(self, round_index: int) -> bool:
        import torch.distributed as dist

        if self.rank == 0:
            go = not self._newer()
            word = torch.tensor([1 if go else 0], dtype=torch.int32)
            tag = self._tag(round_index)
            for dst in range(1, self.world):  # the word stays alive until it is sent
                self._sends.append((dist.isend(word, dst, group=self._group, tag=tag), word))
            return go
        assert self._pending is not None, f"no word posted for round {round_index}"
        self._pending.wait()
        self._pending = None
        go = bool(int(self._word.item()))
        if go and round_index + 1 < self._rounds:
            self._post(round_index + 1)
        return go

    def end(self) -> None:
        """After the window: rank 0's words are delivered; nothing stays posted."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self._pending is not None:
            raise RuntimeError("a window ended with a round's word still expected")

    def _post(self, round_index: int) -> None:
        import torch.distributed as dist

        self._word = torch.zeros(1, dtype=torch.int32)
        self._pending = dist.irecv(self._word, 0, group=self._group, tag=self._tag(round_index))

    def _tag(self, round_index: int) -> int:
        return (self._epoch % 4) * self._span + round_index
