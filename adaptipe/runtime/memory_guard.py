"""Memory early warning (DynPipe): a stage that nears its memory limit, or whose memory
grows fast enough to cross it within a few iterations, acts before it is killed.

``[train] stage_memory_mb`` gives each stage its limit. At every window boundary the
worker reads its memory in use (cheap: ``/proc/self/statm``'s resident set, or its
cgroup's ``memory.current`` with ``ADAPTIPE_MEMORY_SOURCE=cgroup`` when each worker
runs in a cgroup of its own; never ``ru_maxrss``, a peak that only grows) and
`MemoryGuard` classifies it:

- ``near``: at least ``near`` (0.85) of the limit;
- ``growing``: the slope over the last ``samples`` boundaries would cross the limit
  within ``horizon`` iterations;
- ``ok``: neither, and once warned, below ``clear`` (0.75) of the limit and no longer
  growing fast (hysteresis: a stage hovering at the threshold does not flap).

On each change into a warned state the stage reacts, and logs one ``memory_warning``
event in its metrics with what each reaction did:

1. fewer micro-batches in flight: its instruction list with forwards delayed
   (`adaptipe.runtime.inflight`; numerics unchanged), or why not;
2. job states offloaded: a GPU stage of a job-array with a memory manager keeps one
   job state fewer resident (`MemoryManager.set_budget`); a CPU stage has nothing to
   offload (its job states live in host memory already), and says so;
3. a re-partition away from it asked of the manager (`adaptipe.runtime.memory_relief`).

Back to ``ok``, the list and the budget are restored (a ``memory_ok`` event); the
manager's move stands. At the end a ``memory_peak`` event gives the most the stage used.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from weakref import WeakKeyDictionary

from adaptipe.runtime.hooks import Window
from adaptipe.runtime.inflight import Capped, capped
from adaptipe.runtime.memory_relief import MemoryRequest, write_request
from adaptipe.runtime.stage import StageExecutor
from adaptipe.runtime.stagestate import Stage
from adaptipe.schedule.types import Instruction

__all__ = [
    "MEMORY_SOURCE_ENV",
    "GuardSettings",
    "MemoryGuard",
    "MemoryGuardHook",
    "Reading",
    "guard_hook",
    "usage_reader",
]

MEMORY_SOURCE_ENV = "ADAPTIPE_MEMORY_SOURCE"
"""``rss`` (default: this process's resident set) or ``cgroup`` (its cgroup's usage)."""
_MB = 1 << 20
State = Literal["ok", "near", "growing"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardSettings:
    limit_bytes: int
    near: float = 0.85  # warn at this fraction of the limit
    clear: float = 0.75  # a warned stage is ok again below this fraction
    horizon: int = 3  # growing fast: would cross the limit within this many iterations
    samples: int = 4  # boundaries the slope is fitted over


@dataclass(frozen=True, slots=True, kw_only=True)
class Reading:
    iteration: int
    used_bytes: int
    slope_bytes: float  # per iteration, least squares over the last samples
    state: State
    previous: State

    @property
    def changed(self) -> bool:
        return self.state != self.previous


class MemoryGuard:
    """The pure part: usage in, state out (no reading, no reacting)."""

    def __init__(self, settings: GuardSettings) -> None:
        if settings.limit_bytes <= 0 or not 0 < settings.clear < settings.near <= 1:
            raise ValueError(f"need limit > 0 and 0 < clear < near <= 1 (got {settings})")
        self.settings = settings
        self.state: State = "ok"
        self.peak_bytes = 0
        self._history: deque[tuple[int, int]] = deque(maxlen=max(2, settings.samples))

    def observe(self, iteration: int, used_bytes: int) -> Reading:
        s = self.settings
        if self._history and iteration <= self._history[-1][0]:
            self._history.clear()  # a restart or a replayed boundary: a fresh slope
        self._history.append((iteration, used_bytes))
        self.peak_bytes = max(self.peak_bytes, used_bytes)
        slope = _slope(self._history)
        growing = slope > 0 and used_bytes + slope * s.horizon >= s.limit_bytes
        state: State
        if growing:
            state = "growing"
        elif used_bytes >= s.near * s.limit_bytes:
            state = "near"
        elif self.state != "ok" and used_bytes >= s.clear * s.limit_bytes:
            state = "near"  # warned, not yet clear of it
        else:
            state = "ok"
        reading = Reading(
            iteration=iteration,
            used_bytes=used_bytes,
            slope_bytes=slope,
            state=state,
            previous=self.state,
        )
        self.state = state
        return reading


def _slope(points: deque[tuple[int, int]]) -> float:
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``, second field)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cgroup_bytes() -> int:
    """This process's cgroup (v2) memory usage now (``memory.current``)."""
    line = Path("/proc/self/cgroup").read_text().splitlines()[0]
    path = line.split(":", 2)[2].lstrip("/")
    return int((Path("/sys/fs/cgroup") / path / "memory.current").read_text())


def usage_reader(source: str | None = None, *, device: Any = None) -> Callable[[], int]:
    """How this worker reads its memory (``source`` or ``ADAPTIPE_MEMORY_SOURCE``): on a
    CUDA stage the device's reserved memory by default (what runs out there; offloading
    job states to pinned host buffers would raise the host figure, not lower it)."""
    default = "cuda" if device is not None and getattr(device, "type", "") == "cuda" else "rss"
    source = source or os.environ.get(MEMORY_SOURCE_ENV, default)
    if source == "cuda":
        import torch

        return lambda: int(torch.cuda.memory_reserved(device))
    if source == "rss":
        return rss_bytes
    if source == "cgroup":
        cgroup_bytes()  # fails here, at the start, where there is no cgroup v2 to read
        return cgroup_bytes
    raise ValueError(f"{MEMORY_SOURCE_ENV}={source!r} must be rss, cgroup or cuda")


