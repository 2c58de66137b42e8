"""A trace from a real run: what the run's surroundings did, read from its telemetry.

`record_trace` reads a run directory's ``telemetry.jsonl`` (`adaptipe.monitor.runlog`)
and gives, for every iteration and stage:

- ``slowdown``: the forward and backward seconds the stage measured for the layers it
  held, per micro-batch (stages report each layer's sum over the iteration's
  micro-batches), over the same layers' baseline seconds. The baseline is the run's
  ``profile.json`` when it has one, else the per-layer median of quiet early iterations
  (`adaptipe.controllers.live.baseline`, as a live run measures it): those that ended
  before the first injection started, the first (warm-up) left out, at most 8. A stage
  that reports no per-layer times (interleaved chunks) compares its compute seconds
  with its quiet median instead.
- ``bandwidth_Bps`` per link ``s -> s + 1``: the smoothed ``bandwidth_Bps`` of the
  latest ``link_sample`` from ``s`` to ``s + 1`` (else ``s + 1`` to ``s``) at or before
  the iteration ended; unmeasured: unlimited.
- ``device``: the stage's latest ``device_sample`` fields at or before the iteration
  ended (its first one before it has any); empty when a stage sampled nothing.
- ``events``: injections starting and ending as ``note`` events (``what``:
  ``injection-start`` / ``injection-end``, with the injector's fields), at the first
  iteration that ended after them; a ``kill`` is a ``preempt`` whose ``stall_s`` is how
  much longer that iteration took than the median one.

Rows are numbered from 0 (``meta.first_iteration`` says which run iteration that is)
without gaps: a stage missing from an iteration takes its nearest reported iteration's
values (``meta.filled`` lists those iterations).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from adaptipe.envs.trace import Trace, TraceRow
from adaptipe.errors import PlanError
from adaptipe.monitor.runlog import load_run, skipped_note
from adaptipe.monitor.schema import DeviceSample, Event, LinkSample, StageStats
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile

__all__ = ["record_trace"]

_QUIET_MAX = 8  # baseline iterations, as a live run's window


def record_trace(run_dir: str | os.PathLike[str]) -> Trace:
    """The trace of the run in ``run_dir`` (see the module doc).

    Raises:
        PlanError: not a run directory, or its telemetry has no stage statistics.
    """
    from adaptipe.runtime.rundir import RunDir  # the runtime's config brings torch

    run = RunDir(Path(run_dir))
    log = load_run(run.root)
    cfg = run.read_config()
    workers, microbatches = cfg.pipeline.stages, cfg.data.microbatches
    stats = _latest_stats(log.records)
    if not stats:
        raise PlanError(f"{run.telemetry}: no stage_stats records (was telemetry on?)")
    events = sorted((r for r in log.records if isinstance(r, Event)), key=lambda e: e.time_s)
    starts = [e.time_s for e in events if e.kind == "injection-start"]
    first, last = min(it for it, _ in stats), max(it for it, _ in stats)
    iterations = list(range(first, last + 1))
    filled = _fill(stats, iterations, workers)
    ends = np.maximum.accumulate(
        [max(stats[it, s].time_s for s in range(workers)) for it in iterations]
    )
    quiet = _quiet(stats, iterations, workers, ends, min(starts, default=math.inf))
    profile, baseline = _baseline(run, log.records, quiet, workers, microbatches)
    slowdown = _slowdowns(stats, iterations, workers, profile, microbatches, quiet)
    device, source = _device(log.records, ends, workers)
    rows_events, late = _events(events, ends)
    links = _links(log.records, ends, workers)
    rows = tuple(
        TraceRow(
            slowdown=tuple(slowdown[k]),
            bandwidth_Bps=tuple(links[k]),
            device=device[k],
            events=tuple(rows_events[k]),
        )
        for k in range(len(iterations))
    )
    meta: dict[str, Any] = {
        "recorded_from": str(run.root),
        "first_iteration": first,
        "microbatches": microbatches,
        "baseline": baseline,
        "filled": filled,
    }
    if late:
        meta["events_after_end"] = late
    if note := skipped_note(log.skipped):
        meta["skipped"] = note
    return Trace(stages=workers, family="recorded", rows=rows, device_source=source, meta=meta)


def _latest_stats(records: Sequence[Any]) -> dict[tuple[int, int], StageStats]:
    """Per (iteration, stage), the latest report (a resumed run repeats iterations)."""
    out: dict[tuple[int, int], StageStats] = {}
    for r in records:
        if isinstance(r, StageStats):
            key = (r.iteration, r.stage)
            if key not in out or r.time_s >= out[key].time_s:
                out[key] = r
    return out


def _fill(
    stats: dict[tuple[int, int], StageStats], iterations: list[int], workers: int
) -> list[int]:
    """Give every (iteration, stage) a report: the nearest earlier one, else later."""
    filled: set[int] = set()
    for s in range(workers):
        have = [it for it in iterations if (it, s) in stats]
        if not have:
            raise PlanError(f"stage {s} reported no iteration; a trace needs every stage")
        for it in iterations:
            if (it, s) not in stats:
                earlier = [h for h in have if h < it]
                stats[it, s] = stats[earlier[-1] if earlier else have[0], s]
                filled.add(it)
    return sorted(filled)


def _quiet(
    stats: Mapping[tuple[int, int], StageStats],
    iterations: list[int],
    workers: int,
    ends: np.ndarray,
    first_injection: float,
) -> list[int]:
    """The baseline's iterations (see the module doc); every one when none is quiet."""
    quiet = [it for it, end in zip(iterations, ends, strict=True) if end < first_injection]
    quiet = quiet[1:] if len(quiet) > 1 else quiet
    return quiet[:_QUIET_MAX] if quiet else list(iterations)


