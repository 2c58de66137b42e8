"""What ``adaptipe train`` reports when a run ends: `TrainSummary`, written as summary.json.

Throughput is the steady state (start-up left out); a sweep's jobs are ranked by
validation loss, with when and why any of them stopped early.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.runtime.control import unadopted_stops
from adaptipe.runtime.metrics_merge import STAGE_FIELDS
from adaptipe.runtime.rundir import RunDir
from adaptipe.serial import finite

__all__ = ["LATE_STOP", "TrainSummary", "rank_jobs", "summarise"]

LATE_STOP = "the run ended before the next iteration boundary: trained to the end"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSummary:
    run_dir: str
    iterations: int
    start_iteration: int
    final_loss: float | None
    samples_per_s: float
    wall_s: float
    stages: list[dict[str, float]] = field(default_factory=list)
    checkpoint: str | None = None
    jobs: list[dict[str, Any]] = field(default_factory=list)  # sweeps: ranked by validation loss

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: a diverged loss (NaN, infinite) is null, not ``NaN``."""
        out: dict[str, Any] = finite(asdict(self))
        return out


def summarise(
    run: RunDir, merged: list[dict[str, Any]], *, start: int, wall: float
) -> TrainSummary:
    """The summary of one launch from its merged metrics records (`MetricsFollower`)."""
    # Steady-state throughput: skip the first iteration (start-up, warm caches), or the
    # first window of a job-array, whose records share its start-up evenly.
    first = int(merged[0].get("window", 1)) if merged else 1
    steady = merged[first:] if len(merged) > first else merged
    span = sum(r["iteration_s"] for r in steady)
    stages: list[dict[str, float]] = []
    if steady:
        for s in range(len(steady[0]["stages"])):
            rows = [r["stages"][s] for r in steady]
            stage = {k: sum(row[k] for row in rows) / len(rows) for k in STAGE_FIELDS}
            if all("resident_jobs" in row for row in rows):  # a job-array
                stage["resident_jobs"] = max(row["resident_jobs"] for row in rows)
                stage["state_wait_s"] = sum(row["state_wait_s"] for row in rows) / len(rows)
            stages.append(stage)
    last = ckpt.latest(run.checkpoints)
    return TrainSummary(
        run_dir=str(run.root),
        iterations=len(merged),
        start_iteration=start,
        final_loss=merged[-1]["loss"] if merged else None,
        samples_per_s=sum(r["samples"] for r in steady) / span if span > 0 else 0.0,
        wall_s=wall,
        stages=stages,
        checkpoint=str(last) if last else None,
    )


def rank_jobs(run: RunDir) -> list[dict[str, Any]]:
    """The sweep's jobs ranked by validation loss, with their last training loss and,
    for jobs stopped early, when and why.

    Read from the whole run (every launch of a resumed run): the metrics log and the
    workers' recorded switches. A stop committed but never adopted (it came in the last
    window) did not stop anything: such a job's row says so under ``stop_unadopted``.
    """
    from adaptipe.runtime.control import adoptions, read_active
    from adaptipe.runtime.export import evaluate_jobs

    last: dict[str, float] = {}
    for rec in run.read_metrics():  # in file order: a resumed run's records come last
        last.update(rec.get("losses") or {})
    switched = sorted(adoptions(run).items())
    stopped = read_active(run, switched[-1][0]).stopped if switched else {}
    # The iteration a stop took effect at: the first switch whose active set lacks the job.
    took_effect: dict[int, int] = {}
    for version, iteration in switched:
        jobs = read_active(run, version).jobs
        for job in stopped:
            if job not in jobs:
                took_effect.setdefault(job, iteration)
    late = unadopted_stops(run)
    rows = evaluate_jobs(run.root)
    for row in rows:
        row["train_loss"] = last.get(str(row["job"]))
        info = stopped.get(int(row["job"]))
        if info is not None:
            row["stopped"] = {**info, "iteration": took_effect.get(int(row["job"]))}
        elif int(row["job"]) in late:
            row["stop_unadopted"] = {**late[int(row["job"])], "why": LATE_STOP}
    return rows
