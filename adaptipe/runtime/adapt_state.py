"""The decision loop's state saved with the run's checkpoints (`adaptipe.runtime.adapt_loop`).

One JSON file per checkpoint, ``control/adapt-state/iter-N.json``: the controller in
charge, whether it was paused, the last move's iteration and the controller's own
``state_dict()`` (`adaptipe.controllers.base.Stateful`), so a resumed run decides as the
interrupted one would have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adaptipe.serial import atomic_write_text

__all__ = ["CONTROLLER_FILE", "STATE_DIR", "load_state", "record_controller", "save_state"]

STATE_DIR = Path("control") / "adapt-state"
CONTROLLER_FILE = Path("control") / "controller.json"


def record_controller(root: Path, decider: object, *, iteration: int) -> None:
    """Name the controller in charge, and the artifacts it decides with, in
    ``control/controller.json`` (each change appended to its ``history``)."""
    describe = getattr(decider, "describe", None)
    name = getattr(decider, "name", "none")
    now = describe() if callable(describe) else {"controller": name, "artifacts": []}
    path = root / CONTROLLER_FILE
    try:
        history = json.loads(path.read_text()).get("history", [])
    except (OSError, ValueError, AttributeError):
        history = []
    entry = {"iteration": iteration, **now}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({**entry, "history": [*history, entry]}, indent=1) + "\n")


def save_state(
    root: Path,
    iteration: int,
    *,
    controller: str,
    paused: bool,
    last_move: int | None,
    decider: object,
) -> Path:
    """Write the state as of ``iteration`` (the checkpoint's) atomically; its path."""
    get = getattr(decider, "state_dict", None)
    state = {
        "iteration": iteration,
        "controller": controller,
        "paused": paused,
        "last_move": last_move,
        "decider_state": get() if callable(get) else {},
    }
    path = root / STATE_DIR / f"iter-{iteration:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(state) + "\n")
    return path


def load_state(root: Path, start: int) -> tuple[Path, dict[str, Any]] | None:
    """The newest state saved at or before iteration ``start`` (a resume's checkpoint),
    or None. A file that cannot be read counts as absent: the loop then starts afresh."""
    saved = sorted(
        (int(p.stem.removeprefix("iter-")), p)
        for p in (root / STATE_DIR).glob("iter-*.json")
        if p.stem.removeprefix("iter-").isdigit()
    )
    for n, path in reversed(saved):
        if n > start:
            continue
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict):
            return path, state
    return None
