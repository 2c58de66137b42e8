"""Real timelines: what each stage worker executed, and when, in traced iterations.

With ``[train] trace_iterations = N`` every worker records one `Event` per compute
instruction (forward, backward, recompute, optimizer step) of iterations
``trace_start .. trace_start + N - 1``, in the simulator's own event form, and writes
them to ``RUN_DIR/trace/stage-N.json``. Times are wall-clock seconds (``time.time``), so
stages on one host line up; `read_trace` merges the stages and starts the clock at the
first event. A gap on a worker's row is time it spent waiting (for a transfer, or for
its peer). `summarise` compares like for like with a simulated timeline: per worker
and kind, how many boxes and their total seconds, and the idle time between the
worker's first and last box. `compare` sets a traced run next to the simulator's
prediction from a profile (``adaptipe trace RUN_DIR --profile P.json``).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptipe.errors import PlanError
from adaptipe.serial import atomic_write_text, check_kind, get_int, get_list, read_json
from adaptipe.sim.result import Event, SimResult

if TYPE_CHECKING:
    from adaptipe.profile.types import Profile
    from adaptipe.runtime.rundir import RunDir

__all__ = ["TRACE_VERSION", "Comparison", "TraceRecorder", "compare", "read_trace", "summarise"]

TRACE_VERSION = 1


@dataclass(slots=True)
class TraceRecorder:
    """Collects one worker's events; times come in as ``time.perf_counter`` readings."""

    stage: int
    events: list[Event] = field(default_factory=list)
    # perf_counter is per-host monotonic; the offset makes it wall-clock at record time.
    _offset: float = field(default_factory=lambda: time.time() - time.perf_counter())

    def add(self, kind: str, job: int, microbatch: int, chunk: int, t0: float, t1: float) -> None:
        off = self._offset
        self.events.append(
            Event("worker", self.stage, -1, kind, job, microbatch, chunk, t0 + off, t1 + off)
        )

    def write(self, path: Path, *, iterations: tuple[int, int]) -> None:
        """Write the events (``iterations``: first and one-past-last traced) atomically."""
        data = {
            "kind": "trace",
            "version": TRACE_VERSION,
            "stage": self.stage,
            "iterations": list(iterations),
            "events": [e.to_json() for e in self.events],
        }
        atomic_write_text(path, json.dumps(data))


def read_trace(folder: Path) -> tuple[list[Event], tuple[int, int]]:
    """Every stage's events from ``folder`` (a run's ``trace/``), time 0 at the first.

    Returns the events sorted by start and the traced iterations ``(first, end)``.
    """
    files = sorted(folder.glob("stage-*.json"))
    if not files:
        raise PlanError(
            f"{folder}: no traces (train with [train] trace_iterations = N to record some)"
        )
    events: list[Event] = []
    spans: set[tuple[int, int]] = set()
    for path in files:
        data = read_json(path)
        source = str(path)
        check_kind(data, kind="trace", version=TRACE_VERSION, source=source)
        get_int(data, "stage", source=source, minimum=0)
        first, end = (int(v) for v in get_list(data, "iterations", source=source))
        spans.add((first, end))
        events += [Event.from_json(raw) for raw in get_list(data, "events", source=source)]
    if len(spans) != 1:
        raise PlanError(f"{folder}: the stages traced different iterations ({sorted(spans)})")
    if not events:
        raise PlanError(f"{folder}: the traces hold no events")
    t0 = min(e.start for e in events)
    shifted = [replace(e, start=e.start - t0, end=e.end - t0) for e in events]
    shifted.sort(key=lambda e: (e.start, e.worker))
    return shifted, spans.pop()


def summarise(events: list[Event], *, iterations: int = 1) -> dict[str, Any]:
    """Per worker, per kind: box count and seconds per iteration; idle per iteration.

    Works for real traces and simulated timelines alike, so the two can be compared.
    """
    per: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    spans: dict[int, tuple[float, float]] = {}
    for e in events:
        if e.where != "worker":
            continue
        per[e.worker][e.kind].append(e.duration)
        lo, hi = spans.get(e.worker, (e.start, e.end))
        spans[e.worker] = (min(lo, e.start), max(hi, e.end))
    out: dict[str, Any] = {}
    for w in sorted(per):
        busy = sum(sum(v) for v in per[w].values())
        lo, hi = spans[w]
        out[str(w)] = {
            "kinds": {
                k: {
                    "count": len(v) // iterations,
                    "seconds": sum(v) / iterations,
                    "mean_s": sum(v) / len(v),
                }
                for k, v in sorted(per[w].items())
            },
            "busy_s": busy / iterations,
            "idle_s": max(0.0, (hi - lo) - busy) / iterations,
        }
    return out


@dataclass(frozen=True, slots=True)
class Comparison:
    """A traced run against the simulator fed a profile: one iteration each."""

    measured_s: float  # median iteration time of the traced iterations (metrics.jsonl)
    predicted_s: float  # the simulated makespan
    real: dict[str, Any]  # `summarise` of the trace, per iteration
    simulated: dict[str, Any]  # `summarise` of the simulated timeline
    simulation: SimResult
    timeline: tuple[Event, ...]  # the traced events (`read_trace`)
    iterations: tuple[int, int]  # the traced iterations, first and one past the last

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def compare(
    run: RunDir,
    profile: Profile,
    *,
    latency_s: float = 0.0,
    bandwidth_Bps: float = math.inf,
) -> Comparison:
    """Simulate ``run``'s own schedule and partition with ``profile`` and set the result
    next to the run's trace (one job; job-arrays are planned from per-job profiles)."""
    from adaptipe.sim import CostModel, simulate

    events, (first, end) = read_trace(run.trace)
    config = run.read_config()
    if config.sweep is not None:
        raise PlanError(
            f"{run.root}: a job-array run; its prediction is the JAPSP makespan in "
            "japsp-solution.json, not a one-profile simulation"
        )
    schedule = run.read_schedule()
    costs = CostModel.from_profile(
        profile,
        run.read_partition(),
        latency_s=latency_s,
        bandwidth_Bps=bandwidth_Bps,
        batch_weight_grads=config.pipeline.batch_weight_grads,
        microbatches=schedule.num_microbatches,
    )
    result = simulate(schedule, costs, record=True)
    times = [r["iteration_s"] for r in run.read_metrics() if first <= r["iteration"] < end]
    if not times:
        raise PlanError(f"{run.root}: metrics.jsonl has no record of iterations {first}-{end - 1}")
    return Comparison(
        measured_s=statistics.median(times),
        predicted_s=result.makespan,
        real=summarise(events, iterations=end - first),
        simulated=summarise(list(result.timeline)),
        simulation=result,
        timeline=tuple(events),
        iterations=(first, end),
    )
