"""Traces: what a pipeline's surroundings did, iteration by iteration.

A trace is the ground the gymnasium environments (`adaptipe.envs`) run on and the
baselines and learned controllers are judged on. It says, for every iteration of a
training run on ``stages`` stage workers:

- ``slowdown``: per stage, how much slower its compute runs than on a quiet machine
  (1.0: quiet; 2.0: twice as long);
- ``bandwidth_Bps``: per stage boundary ``s -> s + 1``, the link's bandwidth in bytes
  per second (``null`` in the file: not the bottleneck, unlimited);
- ``device``: per stage, the device readings the runtime's monitor would sample (the
  raw fields of a ``device_sample`` record, `adaptipe.monitor.schema.DeviceSample`), so
  the observation an environment builds is the runtime's; may be empty;
- ``events``: what happened at the iteration, each a small object with a ``kind``:
  ``arrive`` / ``leave`` (a co-located job on ``stage``), ``preempt`` (``stage`` lost,
  ``stall_s`` seconds to restart it), ``bandwidth`` (a link changed), ``note``.

The environments use the true slowdown and bandwidth only for the reward and the
simulated measurements; a controller sees what the runtime would measure.

The file is JSON Lines: a header, then one row per iteration, numbered from 0 without
gaps::

    {"kind": "adaptipe-trace", "version": 1, "stages": 2, "family": "poisson-heavy",
     "seed": 3, "iterations": 2, "device_source": "cpu", "meta": {...}}
    {"iteration": 0, "slowdown": [1.0, 1.0], "bandwidth_Bps": [null], "device": [], "events": []}
    {"iteration": 1, "slowdown": [1.0, 2.5], "bandwidth_Bps": [1.25e9], "device": [],
     "events": [{"kind": "arrive", "stage": 1}]}

A bad file is refused with the file, the line, the field and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError
from adaptipe.serial import atomic_write_text, read_text

__all__ = [
    "EVENT_KINDS",
    "TRACE_KIND",
    "TRACE_VERSION",
    "Trace",
    "TraceRow",
    "load_trace",
    "rows_from",
]

TRACE_KIND = "adaptipe-trace"
TRACE_VERSION = 1
EVENT_KINDS = ("arrive", "leave", "preempt", "bandwidth", "note")
DEVICE_SOURCES = ("cpu", "nvml")


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRow:
    """One iteration's conditions (see the module doc); ``inf`` bandwidth: unlimited."""

    slowdown: tuple[float, ...]
    bandwidth_Bps: tuple[float, ...]
    device: tuple[Mapping[str, float], ...] = ()
    events: tuple[Mapping[str, Any], ...] = ()

    def stall_s(self) -> float:
        """Seconds the pipeline stands still at this iteration (preemptions' restarts)."""
        return sum(float(e.get("stall_s", 0.0)) for e in self.events if e["kind"] == "preempt")


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """A whole trace: ``rows[i]`` is iteration ``i``."""

    stages: int
    family: str
    rows: tuple[TraceRow, ...]
    seed: int | None = None
    device_source: str = "cpu"
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_trace(self, "trace")

    @property
    def iterations(self) -> int:
        return len(self.rows)

    def slowdowns(self) -> npt.NDArray[np.float64]:
        """``(iterations, stages)`` slowdown factors."""
        return np.array([r.slowdown for r in self.rows], dtype=np.float64)

    def bandwidths(self) -> npt.NDArray[np.float64]:
        """``(iterations, stages - 1)`` link bandwidths in bytes/s (inf: unlimited)."""
        return np.array([r.bandwidth_Bps for r in self.rows], dtype=np.float64).reshape(
            len(self.rows), self.stages - 1
        )

    def header(self) -> dict[str, Any]:
        return {
            "kind": TRACE_KIND,
            "version": TRACE_VERSION,
            "stages": self.stages,
            "family": self.family,
            "seed": self.seed,
            "iterations": self.iterations,
            "device_source": self.device_source,
            "meta": dict(self.meta),
        }

    def lines(self) -> Iterator[str]:
        """The file's lines (without newlines): the header, then the rows."""
        yield json.dumps(self.header(), sort_keys=True)
        for i, row in enumerate(self.rows):
            yield json.dumps(
                {
                    "iteration": i,
                    "slowdown": list(row.slowdown),
                    "bandwidth_Bps": [b if math.isfinite(b) else None for b in row.bandwidth_Bps],
                    "device": [dict(d) for d in row.device],
                    "events": [dict(e) for e in row.events],
                },
                sort_keys=True,
            )

    def save(self, path: str | os.PathLike[str]) -> Path:
        atomic_write_text(path, "\n".join(self.lines()) + "\n")
        return Path(path)

    def digest(self) -> str:
        """sha256 of the file's text: what a manifest pins."""
        h = hashlib.sha256()
        for line in self.lines():
            h.update(line.encode() + b"\n")
        return h.hexdigest()


