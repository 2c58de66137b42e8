"""Job traces for the cluster simulation: JSON files of a cluster and its jobs, and a
generator in the manner of Gavel's simulated experiments (seed 002, §5.7).

A trace file::

    {"version": 1, "cluster": {"devices": [{"type": "k80", "count": 4,
     "price_per_hour": 0.45}, ...]}, "jobs": [{"name": "j0", "throughputs": {"k80": 1.0,
     "v100": 9.6}, "steps": 12000, "scale": 1, "arrival_s": 0, "slo_s": 7200}, ...]}

`generate` draws jobs with Poisson arrivals (``rate_per_hour``), model types uniformly
from Gavel's Table 6.1 (throughput on P100 and V100 relative to a K80 for Transformer,
A3C, CycleGAN, ResNet-18 and ResNet-50; the prices per hour are the GCP on-demand
ones that table's dollar-normalised column implies: 0.45, 1.46 and 2.48), a duration on
a V100 of 10**x minutes with x uniform in [1.5, 3] with probability 0.8 and in [3, 4]
otherwise (steps = duration x V100 throughput), and, with ``multi_worker``, 70% of jobs
on one worker, 25% on 2 to 4 and 5% on 8. SLOs, when asked for, are 1.2x, 2x or 10x the
job's V100 duration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from adaptipe.cluster.spec import Cluster, ClusterJob
from adaptipe.errors import PlanError

__all__ = ["MODELS", "PRICES", "Trace", "generate", "load_trace", "save_trace"]

VERSION = 1
# Table 6.1 (seed 002): throughput relative to a K80, as (P100, V100).
MODELS: dict[str, tuple[float, float]] = {
    "transformer": (3.3, 3.3),
    "a3c": (1.2, 2.2),
    "cyclegan": (4.5, 9.3),
    "resnet18": (4.0, 6.8),
    "resnet50": (3.7, 9.6),
}
PRICES = {"k80": 0.45, "p100": 1.46, "v100": 2.48}


class Trace:
    """A cluster and the jobs that arrive on it."""

    def __init__(self, cluster: Cluster, jobs: list[ClusterJob]) -> None:
        self.cluster, self.jobs = cluster, jobs

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "cluster": self.cluster.to_json(),
            "jobs": [job.to_json() for job in self.jobs],
        }


def load_trace(path: str | Path) -> Trace:
    """Read a trace file; errors name the file, the field and what is allowed."""
    source = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"{source}: cannot read a trace ({exc})") from None
    if not isinstance(data, dict):
        raise PlanError(f"{source}: a trace is a JSON object with version, cluster and jobs")
    extra = sorted(set(data) - {"version", "cluster", "jobs"})
    if extra:
        raise PlanError(f"{source}: unknown field {extra[0]!r} (allowed: version, cluster, jobs)")
    if data.get("version") != VERSION:
        raise PlanError(f"{source}: version must be {VERSION} (got {data.get('version')!r})")
    cluster = Cluster.from_json(data.get("cluster"), source=f"{source}: cluster")
    raw = data.get("jobs")
    if not isinstance(raw, list) or not raw:
        raise PlanError(f"{source}: jobs must be a non-empty list")
    jobs = [
        ClusterJob.from_json(job, source=f"{source}: jobs[{i}]", types=cluster.types)
        for i, job in enumerate(raw)
    ]
    names = [job.name for job in jobs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PlanError(f"{source}: jobs: name {twice[0]!r} is given twice")
    return Trace(cluster, jobs)


def save_trace(trace: Trace, path: str | Path) -> None:
    Path(path).write_text(json.dumps(trace.to_json(), indent=1) + "\n")


def generate(
    *,
    jobs: int,
    rate_per_hour: float | None,
    workers_per_type: int = 4,
    multi_worker: bool = False,
    slos: bool = False,
    seed: int = 0,
) -> Trace:
    """A trace of ``jobs`` jobs on K80, P100 and V100 workers (see the module doc);
    ``rate_per_hour=None`` puts every job at time 0 (a static trace)."""
    if jobs < 1:
        raise PlanError(f"jobs must be >= 1 (got {jobs})")
    rng = np.random.default_rng(seed)
    cluster = Cluster(
        types=tuple(PRICES),
        workers=(workers_per_type,) * 3,
        prices=tuple(PRICES.values()),
    )
    names = list(MODELS)
    now, out = 0.0, []
    for i in range(jobs):
        if rate_per_hour is not None and i > 0:
            now += float(rng.exponential(3600.0 / rate_per_hour))
        model = names[int(rng.integers(len(names)))]
        p100, v100 = MODELS[model]
        exponent = rng.uniform(1.5, 3.0) if rng.random() < 0.8 else rng.uniform(3.0, 4.0)
        minutes = 10.0**exponent
        scale = 1
        if multi_worker:
            draw = rng.random()
            scale = 1 if draw < 0.7 else int(rng.integers(2, 5)) if draw < 0.95 else 8
            scale = min(scale, workers_per_type)
        slo = float(rng.choice([1.2, 2.0, 10.0])) * minutes * 60.0 if slos else None
        out.append(
            ClusterJob(
                name=f"{model}-{i}",
                throughputs={"k80": 1.0, "p100": p100, "v100": v100},
                steps=round(minutes * 60.0 * v100, 3),
                scale=scale,
                arrival_s=round(now, 3),
                slo_s=None if slo is None else round(slo, 3),
            )
        )
    return Trace(cluster, out)
