"""Memory pressure inside a stage's worker: the ``memory`` injection with a ``stage``.

A child process's memory (`adaptipe.inject.injectors`) loads the machine, not the
worker: a guard that reads the worker's own resident set
(`adaptipe.runtime.memory_guard`) would not see it. This hook, run by the worker the
injection names, reads the scenario's control files (`read_memory_loads`) at each
window boundary and holds, per active injection, ``grow_mb`` MB more than at the last
boundary, up to its ``mb``; memory of an injection that has ended is released. On a
CUDA stage the blocks are device memory, which is what that stage's guard reads.
"""

from __future__ import annotations

import os
from typing import Any

from adaptipe.inject.injectors import read_memory_loads

__all__ = ["WorkerMemory"]

_MB = 1 << 20


class WorkerMemory:
    """A worker hook (`adaptipe.runtime.hooks.WorkerHook`) that allocates the memory
    loads aimed at its stage."""

    def __init__(
        self, control_dir: str | os.PathLike[str], rank: int, *, device: Any = None
    ) -> None:
        self.control_dir, self.rank = control_dir, rank
        self.device = device if getattr(device, "type", "cpu") == "cuda" else None
        self.held: dict[str, list[object]] = {}  # per injection, its blocks
        self.held_mb: dict[str, float] = {}

    def edges(self) -> set[int]:
        return set()

    def before_boundary(self, iteration: int) -> None:
        loads = {
            str(s.get("origin")): s for s in read_memory_loads(self.control_dir).get(self.rank, [])
        }
        for gone in set(self.held) - set(loads):
            del self.held[gone], self.held_mb[gone]  # its blocks are freed (unmapped) here
        for origin, load in loads.items():
            self._grow(origin, load)

    def _grow(self, origin: str, load: dict[str, Any]) -> None:
        have = self.held_mb.get(origin, 0.0)
        want = min(float(load["mb"]), have + float(load["grow_mb"]))
        size = int((want - have) * _MB)
        if size <= 0:
            return
        touch = bool(load.get("touch", True))
        block: object
        if self.device is not None:
            import torch

            block = torch.empty(size, dtype=torch.uint8, device=self.device)
            if touch:
                block.fill_(0x5A)
        else:  # touched: written, so resident; untouched: reserved (zero pages)
            block = b"\x5a" * size if touch else bytearray(size)
        self.held.setdefault(origin, []).append(block)
        self.held_mb[origin] = want

    @property
    def total_mb(self) -> float:
        return sum(self.held_mb.values())

    def before_window(self, window: object) -> None:
        return None

    def after_window(self, window: object) -> None:
        return None

    def finish(self, total: int) -> None:
        return None

    def close(self) -> None:
        self.held.clear()
        self.held_mb.clear()
