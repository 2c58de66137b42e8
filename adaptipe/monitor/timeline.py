"""Events on a run's time line: injections as spans; checkpoints, migrations, decisions
and memory warnings as points.

:func:`run_marks` pairs each ``injection-start`` event with its ``injection-end`` (same
origin, injector and stage) and places every mark both in seconds since the run's first
record and in iterations, using when each iteration ended. The report draws the marks on
its charts and lists them on its page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from adaptipe.monitor.runlog import RunLog, control_events
from adaptipe.monitor.schema import Event, StageStats

__all__ = ["Mark", "run_marks"]


@dataclass(frozen=True, slots=True)
class Mark:
    """An event on the run's time line: a span (injection) or a point (``end_s`` None).

    Times are seconds since the run's first record; ``start_it``/``end_it`` are the same
    moments in iterations (fractional), or None where no stage statistics say when.
    """

    kind: str
    label: str
    start_s: float | None
    end_s: float | None
    start_it: float | None
    end_it: float | None
    detail: str = ""

    @property
    def is_span(self) -> bool:
        return self.end_s is not None or self.end_it is not None


class _Clock:
    """Converts between wall time and iterations using when each iteration ended."""

    def __init__(self, stats: Sequence[StageStats], t0: float) -> None:
        ends: dict[int, float] = {}
        for s in stats:  # the latest report wins, so a resumed run's repeats use their retry
            ends[s.iteration] = max(ends.get(s.iteration, 0.0), s.time_s)
        pairs = sorted((t - t0, it) for it, t in ends.items())
        self.times = np.array([p[0] for p in pairs], dtype=float)
        self.iters = np.array([p[1] for p in pairs], dtype=float)

    def to_iter(self, t: float | None) -> float | None:
        if t is None or self.times.size < 2:
            return None
        # iteration k is drawn at x=k and spans (k-0.5, k+0.5); it ends at times[k]
        return float(np.interp(t, self.times, self.iters)) + 0.5

    def to_time(self, it: float | None) -> float | None:
        if it is None or self.times.size < 2:
            return None
        order = np.argsort(self.iters)
        return float(np.interp(it - 0.5, self.iters[order], self.times[order]))


def run_marks(log: RunLog, stats: Sequence[StageStats], t0: float, t_end: float) -> list[Mark]:
    """Injection start/end pairs become spans (matched by origin, injector and stage).

    ``t0`` is the run's first record's time and ``t_end`` its last one's, in seconds
    since ``t0``; ``stats`` say when each iteration ended.
    """
    clock = _Clock(stats, t0)
    marks: list[Mark] = []
    open_spans: dict[tuple[Any, ...], Event] = {}

    def detail(e: Event) -> str:
        where = "" if e.stage is None else f"stage {e.stage} "
        return where + " ".join(f"{k}={v}" for k, v in e.detail.items())

    def span(start: Event, end_s: float, note: str = "") -> Mark:
        s0 = start.time_s - t0
        label = _span_label(start)
        its = clock.to_iter(s0), clock.to_iter(end_s)
        return Mark("injection", label, s0, end_s, *its, detail(start) + note)

    control = control_events(log.root)
    # The manager also announces its decisions and migrations on the telemetry stream
    # (for `adaptipe monitor`); where control.jsonl has them they are drawn from there.
    logged = {"decision"} | (
        {"migration"} if any(c.get("event") == "migration" for c in control) else set()
    )
    for e in sorted((r for r in log.records if isinstance(r, Event)), key=lambda e: e.time_s):
        key = (e.detail.get("origin"), e.detail.get("injector"), e.stage)
        if e.kind == "injection-start":
            open_spans[key] = e
        elif e.kind == "injection-end" and key in open_spans:
            marks.append(span(open_spans.pop(key), e.time_s - t0))
        elif e.kind not in logged:
            s = e.time_s - t0
            marks.append(Mark(e.kind, e.kind, s, None, clock.to_iter(s), None, detail(e)))
    marks += [span(start, t_end, " (no end recorded)") for start in open_spans.values()]
    marks += _migration_marks(control, clock)
    marks += _decision_marks(control, clock)
    marks += _memory_marks(control, clock)
    if not any(m.kind == "checkpoint" for m in marks):  # fall back on the checkpoint folders
        for path in sorted((log.root / "checkpoints").glob("iter-*")):
            if (n := path.name.removeprefix("iter-")).isdigit():
                x = int(n) - 0.5  # iter-N holds the state after N iterations
                marks.append(
                    Mark("checkpoint", "checkpoint", clock.to_time(x), None, x, None, path.name)
                )
    return sorted(marks, key=lambda m: (m.start_it or 0.0, m.start_s or 0.0))


def _span_label(start: Event) -> str:
    """``cpu_hog injection``; a link shape says its host and shape (``link_shape host 2:
    20 mbit``), so each step of a ladder gets its own colour and legend entry."""
    injector = start.detail.get("injector", "injection")
    if "shape" in start.detail and "host" in start.detail:
        return f"{injector} host {start.detail['host']}: {start.detail['shape']}"
    return f"{injector} injection"


def _migration_marks(control: Sequence[dict[str, Any]], clock: _Clock) -> list[Mark]:
    """The run's layer migrations, at the boundary before the iteration they switched
    at; a failed one is labelled so."""
    out = []
    for event in control:
        try:
            if event.get("event") != "migration":
                continue
            x = float(event["iteration"]) - 0.5  # between iterations N-1 and N
            ok = bool(event["ok"])
            detail = (
                f"bounds={event['bounds']} bytes={event['bytes']} seconds={event['seconds']:.4f}"
                if ok
                else f"bounds={event['bounds']} kept the old partition: "
                + "; ".join(event.get("causes", []))
            )
        except (ValueError, KeyError, TypeError):
            continue  # a torn or foreign line
        label = "migration" if ok else "migration failed"
        out.append(Mark("migration", label, clock.to_time(x), None, x, None, detail))
    return out


def _decision_marks(control: Sequence[dict[str, Any]], clock: _Clock) -> list[Mark]:
    """The controller's decisions to move, at the end of the iteration they were taken
    after: acted on, or logged only (dry run)."""
    out = []
    for event in control:
        try:
            bounds = (event.get("decision") or {}).get("bounds")
            if event.get("event") != "decision" or bounds is None:
                continue
            x = float(event["iteration"]) + 0.5
            label = "decision" if event["acted"] else "decision (not acted on)"
            detail = f"{event['controller']}: to {bounds}; {event['decision'].get('reason', '')}"
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a torn or foreign line
        out.append(Mark("decision", label, clock.to_time(x), None, x, None, detail))
    return out


def _memory_marks(control: Sequence[dict[str, Any]], clock: _Clock) -> list[Mark]:
    """A stage's memory warnings (`adaptipe.runtime.memory_relief`), at the start of the
    iteration its guard read the memory before."""
    out = []
    for event in control:
        if event.get("event") != "memory_warning":
            continue
        try:
            x = float(event["iteration"]) - 0.5
            detail = (
                f"stage {event['stage']} {event['state']}: {float(event['used_mb']):.0f} of "
                f"{float(event['limit_mb']):.0f} MB ({float(event['slope_mb']):+.0f} MB/iteration)"
            )
        except (ValueError, KeyError, TypeError):
            continue  # a torn or foreign line
        out.append(Mark("memory", "memory warning", clock.to_time(x), None, x, None, detail))
    return out