def _baseline(
    run: Any, records: Sequence[Any], quiet: list[int], workers: int, microbatches: int
) -> tuple[Profile, str]:
    from adaptipe.controllers.live import baseline
    from adaptipe.serial import load_json_file

    if run.profile_json.exists():
        return load_json_file(run.profile_json, Profile.from_json), "profile.json"
    if run.partition_json.exists():
        planned = run.read_partition()
        layers, model = planned.num_layers, planned.model
    else:
        counted = [r for r in records if isinstance(r, StageStats)]
        layers, model = max(r.first_layer + len(r.forward_s) for r in counted), "model"
    chosen = set(quiet)
    picked = [r for r in records if isinstance(r, StageStats) and r.iteration in chosen]
    whole = Partition(model=model, num_layers=max(layers, 1), bounds=(0, max(layers, 1)))
    profile = baseline(picked, whole, window=len(quiet), workers=workers, microbatches=microbatches)
    return profile, f"measured: per-layer median of iterations {quiet[0]}-{quiet[-1]}"


def _slowdowns(
    stats: Mapping[tuple[int, int], StageStats],
    iterations: list[int],
    workers: int,
    profile: Profile,
    microbatches: int,
    quiet: list[int],
) -> list[list[float]]:
    base_layer = [layer.forward_s + layer.backward_s for layer in profile.layers]
    quiet_compute = [
        statistics.median(stats[it, s].compute_s for it in quiet) for s in range(workers)
    ]
    out = []
    for it in iterations:
        row = []
        for s in range(workers):
            r = stats[it, s]
            held = range(r.first_layer, r.first_layer + len(r.forward_s))
            base = sum(base_layer[i] for i in held if i < len(base_layer))
            if r.forward_s and base > 0:
                value = (sum(r.forward_s) + sum(r.backward_s)) / microbatches / base
            elif quiet_compute[s] > 0:
                value = r.compute_s / quiet_compute[s]
            else:
                value = 1.0
            row.append(max(round(value, 4), 1e-4))
        out.append(row)
    return out


def _links(records: Sequence[Any], ends: np.ndarray, workers: int) -> list[list[float]]:
    """Per iteration and link, the latest smoothed bandwidth (see the module doc)."""
    samples: dict[tuple[int, int], list[LinkSample]] = {}
    for r in records:
        if isinstance(r, LinkSample) and r.bandwidth_Bps > 0:
            samples.setdefault((r.src, r.dst), []).append(r)
    columns = []
    for j in range(workers - 1):
        seen = samples.get((j, j + 1)) or samples.get((j + 1, j)) or []
        seen.sort(key=lambda r: r.time_s)
        times = np.array([r.time_s for r in seen])
        at = np.searchsorted(times, ends, side="right") - 1
        columns.append([seen[k].bandwidth_Bps if k >= 0 else math.inf for k in at])
    return [list(col) for col in zip(*columns, strict=True)] if columns else [[] for _ in ends]


def _device(
    records: Sequence[Any], ends: np.ndarray, workers: int
) -> tuple[list[tuple[Mapping[str, float], ...]], str]:
    by_stage: dict[int, list[DeviceSample]] = {}
    for r in records:
        if isinstance(r, DeviceSample):
            by_stage.setdefault(r.stage, []).append(r)
    if any(not by_stage.get(s) for s in range(workers)):
        return [() for _ in ends], "cpu"
    picked = []
    for s in range(workers):
        seen = sorted(by_stage[s], key=lambda r: r.time_s)
        at = np.searchsorted([r.time_s for r in seen], ends, side="right") - 1
        picked.append([dict(seen[max(int(k), 0)].fields) for k in at])
    source = by_stage[0][0].source
    return [tuple(col[k] for col in picked) for k in range(len(ends))], source


def _events(events: Sequence[Event], ends: np.ndarray) -> tuple[list[list[dict[str, Any]]], int]:
    """Injection events on the rows they fall in; how many came after the last row."""
    rows: list[list[dict[str, Any]]] = [[] for _ in ends]
    gaps = np.diff(ends)
    typical = float(np.median(gaps)) if len(gaps) else 0.0
    late = 0
    for e in events:
        if not e.kind.startswith("injection-"):
            continue
        k = int(np.searchsorted(ends, e.time_s, side="left"))
        if k >= len(ends):
            late += 1
            continue
        injector = e.detail.get("injector")
        if injector == "kill":
            if e.kind == "injection-start":
                stall = float(gaps[k - 1]) - typical if k > 0 else 0.0
                rows[k].append(
                    {"kind": "preempt", "stage": e.stage, "stall_s": round(max(stall, 0.0), 3)}
                )
            continue
        note = {"kind": "note", "what": e.kind, "stage": e.stage}
        note |= {f: v for f, v in e.detail.items() if f not in ("stage", "pids")}
        rows[k].append(note)
    return rows, late
