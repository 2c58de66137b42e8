"""The speed predictor on recorded runs: predictions against what a real run measured.

A real run trains one partition, so only that partition has a true answer: at every
iteration ``i`` after the first window (and after the baseline's iterations) the
observation is built from the telemetry up to ``i - 1`` (`observe`, as the manager
builds it live) and the label is the mean measured seconds per iteration (the stages'
mean ``iteration_s``) of iterations ``i .. i + K - 1``.

The observation's profile is the one a live run without a profile measures
(`adaptipe.controllers.live.baseline`, bytes from `layer_sizes`): per layer the median
of the run's quiet early iterations (those that ended before the first injection
started, the first left out, at most 8), as `adaptipe.envs.record` takes its baseline.

Beside the predictor, on the same samples: the analytical model (the simulator fed the
window's median slowdowns), ``latest`` (fed the last iteration's), and ``previous``:
the mean of the K iterations before ``i``. On a run without interference ``previous``
is the noise floor (each K-iteration mean predicted by the previous one).

`compact_run` copies a run directory's config, partition and the telemetry this
needs (stage statistics and events; device samples on request), with
times rounded, into a folder small enough to keep as a fixture.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adaptipe.controllers.observation import Observation, observe
from adaptipe.controllers.predictor import Predictor, encode
from adaptipe.errors import PlanError
from adaptipe.monitor.schema import DeviceSample, Event, Record, StageStats

__all__ = [
    "RecordedSample",
    "compact_run",
    "online_report",
    "recorded_report",
    "recorded_samples",
]

_QUIET_MAX = 8


@dataclass(frozen=True, slots=True)
class RecordedSample:
    """One decision point of a real run."""

    obs: Observation
    true_s: float  # the mean measured seconds per iteration of the next K iterations
    previous_s: float  # of the K iterations before


def _stats(records: Sequence[Record]) -> dict[int, dict[int, StageStats]]:
    out: dict[int, dict[int, StageStats]] = {}
    for r in records:
        if isinstance(r, StageStats):
            got = out.setdefault(r.iteration, {})
            if r.stage not in got or r.time_s >= got[r.stage].time_s:
                got[r.stage] = r
    return out


def recorded_samples(
    run_dir: str | os.PathLike[str], *, window: int = 8, horizon: int = 10
) -> tuple[list[RecordedSample], dict[str, Any]]:
    """The decision points of the run in ``run_dir`` (see the module doc), and what was
    read: iterations, the baseline's iterations, injections started."""
    from adaptipe.controllers.live import baseline, layer_sizes
    from adaptipe.monitor.runlog import load_run
    from adaptipe.runtime.rundir import RunDir

    run = RunDir(Path(run_dir))
    log = load_run(run.root)
    cfg = run.read_config()
    partition = run.read_partition()
    workers, microbatches = cfg.pipeline.stages, cfg.data.microbatches
    stats = _stats(log.records)
    complete = sorted(it for it, got in stats.items() if len(got) >= workers)
    if len(complete) < 2 + window + horizon:
        raise PlanError(f"{run.root}: {len(complete)} complete iterations; too few to evaluate")
    if any(b != a + 1 for a, b in itertools.pairwise(complete)):
        raise PlanError(f"{run.root}: iterations missing from the telemetry")
    starts = sorted(
        r.time_s for r in log.records if isinstance(r, Event) and r.kind == "injection-start"
    )
    first_start = starts[0] if starts else math.inf
    ended = {it: max(s.time_s for s in stats[it].values()) for it in complete}
    quiet = [it for it in complete[1:] if ended[it] < first_start][:_QUIET_MAX]
    if not quiet:
        raise PlanError(f"{run.root}: no quiet iteration before the first injection")
    picked = [stats[it][s] for it in quiet for s in range(workers)]
    profile = baseline(
        picked,
        partition,
        window=len(quiet),
        workers=workers,
        sizes=layer_sizes(cfg),
        microbatches=microbatches,
    )
    seconds = {it: float(np.mean([s.iteration_s for s in stats[it].values()])) for it in complete}
    # records in time order; the observation at i sees what ended before iteration i
    ordered = sorted(log.records, key=lambda r: getattr(r, "time_s", 0.0))
    out = []
    start = max(quiet[-1] + 1, complete[0] + max(window, horizon))
    for i in range(start, complete[-1] - horizon + 2):
        cut = ended[i - 1]
        seen = [
            r
            for r in ordered
            if (isinstance(r, StageStats) and r.iteration < i)
            or (isinstance(r, DeviceSample) and r.time_s <= cut)
        ]
        obs = observe(
            seen, profile, partition, window=window, workers=workers, microbatches=microbatches
        )
        out.append(
            RecordedSample(
                obs=obs,
                true_s=float(np.mean([seconds[j] for j in range(i, i + horizon)])),
                previous_s=float(np.mean([seconds[j] for j in range(i - horizon, i)])),
            )
        )
    meta = {
        "iterations": len(complete),
        "baseline": [quiet[0], quiet[-1]],
        "injections": len(starts),
        "mean_iteration_s": round(float(np.mean(list(seconds.values()))), 4),
    }
    return out, meta


