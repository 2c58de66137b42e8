"""Changing a running run's controller: ``adaptipe adapt RUN_DIR --pause | --resume |
--controller NAME``.

The request is one small JSON file in the run directory, ``control/adapt.json``
(`AdaptOverride`), written atomically with a sequence number; the manager's decision
loop (`adaptipe.runtime.adapt_loop.AdaptLoop`) reads it when it changes, at its next
poll (every 10-50 ms), and logs what it did as an ``adapt_control`` event in
``control.jsonl``. The file stays: it is the run's adaptation state, so a resumed run
starts paused, or with the other controller, as it was left. Nothing here imports torch,
so the command answers at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.runtime.adapt_config import CONTROLLERS
from adaptipe.serial import atomic_write_text

__all__ = ["ADAPT_REQUEST", "AdaptOverride", "ControllerBuild", "read_override", "request_adapt"]

ADAPT_REQUEST = Path("control") / "adapt.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptOverride:
    """What ``adaptipe adapt`` asked of the run: ``paused`` (no new controller calls),
    ``controller`` (None: the config's ``[adapt].controller``), and ``seq``, one more at
    every request, so the loop can tell a new request from one it has applied."""

    paused: bool = False
    controller: str | None = None
    seq: int = 0
    asked_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "controller": self.controller,
            "seq": self.seq,
            "asked_at": self.asked_at,
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str) -> AdaptOverride:
        if not isinstance(data, dict):
            raise PlanError(f"{source}: expected a JSON object")
        controller = data.get("controller")
        if controller is not None and controller not in CONTROLLERS:
            raise PlanError(
                f"{source}: controller must be one of {', '.join(CONTROLLERS)} (got {controller!r})"
            )
        paused, seq = data.get("paused", False), data.get("seq", 0)
        if not isinstance(paused, bool) or not isinstance(seq, int) or isinstance(seq, bool):
            raise PlanError(f"{source}: paused must be true or false and seq an integer")
        return cls(
            paused=paused,
            controller=controller,
            seq=seq,
            asked_at=float(data.get("asked_at", 0.0)),
        )


def read_override(run_dir: str | Path) -> AdaptOverride | None:
    """The run's override, or None where ``adaptipe adapt`` never changed anything."""
    path = Path(run_dir) / ADAPT_REQUEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PlanError(f"{path}: cannot read ({exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise PlanError(f"{path}: not JSON ({exc})") from None
    return AdaptOverride.from_json(data, source=str(path))


def request_adapt(
    run_dir: str | Path, *, paused: bool | None = None, controller: str | None = None
) -> AdaptOverride:
    """Pause or resume the run's controller, or name another (any of
    `adaptipe.runtime.adapt_config.CONTROLLERS`; ``"none"`` stops deciding); what is not
    given stays as it was. Returns the override written."""
    root = Path(run_dir)
    if not (root / "config.json").is_file():
        raise PlanError(f"{root}: not a run directory (no config.json)")
    if controller is not None and controller not in CONTROLLERS:
        raise PlanError(
            f"--controller must be one of {', '.join(CONTROLLERS)} (got {controller!r})"
        )
    if paused is None and controller is None:
        raise PlanError("nothing to change: give --pause, --resume or --controller NAME")
    partition = root / "partition.json"
    replicas = json.loads(partition.read_text()).get("replicas", []) if partition.is_file() else []
    if controller not in (None, "none") and max(replicas, default=1) > 1:
        raise PlanError(
            f"{partition}: replicas {replicas} replicate a stage, and a controller moves "
            "layers, which a replicated pipeline does not (every replica would have to take "
            "the layer); allowed here: --controller none, --pause, --resume"
        )
    old = read_override(root) or AdaptOverride()
    new = AdaptOverride(
        paused=old.paused if paused is None else paused,
        controller=old.controller if controller is None else controller,
        seq=old.seq + 1,
        asked_at=time.time(),
    )
    (root / ADAPT_REQUEST).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / ADAPT_REQUEST, json.dumps(new.to_json()) + "\n")
    return new


class ControllerBuild:
    """A controller built on a daemon thread (``adaptipe adapt --controller``)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), name="adaptipe-build", daemon=True).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except Exception as exc:  # logged by the loop; the previous controller stays
            self.error = exc
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()
