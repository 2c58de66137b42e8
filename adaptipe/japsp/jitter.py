"""Windows replayed with jittered block times: how long a window should run for real.

Windows that tie by the block costs do not tie once block times vary (`best_window`
ranks the nearly shortest by this), so a window is replayed with its per-stage orders
fixed and every block's time drawn around its cost, the same draws for every window.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from adaptipe.errors import PlanError
from adaptipe.japsp.evaluate import OpTable
from adaptipe.japsp.instance import JapspInstance

if TYPE_CHECKING:
    from adaptipe.japsp.window import Window

__all__ = ["JITTER", "Replay", "expected_makespan"]

JITTER = 0.1
"""Spread (relative standard deviation) of block times `best_window` plans for. In
traces of 4 equal jobs on this project's 2-core CPU machine, a stage's blocks of one
kind vary by 12-14%; on that benchmark's costs (and on profiles of it that put either
stage ahead) any spread from 3% to 20% picks the same window, so a round figure does."""

_SAMPLES = 16  # draws per window; long windows get fewer (_REPLAY_WORK blocks in all, >= 4)
_REPLAY_WORK = 100_000


def expected_makespan(
    inst: JapspInstance | OpTable,
    window: Window,
    *,
    jitter: float = 0.0,
    samples: int | None = None,
) -> float:
    """``window``'s makespan with its per-stage orders fixed and every block's time
    scaled by ``1 + jitter x Z`` (at least a quarter of it), ``Z`` a standard normal
    draw (a sum of 12 uniforms less 6: plain arithmetic, so every platform draws the
    same): the mean over ``samples`` seeded draws, by default as many as `best_window`
    ranks with (16, fewer for long windows). A backward's output leaves when its own
    work is done, before its update. ``jitter = 0`` gives the makespan by the block
    costs."""
    if jitter < 0 or (samples is not None and samples < 1):
        raise PlanError(
            f"expected_makespan: needs jitter >= 0 and samples >= 1 (got {jitter}, {samples})"
        )
    tab = inst if isinstance(inst, OpTable) else OpTable.of(inst)
    return Replay(tab, window.rounds, jitter=jitter, samples=samples).expected(window)


class Replay:
    """Replays windows of ``rounds`` rounds with block times drawn around their costs;
    every window sees the same draws per block (a fair comparison)."""

    def __init__(
        self, tab: OpTable, rounds: int, *, jitter: float = JITTER, samples: int | None = None
    ) -> None:
        self.tab, self.rounds = tab, rounds
        size = tab.n * rounds
        if jitter == 0:
            self.scales = [[1.0] * size]
            return
        if samples is None:
            samples = max(4, min(_SAMPLES, _REPLAY_WORK // max(1, size)))
        rng = random.Random(0)
        draw = rng.random
        self.scales = [
            [max(0.25, 1.0 + jitter * (sum(draw() for _ in range(12)) - 6.0)) for _ in range(size)]
            for _ in range(samples)
        ]

    def expected(self, window: Window) -> float:
        tab, rounds = self.tab, self.rounds
        if window.rounds != rounds or len(window.orders) != tab.stages:
            raise PlanError(
                f"expected_makespan: a window of {window.rounds} rounds over "
                f"{len(window.orders)} stages, not {rounds} over {tab.stages}"
            )
        steps = self._steps(window)
        total = 0.0
        for scale in self.scales:
            done = [0.0] * (tab.n * rounds)  # when the block's output reaches the next
            free = [0.0] * tab.stages
            for key, s, o, pred, switch in steps:
                t = free[s] + switch
                if pred >= 0:
                    t = max(t, done[pred])
                k = scale[key]
                done[key] = t + tab.rel[o] * k + tab.lag[o] - tab.rel[o]  # then the update
                free[s] = t + tab.dur[o] * k
            total += max(free)
        return total / len(self.scales)

    def _steps(self, window: Window) -> list[tuple[int, int, int, int, float]]:
        """The window's blocks in an order every predecessor comes first in:
        (key, stage, op, key of the job's previous block or -1, switch time before)."""
        tab, rounds, k2 = self.tab, self.rounds, 2 * self.tab.stages
        seqs = [
            [tab.op((k, j), s) * rounds + r for k, j, r in st] for s, st in enumerate(window.orders)
        ]
        placed = [False] * (tab.n * rounds)
        ptr = [0] * len(seqs)
        prev = [-1] * len(seqs)
        steps: list[tuple[int, int, int, int, float]] = []
        left = sum(len(seq) for seq in seqs)
        while left:
            moved = False
            for s, seq in enumerate(seqs):
                while ptr[s] < len(seq):
                    key = seq[ptr[s]]
                    o = key // rounds
                    pred = key - rounds if o % k2 else -1
                    if pred >= 0 and not placed[pred]:
                        break
                    switch = tab.sw[prev[s]] if prev[s] >= 0 and prev[s] // k2 != o // k2 else 0.0
                    steps.append((key, s, o, pred, switch))
                    placed[key] = True
                    prev[s] = o
                    ptr[s] += 1
                    left -= 1
                    moved = True
            if not moved:
                raise PlanError("expected_makespan: the window's orders wait on each other")
        return steps