def recorded_report(
    predictor: Predictor, run_dirs: Sequence[str | os.PathLike[str]]
) -> dict[str, dict[str, Any]]:
    """Per run: the MAPE of the predictor, the analytical model, ``latest`` and
    ``previous`` (see the module doc) over its decision points."""
    out = {}
    for run_dir in run_dirs:
        samples, meta = recorded_samples(
            run_dir, window=predictor.config.window, horizon=predictor.config.horizon
        )
        true = np.asarray([s.true_s for s in samples])
        pred, analytical, latest = [], [], []
        for s in samples:
            enc = encode(s.obs, [s.obs.bounds], predictor.config)
            analytical.append(float(enc.analytical_s[0]))
            latest.append(float(enc.latest_s[0]))
            pred.append(predictor.predict(s.obs, [s.obs.bounds])[0])

        guesses = {
            "predictor": pred,
            "analytical": analytical,
            "latest": latest,
            "previous": [s.previous_s for s in samples],
        }
        out[Path(run_dir).name] = (
            meta
            | {"samples": len(samples)}
            | {
                name: round(float(np.mean(np.abs(np.asarray(g) / true - 1))), 5)
                for name, g in guesses.items()
            }
        )
    return out


def online_report(
    predictor_path: str | Path | None,
    run_dirs: Sequence[str | os.PathLike[str]],
    *,
    every: int = 4,
    settings: Any = None,
) -> dict[str, dict[str, Any]]:
    """Online fine-tuning (`adaptipe.controllers.online`) on recorded runs, per run: a
    decision every ``every`` iterations of its first half feeds the tuner as the live
    chain would (the partition in force, labelled by later windows; rounds in the
    caller); then the MAPE of the shipped and the adapted network on the second half,
    and the tuner's own running scores over the first (``prequential_*``: each label
    against the prediction made when it was a decision)."""
    from adaptipe.controllers.online import OnlineSettings, OnlineTuner
    from adaptipe.controllers.predictor import load_predictor

    chosen = settings if settings is not None else OnlineSettings(background=False)
    out = {}
    for run_dir in run_dirs:
        samples, _ = recorded_samples(run_dir)
        predictor, shipped = load_predictor(predictor_path), load_predictor(predictor_path)
        tuner = OnlineTuner(predictor, chosen)
        half = len(samples) // 2
        for s in samples[:half:every]:
            obs = s.obs
            times = {
                it: float(np.mean(row))
                for it, row in zip(obs.iterations, obs.stage_iteration_s, strict=True)
            }
            seconds, enc = predictor.predict_encoded(obs, [obs.bounds])
            tuner.observed(obs, enc, seconds, [obs.bounds], times)
        tuner.wait()
        summary = tuner.summary()
        out[Path(run_dir).name] = {
            "samples": len(samples),
            "tuned_on": summary["samples"],
            "rounds": summary["rounds"],
            "cpu_s": summary["cpu_s"],
            "prequential_in_service": summary.get("mape_in_service"),
            "prequential_shipped": summary.get("mape_shipped"),
            "shipped": _mape(shipped, samples[half:]),
            "adapted": _mape(predictor, samples[half:]),
        }
    return out


def _mape(predictor: Predictor, samples: Sequence[RecordedSample]) -> float:
    guess = np.asarray([predictor.predict(s.obs, [s.obs.bounds])[0] for s in samples])
    true = np.asarray([s.true_s for s in samples])
    return round(float(np.mean(np.abs(guess / true - 1))), 5)


def _rounded(value: Any, digits: int) -> Any:
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    return value


_DEFAULTS = ("in_flight", "memory_allocated_bytes", "memory_reserved_bytes", "loss")
_DEFAULTS_TOO = ("resident_jobs", "state_wait_s", "plan_version")


def compact_run(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    digits: int = 4,
    device: bool = False,
) -> Path:
    """A copy of the run in ``run_dir`` that `recorded_samples` reads the same way, into
    ``out``: ``config.json``, ``partition.json`` and ``telemetry.jsonl`` with every stage
    statistic (seconds to ``digits`` significant digits, time stamps to the millisecond,
    the fields the predictor does not read left at their defaults), the events, and
    with ``device`` each stage's latest device sample before each of its statistics."""
    src, dst = Path(run_dir), Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "partition.json"):
        (dst / name).write_text((src / name).read_text())
    kept, latest = [], {}
    for line in (src / "telemetry.jsonl").read_text().splitlines():
        rec = json.loads(line)
        kind = rec.get("type")
        if kind == "device_sample":
            latest[rec["stage"]] = rec
            continue
        if kind == "stage_stats":
            if device and (dev := latest.pop(rec["stage"], None)) is not None:
                kept.append(dev | {"fields": _rounded(dev["fields"], digits)})
            rec = {k: v for k, v in rec.items() if k not in _DEFAULTS + _DEFAULTS_TOO}
            rec = _rounded(rec, digits)
        elif kind != "event":
            continue
        kept.append(rec | {"time_s": round(json.loads(line)["time_s"], 3)})
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept)
    (dst / "telemetry.jsonl").write_text(text)
    return dst