def load_trace(path: str | os.PathLike[str], *, stages: int | None = None) -> Trace:
    """Read and check a trace file; ``stages``: the stage count it must have."""
    p = Path(path)
    text = read_text(p)
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise PlanError(f"{p}: empty; a trace starts with a header line (kind {TRACE_KIND!r})")
    data = [_parse(line, f"{p}:{n}") for n, line in enumerate(lines, 1)]
    head, where = data[0], f"{p}:1"
    if not isinstance(head, dict) or head.get("kind") != TRACE_KIND:
        got = head.get("kind") if isinstance(head, dict) else type(head).__name__
        raise PlanError(f"{where}: kind must be {TRACE_KIND!r} (got {got!r}); is this a trace?")
    if head.get("version") != TRACE_VERSION:
        raise PlanError(
            f"{where}: version must be {TRACE_VERSION} (got {head.get('version')!r}); this "
            f"adaptipe reads trace version {TRACE_VERSION}"
        )
    count = _int(head, "stages", where, minimum=1)
    if stages is not None and count != stages:
        raise PlanError(f"{where}: stages must be {stages} for this pipeline (got {count})")
    declared = _int(head, "iterations", where, minimum=1)
    if len(data) - 1 != declared:
        raise PlanError(f"{where}: iterations says {declared}, the file has {len(data) - 1} rows")
    source = head.get("device_source", "cpu")
    if source not in DEVICE_SOURCES:
        raise PlanError(f"{where}: device_source must be one of cpu, nvml (got {source!r})")
    rows = tuple(_row(d, i, count, f"{p}:{i + 2}") for i, d in enumerate(data[1:]))
    seed = head.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise PlanError(f"{where}: seed must be an integer or null (got {seed!r})")
    family = head.get("family")
    if not isinstance(family, str) or not family:
        raise PlanError(f"{where}: family must be a non-empty string (got {family!r})")
    meta = head.get("meta", {})
    if not isinstance(meta, dict):
        raise PlanError(f"{where}: meta must be an object (got {type(meta).__name__})")
    return Trace(stages=count, family=family, rows=rows, seed=seed, device_source=source, meta=meta)


