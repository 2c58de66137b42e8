"""Gavel's round-based mechanism (seed 002, §5.3.2): realise an allocation X over rounds.

Each round, every (job, device type) pair has the priority ``X[m, j] / received[m, j]``
(rounds job m has run on type j; a pair that has received nothing and is owed time comes
first). Pairs are taken in decreasing priority; a job runs on at most one type per
round and only where ``scale_m`` workers of that type are still free. Over many rounds
each job's share of rounds on each type approaches X, within about a round.

Ties break by job order, then type order, so a given history gives one placement.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["RoundRobinState", "place_round"]

Array = npt.NDArray[np.float64]


class RoundRobinState:
    """Rounds received per (job, type), kept across allocation changes by job name."""

    def __init__(self) -> None:
        self.received: dict[tuple[str, int], float] = {}

    def row(self, names: Sequence[str], types: int) -> Array:
        return np.array(
            [[self.received.get((n, j), 0.0) for j in range(types)] for n in names],
            dtype=np.float64,
        ).reshape(len(names), types)

    def add(self, name: str, type_index: int, rounds: float = 1.0) -> None:
        key = (name, type_index)
        self.received[key] = self.received.get(key, 0.0) + rounds

    def forget(self, name: str) -> None:
        for key in [k for k in self.received if k[0] == name]:
            del self.received[key]


def place_round(
    x: Array,
    received: Array,
    scale: Sequence[int],
    workers: Sequence[int],
) -> list[int | None]:
    """For each job, the device type it runs on this round (None: it waits)."""
    m, j = x.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        priority = np.where(received > 0, x / np.maximum(received, 1e-300), np.inf)
    priority = np.where(x > 1e-9, priority, -np.inf)
    # Among the owed-and-unserved (inf), larger shares first: sort by (priority, x).
    order = sorted(
        ((i, k) for i in range(m) for k in range(j) if priority[i, k] > -np.inf),
        key=lambda p: (-priority[p], -x[p], p[0], p[1]),
    )
    free = list(workers)
    placed: list[int | None] = [None] * m
    for i, k in order:
        if placed[i] is None and free[k] >= scale[i]:
            placed[i] = k
            free[k] -= scale[i]
    return placed
