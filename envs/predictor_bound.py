"""How well any predictor could do on a trace family: the *state oracle*.

The state oracle knows everything about the present that the generator knows (the true
slowdown of every stage, which jobs are running, where, what each adds and how long
it has run; the bandwidth schedule, which is deterministic) but not the future: when
the running jobs leave and when new ones arrive. It draws ``samples`` futures of the
next K iterations from the family's own processes (`adaptipe.envs.generators`:
Poisson arrivals on a stage, exponential durations of at least ``min_duration_s``),
simulates the candidate on each (`iteration_times`), and predicts the value that
minimises the expected absolute relative error: the median of the sampled K-iteration
means weighted by their inverse. Its MAPE against what did happen is a floor for any
predictor that sees only the past: what is left is the arrivals and departures inside
the horizon.

Families without jobs (``bandwidth-steps``, ``preemption``: stalls are not in the
label) are known exactly by the oracle: MAPE 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from adaptipe.envs.generators import FAMILIES
from adaptipe.envs.trace import Trace
from adaptipe.errors import PlanError
from adaptipe.sim.conditions import LayerCosts, iteration_times

__all__ = ["JobProcess", "oracle_mape", "process_of"]

Array = npt.NDArray[np.float64]
_LEVELS = {"poisson-light": 1.0, "poisson-heavy": 3.0}


@dataclass(frozen=True, slots=True)
class JobProcess:
    """A family's job arrivals in iterations (``iteration_s`` folded in)."""

    family: str  # the component whose jobs these are (a mixture's events name it)
    rate: float  # arrivals per iteration, per stage when ``per_stage``
    per_stage: bool
    mean: float  # duration, iterations
    minimum: float
    extras: tuple[float, ...] | None  # drawn uniformly from these (Poisson ratios - 1)
    extra_range: tuple[float, float]  # else uniformly from this range


def process_of(family: str, params: Mapping[str, object] | None = None) -> JobProcess | None:
    """The job process of a family at its default parameters (None: it has no jobs)."""
    if family == "mixture":
        of = (params or {}).get("of", FAMILIES["mixture"].defaults()["of"])
        found = [process_of(str(name)) for name in of]  # type: ignore[attr-defined]
        jobs = [p for p in found if p is not None]
        if len(jobs) > 1:
            raise PlanError("state oracle: a mixture of two job families is not supported")
        return jobs[0] if jobs else None
    if family not in ("colocated", *_LEVELS):
        return None
    d = FAMILIES[family].defaults()
    it = float(d["iteration_s"])
    if family == "colocated":
        return JobProcess(
            family=family,
            rate=float(d["rate_per_min"]) / 60 * it,
            per_stage=True,
            mean=float(d["mean_duration_s"]) / it,
            minimum=float(d["min_duration_s"]) / it,
            extras=None,
            extra_range=(float(d["extra_min"]), float(d["extra_max"])),
        )
    return JobProcess(
        family=family,
        rate=float(d["rate_per_min"]) * _LEVELS[family] / 60 * it,
        per_stage=False,
        mean=float(d["mean_duration_s"]) / it,
        minimum=float(d["min_duration_s"]) / it,
        extras=tuple(float(r) - 1.0 for r in d["ratios"]),
        extra_range=(0.0, 0.0),
    )


def _running(trace: Trace, now: int, family: str) -> list[tuple[int, float, int]]:
    """The jobs of ``family`` running at row ``now``: (stage, adds, start row)."""
    jobs: dict[int, tuple[int, float, int]] = {}
    for i in range(now + 1):
        for e in trace.rows[i].events:
            if e.get("family", family) != family:
                continue
            if e["kind"] == "arrive":
                jobs[int(e["job"])] = (int(e["stage"]), float(e["adds"]), i)
            elif e["kind"] == "leave":
                jobs.pop(int(e["job"]), None)
    return list(jobs.values())


def _futures(
    proc: JobProcess,
    running: Sequence[tuple[int, float, int]],
    now: int,
    stages: int,
    k: int,
    samples: int,
    rng: np.random.Generator,
) -> Array:
    """``samples`` futures of the next ``k`` rows' job slowdowns: ``[samples, k, stages]``
    (1 + what the jobs add)."""
    out = np.ones((samples, k, stages))
    rows = now + 1 + np.arange(k)
    for stage, adds, start in running:
        age = now - start  # it lasts more than ``age`` rows
        draw = np.maximum(rng.exponential(proc.mean, samples), proc.minimum)
        if proc.minimum <= age:  # it outlived the minimum: memoryless from here
            draw = age + rng.exponential(proc.mean, samples)
        end = start + np.maximum(1, np.ceil(draw))
        out[:, :, stage] += adds * (rows[None, :] < end[:, None])
    rate = proc.rate * (stages if proc.per_stage else 1)
    count = rng.poisson(rate * k, samples)
    n = int(count.sum())
    who = np.repeat(np.arange(samples), count)  # each new job's future
    begin = (now + 1 + rng.uniform(0, k, n)).astype(np.int64)
    where = rng.integers(0, stages, n)
    if proc.extras is not None:
        extra = rng.choice(np.asarray(proc.extras), n)
    else:
        extra = rng.uniform(*proc.extra_range, n)
    lasts = np.maximum(rng.exponential(proc.mean, n), proc.minimum)
    end_new = begin + np.maximum(1, np.ceil(lasts))
    on = (rows[None, :] >= begin[:, None]) & (rows[None, :] < end_new[:, None])  # [n, k]
    for j in range(k):
        np.add.at(out[:, j, :], (who, where), extra * on[:, j])
    return out


def _weighted_median(values: Array) -> float:
    """argmin_p sum |p / v - 1|: the median of ``values`` weighted by ``1 / v``."""
    order = np.sort(values)
    weights = 1.0 / order
    cum = np.cumsum(weights)
    return float(order[np.searchsorted(cum, cum[-1] / 2)])


def oracle_mape(
    traces: Mapping[tuple[str, int], Trace],
    costs: LayerCosts,
    *,
    family: Sequence[str],
    trace_seed: Sequence[int],
    first: Sequence[int],
    bounds: Sequence[tuple[int, ...]],
    true_s: Sequence[float],
    k: int,
    samples: int = 256,
    seed: int = 0,
) -> float:
    """The state oracle's MAPE on the samples ``(family, trace_seed, first, bounds) ->
    true_s`` (a `Dataset`'s columns; ``traces`` by family and seed)."""
    rng = np.random.default_rng(seed)
    errors = []
    for name, seed_n, row, cand, true in zip(
        family, trace_seed, first, bounds, true_s, strict=True
    ):
        trace = traces[name, seed_n]
        proc = process_of(trace.family, trace.meta.get("params"))
        if proc is None:
            errors.append(0.0)  # the oracle knows the whole window
            continue
        now = row - 1
        base = trace.slowdowns()[now] / _job_slowdown(trace, now, proc.family)
        slow = _futures(proc, _running(trace, now, proc.family), now, trace.stages, k, samples, rng)
        slow = slow * base  # the other components' factors (1 for the job families)
        bws = np.tile(trace.bandwidths()[row : row + k], (samples, 1))
        times = iteration_times(costs, cand, slow.reshape(-1, trace.stages), bws)
        guess = _weighted_median(times.reshape(samples, k).mean(axis=1))
        errors.append(abs(guess / true - 1))
    return float(np.mean(errors)) if errors else float("nan")


def _job_slowdown(trace: Trace, now: int, family: str) -> Array:
    out = np.ones(trace.stages)
    for stage, adds, _ in _running(trace, now, family):
        out[stage] += adds
    return out