def _parse(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{where}: not valid JSON (column {exc.colno}: {exc.msg})") from None


def _int(data: Mapping[str, Any], key: str, where: str, *, minimum: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{where}: {key} must be an integer >= {minimum} (got {value!r})")
    return value


def _row(data: Any, index: int, stages: int, where: str) -> TraceRow:
    if not isinstance(data, dict):
        raise PlanError(f"{where}: a row must be an object (got {type(data).__name__})")
    got = data.get("iteration")
    if got != index:
        raise PlanError(
            f"{where}: iteration must be {index} (got {got!r}); rows are numbered from 0 "
            "without gaps"
        )
    try:
        row = TraceRow(
            slowdown=tuple(_numbers(data, "slowdown", where, stages, allow_null=False)),
            bandwidth_Bps=tuple(_numbers(data, "bandwidth_Bps", where, stages - 1)),
            device=tuple(_devices(data.get("device", []), where, stages)),
            events=tuple(_events(data.get("events", []), where, stages)),
        )
    except PlanError:  # a ValueError too, already saying where
        raise
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{where}: {exc}") from None
    _check_row(row, stages, where)
    return row


def _numbers(
    data: Mapping[str, Any], key: str, where: str, count: int, *, allow_null: bool = True
) -> list[float]:
    values = data.get(key)
    if not isinstance(values, list) or len(values) != count:
        raise PlanError(f"{where}: {key} must be a list of {count} numbers (one per "
                        f"{'stage' if key == 'slowdown' else 'link'}; got {values!r})")  # fmt: skip
    out = []
    for j, v in enumerate(values):
        if v is None and allow_null:
            out.append(math.inf)
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise PlanError(f"{where}: {key}[{j}] must be a number (got {v!r})")
        else:
            out.append(float(v))
    return out


def _devices(values: Any, where: str, stages: int) -> list[dict[str, float]]:
    if not isinstance(values, list) or len(values) not in (0, stages):
        raise PlanError(
            f"{where}: device must be [] or a list of {stages} objects (got {values!r})"
        )
    out = []
    for j, d in enumerate(values):
        if not isinstance(d, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in d.values()
        ):
            raise PlanError(f"{where}: device[{j}] must be an object of numbers (got {d!r})")
        out.append({str(k): float(v) for k, v in d.items()})
    return out


def _events(values: Any, where: str, stages: int) -> list[dict[str, Any]]:
    if not isinstance(values, list):
        raise PlanError(f"{where}: events must be a list (got {values!r})")
    for j, e in enumerate(values):
        if not isinstance(e, dict) or e.get("kind") not in EVENT_KINDS:
            raise PlanError(
                f"{where}: events[{j}].kind must be one of {', '.join(EVENT_KINDS)} (got "
                f"{e.get('kind') if isinstance(e, dict) else e!r})"
            )
    return [dict(e) for e in values]


def _check_row(row: TraceRow, stages: int, where: str) -> None:
    if len(row.slowdown) != stages:
        raise PlanError(f"{where}: slowdown must have {stages} entries (got {len(row.slowdown)})")
    if len(row.bandwidth_Bps) != stages - 1:
        raise PlanError(
            f"{where}: bandwidth_Bps must have {stages - 1} entries, one per link "
            f"(got {len(row.bandwidth_Bps)})"
        )
    for j, s in enumerate(row.slowdown):
        if not (math.isfinite(s) and s > 0):
            raise PlanError(f"{where}: slowdown[{j}] must be a finite number > 0 (got {s})")
    for j, b in enumerate(row.bandwidth_Bps):
        if not b > 0:
            raise PlanError(
                f"{where}: bandwidth_Bps[{j}] must be > 0 bytes/s, or null for unlimited (got {b})"
            )
    if row.device and len(row.device) != stages:
        raise PlanError(f"{where}: device must be empty or have {stages} entries")
    for j, e in enumerate(row.events):
        stage = e.get("stage")
        if stage is not None and (
            isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages
        ):
            raise PlanError(f"{where}: events[{j}].stage must be 0..{stages - 1} (got {stage!r})")
        stall = e.get("stall_s", 0.0)
        if isinstance(stall, bool) or not isinstance(stall, int | float) or not stall >= 0:
            raise PlanError(f"{where}: events[{j}].stall_s must be a number >= 0 (got {stall!r})")


def _check_trace(trace: Trace, where: str) -> None:
    if trace.stages < 1:
        raise PlanError(f"{where}: stages must be >= 1 (got {trace.stages})")
    if not trace.rows:
        raise PlanError(f"{where}: a trace needs at least one iteration")
    if trace.device_source not in DEVICE_SOURCES:
        raise PlanError(f"{where}: device_source must be one of cpu, nvml")
    for i, row in enumerate(trace.rows):
        _check_row(row, trace.stages, f"{where}: iteration {i}")


def rows_from(
    slowdown: Sequence[Sequence[float]], bandwidth_Bps: Sequence[Sequence[float]]
) -> tuple[TraceRow, ...]:
    """Rows from per-iteration slowdown and bandwidth tables (no device, no events)."""
    return tuple(
        TraceRow(slowdown=tuple(map(float, s)), bandwidth_Bps=tuple(map(float, b)))
        for s, b in zip(slowdown, bandwidth_Bps, strict=True)
    )
