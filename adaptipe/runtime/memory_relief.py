"""A worker's memory warning, and the manager's answer: layers off the warned stage.

A stage's memory guard (`adaptipe.runtime.memory_guard`) writes its warning to
``control/memory-stage-N.json`` in the run directory (atomically; ``seq`` counts its
warnings), the way ``adaptipe adapt`` hands the decision loop its requests. The loop
(`adaptipe.runtime.adapt_loop.AdaptLoop`) stats the files at each poll through
`MemoryRelief`: each new warning is logged to ``control.jsonl`` as a
``memory_warning`` event, and the newest unanswered one of a stage that is still warned
becomes a decision with reason ``"memory"``: one layer off that stage, to the
neighbour holding fewer layers (DynPipe re-partitions away from a worker near its
limit). The loop commits it through the usual re-partition and migration, when no plan
change is in flight and the cooldown allows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adaptipe.plan.partition import Partition
from adaptipe.serial import atomic_write_text

__all__ = ["MemoryRelief", "MemoryRequest", "relieved_bounds", "request_path", "write_request"]

CONTROLLER = "memory_guard"
"""The name memory decisions carry in ``control.jsonl`` (where a controller's would)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryRequest:
    """A stage's latest memory state as its guard wrote it."""

    stage: int
    seq: int  # this stage's warnings so far
    iteration: int
    state: str  # ok | near | growing
    used_mb: float
    limit_mb: float
    slope_mb: float  # per iteration
    chunks: int = 1  # the worker's virtual stages: with several, nothing moves (for now)
    epoch: str = ""  # the worker process that wrote it: a restarted worker counts from 1

    @classmethod
    def from_json(cls, data: Any) -> MemoryRequest:
        """Raise ValueError (or KeyError/TypeError) on a foreign or torn file."""
        req = cls(
            stage=int(data["stage"]),
            seq=int(data["seq"]),
            iteration=int(data["iteration"]),
            state=str(data["state"]),
            used_mb=float(data["used_mb"]),
            limit_mb=float(data["limit_mb"]),
            slope_mb=float(data["slope_mb"]),
            chunks=int(data.get("chunks", 1)),
            epoch=str(data.get("epoch", "")),
        )
        if req.state not in ("ok", "near", "growing"):
            raise ValueError(f"state {req.state!r}")
        return req

    def describe(self) -> str:
        what = "growing fast" if self.state == "growing" else "near its limit"
        return (
            f"memory: stage {self.stage} {what}, {self.used_mb:.0f} of {self.limit_mb:.0f} MB "
            f"({self.slope_mb:+.0f} MB per iteration)"
        )


def request_path(root: str | os.PathLike[str], stage: int) -> Path:
    return Path(root) / "control" / f"memory-stage-{stage}.json"


def write_request(root: str | os.PathLike[str], request: MemoryRequest) -> None:
    path = request_path(root, request.stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(asdict(request)) + "\n")


def relieved_bounds(
    bounds: Sequence[int], stage: int, *, warned: Collection[int] = ()
) -> tuple[int, ...] | None:
    """``bounds`` with one layer moved off ``stage`` to the neighbour holding fewer
    layers (the previous one on a tie), never to a ``warned`` one (near its own limit);
    None when the stage holds a single layer or no neighbour can take one."""
    b = list(bounds)
    if not 0 <= stage < len(b) - 1 or b[stage + 1] - b[stage] <= 1:
        return None
    sizes = [b[i + 1] - b[i] for i in range(len(b) - 1)]
    before = sizes[stage - 1] if stage > 0 and stage - 1 not in warned else None
    after = sizes[stage + 1] if stage + 1 < len(sizes) and stage + 1 not in warned else None
    if before is not None and (after is None or before <= after):
        b[stage] += 1  # its first layer goes to the previous stage
    elif after is not None:
        b[stage + 1] -= 1  # its last layer goes to the next stage
    else:
        return None  # no neighbour, or every neighbour is warned too
    return tuple(b)


class MemoryRelief:
    """The decision loop's side of the warnings (see the module doc)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.folder = Path(root) / "control"
        self._stamps: dict[str, tuple[int, int]] = {}
        self._latest: dict[int, MemoryRequest] = {}  # per stage, its newest request
        # per stage, the (worker epoch, seq) last answered; a new epoch starts afresh
        self._answered: dict[int, tuple[str, int]] = {}
        for event in self.poll():  # an earlier launch's files (a resume): answered then
            self._answered[int(event["stage"])] = (str(event["epoch"]), int(event["seq"]))

    def poll(self) -> list[dict[str, Any]]:
        """Read the warnings that changed; their ``memory_warning`` events."""
        try:
            entries = [e for e in os.scandir(self.folder) if e.name.startswith("memory-stage-")]
        except OSError:
            return []
        events = []
        for entry in entries:
            try:
                st = entry.stat()
                stamp = (st.st_mtime_ns, st.st_size)
                if self._stamps.get(entry.name) == stamp:
                    continue
                self._stamps[entry.name] = stamp
                req = MemoryRequest.from_json(json.loads(Path(entry.path).read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # replaced while read: the next poll sees it
            old = self._latest.get(req.stage)
            same = old is not None and old.epoch == req.epoch
            if same and old is not None and old.seq >= req.seq and old.state == req.state:
                continue
            self._latest[req.stage] = req
            events.append({"event": "memory_warning", **asdict(req)})
        return events

    @property
    def asking(self) -> bool:
        """Whether a warned stage waits for an answer."""
        return self._wanted() is not None

    def _unanswered(self, req: MemoryRequest) -> bool:
        epoch, seq = self._answered.get(req.stage, ("", 0))
        return req.epoch != epoch or req.seq > seq

    def _wanted(self) -> MemoryRequest | None:
        asks = [r for r in self._latest.values() if r.state != "ok" and self._unanswered(r)]
        return min(asks, key=lambda r: (r.iteration, r.stage), default=None)

    def decide(self, iteration: int, partition: Partition, *, dry_run: bool) -> dict[str, Any]:
        """Answer the oldest unanswered warning under ``partition``: a decision event
        (``acted`` false; the loop commits ``decision.bounds`` and says so)."""
        req = self._wanted()
        assert req is not None, "decide() only while asking"
        self._answered[req.stage] = (req.epoch, req.seq)
        bounds = tuple(partition.bounds)
        stage = req.stage
        warned = {s for s, r in self._latest.items() if s != stage and r.state != "ok"}
        moved = relieved_bounds(bounds, stage, warned=warned) if req.chunks == 1 else None
        why = "one layer off it" if moved else "it cannot give a layer"
        if moved is None and warned and relieved_bounds(bounds, stage) is not None:
            why = f"not moved: its neighbours are warned too (stages {sorted(warned)})"
        if req.chunks > 1:
            why = "not moved: a worker holds several virtual stages ([pipeline].virtual > 1)"
        reason = f"{req.describe()}: {why}"
        return {
            "event": "decision",
            "iteration": iteration,
            "controller": CONTROLLER,
            "reason": "memory",
            "bounds": list(bounds),
            "decision": {
                "bounds": list(moved) if moved is not None else None,
                "reason": reason,
                "stage": stage,
            },
            "acted": False,
            "dry_run": dry_run,
            "inputs": asdict(req),
            "seconds": 0.0,
        }
