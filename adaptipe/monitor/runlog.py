"""A run directory's logs, read and checked: ``telemetry.jsonl``, ``metrics.jsonl`` and
``summary.json``.

:func:`load_run` reads them once (``adaptipe report``, a finished run); a
:class:`RunFollower` reads what was appended since its last look (``adaptipe monitor``
on a running run), taking only complete lines. Every telemetry line is checked with
:func:`schema.decode` and every metrics line for its shape; a bad line is skipped and
counted under its reason, and :func:`skipped_note` says how many were.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.monitor.schema import MAX_FRAME_BYTES, Record, TelemetryError, decode

__all__ = [
    "METRICS",
    "SUMMARY",
    "TELEMETRY",
    "JsonlTail",
    "RunFollower",
    "RunLog",
    "check_run_dir",
    "control_events",
    "load_run",
    "skipped_note",
]

TELEMETRY, METRICS, SUMMARY = "telemetry.jsonl", "metrics.jsonl", "summary.json"
CONTROL = "control.jsonl"
_MAX_LINE = 4 * MAX_FRAME_BYTES  # a longer "line" is garbage: drop it rather than buffer it


class JsonlTail:
    """The complete lines appended to a JSON-lines file since the last :meth:`read`.

    A file that shrank was replaced (a new run): it is read again from its start.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.oversized = 0  # lines dropped for exceeding _MAX_LINE
        self._partial = b""
        self._dropping = False  # inside an oversized line: skip to its newline

    def read(self) -> list[bytes]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:
            self.offset, self._partial, self._dropping = 0, b"", False
        if size == self.offset:
            return []
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read(size - self.offset)
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if self._dropping and lines:
            lines.pop(0)
            self._dropping = False
        if len(self._partial) > _MAX_LINE:
            self.oversized += 1
            self._partial, self._dropping = b"", True
        return [line for line in lines if line.strip()]

    def rest(self) -> bytes:
        """The last line when it has no newline yet (of a finished file: a cut-off line)."""
        rest, self._partial = self._partial, b""
        return rest if rest.strip() else b""


def _metrics_record(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    ok = (
        isinstance(rec, dict)
        and isinstance(rec.get("iteration"), int)
        and isinstance(rec.get("stages"), list)
        and all(isinstance(s, dict) for s in rec["stages"])
    )
    return rec if ok else None


class RunFollower:
    """Follows a run directory's telemetry and metrics, checking every line."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._tails = {TELEMETRY: JsonlTail(root / TELEMETRY), METRICS: JsonlTail(root / METRICS)}
        #: bad lines per file and reason (a TelemetryError reason, or "malformed")
        self.skipped: dict[str, Counter[str]] = {TELEMETRY: Counter(), METRICS: Counter()}

    def poll(self, *, final: bool = False) -> tuple[list[Record], list[dict[str, Any]]]:
        """New records and metrics; ``final`` also takes a last line that has no newline."""
        lines = {name: tail.read() for name, tail in self._tails.items()}
        for name, tail in self._tails.items():
            if final and (rest := tail.rest()):
                lines[name].append(rest)
            if tail.oversized:
                self.skipped[name]["oversized"] += tail.oversized
                tail.oversized = 0
        records: list[Record] = []
        for line in lines[TELEMETRY]:
            try:
                records.append(decode(line.strip()))
            except TelemetryError as exc:
                self.skipped[TELEMETRY][exc.reason] += 1
        metrics: list[dict[str, Any]] = []
        for line in lines[METRICS]:
            rec = _metrics_record(line)
            if rec is None:
                self.skipped[METRICS]["malformed"] += 1
            else:
                metrics.append(rec)
        return records, metrics

    def skipped_note(self) -> str:
        return skipped_note(self.skipped)


def skipped_note(skipped: dict[str, Counter[str]]) -> str:
    """``Skipped 3 bad line(s): telemetry.jsonl 2 malformed, 1 bad-field``, or ''."""
    parts = []
    for name, counts in skipped.items():
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()) if n)
        if reasons:
            parts.append(f"{name} {reasons}")
    total = sum(sum(c.values()) for c in skipped.values())
    return f"Skipped {total} bad line(s): " + "; ".join(parts) if total else ""


@dataclass(slots=True)
class RunLog:
    """What a run directory's logs hold, every line checked (see :func:`load_run`)."""

    root: Path
    records: list[Record]
    metrics: list[dict[str, Any]]
    summary: dict[str, Any] | None
    skipped: dict[str, Counter[str]]


def check_run_dir(root: Path) -> None:
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise PlanError(f"{root}: {what} (expected the run directory of a training run)")


def _require(path: Path, lines: int, valid: int) -> None:
    if not path.exists():
        raise PlanError(f"{path}: not found (a run directory gets it when training starts)")
    if lines == 0:
        raise PlanError(f"{path}: is empty (no iteration finished yet?)")
    if valid == 0:
        raise PlanError(f"{path}: none of its {lines} line(s) is a valid record")


def load_run(root: str | Path, *, need: Iterable[str] = (TELEMETRY,), final: bool = True) -> RunLog:
    """Read a run directory's telemetry, metrics and summary, skipping bad lines.

    ``final``: the run has ended, so a last line without a newline is a cut-off (bad)
    line; a running run's last line may still be being written and is left out.

    Raises:
        PlanError: ``root`` is not a directory, or a file in ``need`` is missing, empty
            or holds no valid line; the message names the path.
    """
    root = Path(root)
    check_run_dir(root)
    follower = RunFollower(root)
    records, metrics = follower.poll(final=final)
    for name in need:
        valid = len(records) if name == TELEMETRY else len(metrics)
        _require(root / name, valid + sum(follower.skipped[name].values()), valid)
    summary = None
    if (root / SUMMARY).is_file():
        try:
            data = json.loads((root / SUMMARY).read_text())
        except (OSError, ValueError) as exc:
            raise PlanError(f"{root / SUMMARY}: not valid JSON ({exc})") from None
        summary = data if isinstance(data, dict) else None
    return RunLog(root, records, metrics, summary, follower.skipped)


def control_events(root: str | Path) -> list[dict[str, Any]]:
    """The manager's events (``control.jsonl``: decisions, migrations, controller
    changes), torn or foreign lines left out; [] when the run has none."""
    path = Path(root) / CONTROL
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out