class MemoryGuardHook:
    """A worker hook (`adaptipe.runtime.hooks.WorkerHook`): reads, classifies, reacts."""

    def __init__(
        self,
        *,
        root: Path,
        stage: Stage,
        limit_mb: int,
        log: Callable[[dict[str, Any]], None],
        read: Callable[[], int] | None = None,
    ) -> None:
        self.root, self.stage, self.log = root, stage, log
        self.guard = MemoryGuard(GuardSettings(limit_bytes=limit_mb * _MB))
        self.read = read if read is not None else usage_reader(device=stage.device)
        self.seq = 0
        self.epoch = f"{os.getpid()}-{time.time_ns()}"  # this worker process
        self.budget: tuple[int, int] | None = None  # (configured, tightened) job states
        # per executor: (its own list, the capped one or None where no cap is valid)
        self._lists: WeakKeyDictionary[StageExecutor, tuple[tuple[Instruction, ...], Capped | None]]
        self._lists = WeakKeyDictionary()

    def edges(self) -> set[int]:
        return set()

    def before_boundary(self, iteration: int) -> None:
        return None

    def before_window(self, window: Window) -> None:
        reading = self.guard.observe(window.start, self.read())
        warned = reading.state != "ok"
        event: dict[str, Any] = {}
        if reading.changed:
            event = {
                "event": "memory_warning" if warned else "memory_ok",
                "stage": self.stage.rank,
                "iteration": reading.iteration,
                "state": reading.state,
                "previous": reading.previous,
                "used_mb": round(reading.used_bytes / _MB, 1),
                "limit_mb": self.guard.settings.limit_bytes // _MB,
                "slope_mb": round(reading.slope_bytes / _MB, 1),
            }
        in_flight = self._admit(window, warned)
        offload = self._offload(warned)
        if not event:
            return
        event |= {"in_flight": in_flight, "offload": offload}
        # A new ask only when the stage becomes warned or starts growing: calming down
        # (growing -> near) is logged and written, not asked again.
        if warned and (reading.previous == "ok" or reading.state == "growing"):
            self.seq += 1
        if warned:
            event["request"] = self.seq
        self._request(reading)
        self.log(event)

    def _admit(self, window: Window, warned: bool) -> dict[str, Any]:
        """This window's executor runs its capped list while warned, its own otherwise."""
        ex = window.executor
        if not warned and ex not in self._lists:  # never capped: no cap to work out yet
            return {"from": None, "to": None}
        if ex not in self._lists:
            per_round = ex.schedule.num_microbatches // window.rounds if window.rounds > 1 else None
            self._lists[ex] = (ex.program, capped(ex.schedule, ex.stage, per_round=per_round))
        own, cap = self._lists[ex]
        want = cap.program if warned and cap is not None else own
        if ex.program is not want:
            ex.set_program(want)
            if self.stage.memory is not None:
                from adaptipe.runtime.memory import block_order

                self.stage.memory.reorder(block_order(want))
        if cap is None:
            return {"why": "no cap below this stage's peak keeps its schedule valid"}
        return {"from": cap.before, "to": cap.after if warned else cap.before}

    def _offload(self, warned: bool) -> dict[str, Any]:
        """One job state fewer resident while warned (GPU job-arrays with a budget)."""
        if self.stage.device.type != "cuda":
            return {"why": "a CPU stage's job states live in host memory: nothing to offload"}
        memory = self.stage.memory
        if memory is None or not memory.enabled:
            return {
                "why": "no memory manager offloads on this stage (a job-array with "
                "[sweep].memory_budget below its jobs has one)"
            }
        if self.budget is None or memory.budget not in self.budget:
            self.budget = (memory.budget, memory.budget)  # a rebuilt manager: its budget
        configured = self.budget[0]
        target = memory.set_budget(configured - 1 if warned else configured)
        self.budget = (configured, target)
        return {"from": configured, "to": target}

    def _request(self, reading: Reading) -> None:
        request = MemoryRequest(
            stage=self.stage.rank,
            seq=self.seq,
            iteration=reading.iteration,
            state=reading.state,
            used_mb=round(reading.used_bytes / _MB, 1),
            limit_mb=self.guard.settings.limit_bytes / _MB,
            slope_mb=round(reading.slope_bytes / _MB, 1),
            chunks=len(self.stage.chunks),
            epoch=self.epoch,
        )
        write_request(self.root, request)

    def after_window(self, window: Window) -> None:
        return None

    def finish(self, total: int) -> None:
        peak = max(self.guard.peak_bytes, self.read())
        limit = self.guard.settings.limit_bytes // _MB
        event = {"event": "memory_peak", "stage": self.stage.rank, "iteration": total}
        self.log(event | {"used_mb": round(peak / _MB, 1), "limit_mb": limit})

    def close(self) -> None:
        return None


def guard_hook(
    root: Path, limit_mb: int | None, stage: Stage, log: Callable[[dict[str, Any]], None]
) -> list[MemoryGuardHook]:
    """The guard ``[train] stage_memory_mb`` asks for on this stage (none without it)."""
    if limit_mb is None:
        return []
    return [MemoryGuardHook(root=root, stage=stage, limit_mb=limit_mb, log=log)]
