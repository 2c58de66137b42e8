"""Gavel's scheduling policies as linear programs over the allocation X (seed 002, §5.3-5.4,
§6.4), solved with SciPy's HiGHS (`scipy.optimize.linprog`).

``X[m, j]`` is the fraction of time job m spends on device type j; its effective
throughput is ``sum_j T[m, j] * X[m, j]``. Every policy keeps ``0 <= X <= 1``, at most
all of a job's time (``sum_j X[m, j] <= 1``), no type oversubscribed
(``sum_m X[m, j] * scale_m <= workers_j``) and no time where a job cannot run (T = 0).

- ``max_min_fairness`` (LAS): maximise the minimum over jobs of
  ``throughput(m, X) / throughput(m, X_equal) * scale_m / w_m``, where ``X_equal`` gives
  a job each type in proportion to its workers; then, keeping every job at that floor,
  maximise the sum (a cheap step toward Gavel's water filling, so time nobody needs for
  the minimum is not left idle).
- ``min_makespan``: minimise ``max_m steps_m / throughput(m, X)`` (as: maximise z with
  ``throughput(m, X) >= steps_m * z``).
- ``fifo``: maximise ``sum_m throughput(m, X) / throughput(m, X_fastest) * (M - m)``,
  jobs in arrival order.
- ``min_cost``: maximise ``sum_m sum_j X[m, j] * T[m, j] / price_j`` (steps per dollar,
  Gavel's form), optionally with SLOs: ``throughput(m, X) >= steps_m / slo_m``.

Each policy has a heterogeneity-agnostic form (``aware=False``): the same program on a
throughput matrix whose rows are each job's mean over the types, so it knows how fast a
job is but not on which device; its allocation is then judged with the true matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from scipy.optimize import linprog
from scipy.sparse import csr_array, hstack, vstack

from adaptipe.cluster.spec import Cluster, ClusterJob, throughput_matrix
from adaptipe.errors import PlanError

__all__ = ["POLICIES", "Allocation", "allocate", "effective_throughput", "objective"]

Policy = Literal["max_min_fairness", "min_makespan", "fifo", "min_cost"]
POLICIES: tuple[Policy, ...] = ("max_min_fairness", "min_makespan", "fifo", "min_cost")
Array = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Allocation:
    """The time fractions ``x[m, j]`` and the objective value the policy reached."""

    x: Array
    objective: float
    policy: str
    aware: bool


def effective_throughput(t: Array, x: Array) -> Array:
    return np.asarray((t * x).sum(axis=1), dtype=np.float64)


def _base(
    t: Array, scale: Array, workers: Array
) -> tuple[csr_array, Array, list[tuple[float, float]]]:
    """The validity constraints on X (flattened row-major) and its bounds."""
    m, j = t.shape
    rows = csr_array(np.kron(np.eye(m), np.ones((1, j))))  # sum_j X[m, j] <= 1
    cols = csr_array(np.kron(scale.reshape(1, m), np.eye(j)))  # sum_m X[m, j] s_m <= n_j
    a = vstack([rows, cols]).tocsr()
    b = np.concatenate([np.ones(m), workers])
    bounds = [(0.0, 1.0 if t[i, k] > 0 else 0.0) for i in range(m) for k in range(j)]
    return a, b, bounds


def _with_z(a: csr_array, m: int, j: int) -> csr_array:
    return hstack([a, csr_array((a.shape[0], 1))]).tocsr()


def _tput_rows(t: Array, coef: Array) -> csr_array:
    """Row m: ``coef[m] * T[m, :]`` on job m's variables."""
    m, j = t.shape
    data = (t * coef.reshape(m, 1)).ravel()
    return csr_array((data, (np.repeat(np.arange(m), j), np.arange(m * j))), shape=(m, m * j))


def _solve(
    c: Array, a: csr_array, b: Array, bounds: Sequence[tuple[float, float | None]], what: str
) -> Array:
    res = linprog(c, A_ub=a, b_ub=b, bounds=bounds, method="highs")
    if res.status != 0:
        raise PlanError(f"{what}: the linear program has no solution ({res.message})")
    return np.asarray(res.x, dtype=np.float64)


def _max_z(
    t: Array, coef: Array, offset: Array, scale: Array, workers: Array, what: str
) -> tuple[Array, float]:
    """Maximise z subject to ``coef_m * throughput(m, X) >= offset_m * z`` for all m
    (``offset = 1``: a max-min)."""
    m, j = t.shape
    a, b, bounds = _base(t, scale, workers)
    floor = hstack([-_tput_rows(t, coef), csr_array(offset.reshape(m, 1))]).tocsr()
    a_z = vstack([_with_z(a, m, j), floor]).tocsr()
    b_z = np.concatenate([b, np.zeros(m)])
    c = np.zeros(m * j + 1)
    c[-1] = -1.0
    sol = _solve(c, a_z, b_z, [*bounds, (0.0, None)], what)
    return sol[:-1].reshape(m, j), float(sol[-1])


def _max_sum(
    t: Array,
    weights: Array,
    scale: Array,
    workers: Array,
    what: str,
    *,
    floor: tuple[Array, Array] | None = None,
) -> Array:
    """Maximise ``sum_m weights[m, :] . X[m, :]``, optionally keeping
    ``throughput(m, X) * coef_m >= level`` (``floor = (coef, level)``)."""
    m, j = t.shape
    a, b, bounds = _base(t, scale, workers)
    if floor is not None:
        coef, level = floor
        a = vstack([a, -_tput_rows(t, coef)]).tocsr()
        b = np.concatenate([b, -level])
    sol = _solve(-weights.ravel(), a, b, bounds, what)
    return sol.reshape(m, j)


def allocate(
    jobs: Sequence[ClusterJob],
    cluster: Cluster,
    *,
    policy: Policy,
    aware: bool = True,
    remaining: Sequence[float] | None = None,
    slo_left_s: Sequence[float | None] | None = None,
) -> Allocation:
    """The allocation ``policy`` gives ``jobs`` (in arrival order) on ``cluster``.

    ``remaining``: steps still to run per job (default: all of ``steps``);
    ``slo_left_s``: seconds left before each job's SLO (``min_cost`` only)."""
    if policy not in POLICIES:
        raise PlanError(f"unknown policy {policy!r} (allowed: {', '.join(POLICIES)})")
    if not jobs:
        return Allocation(np.zeros((0, len(cluster.types))), 0.0, policy, aware)
    true_t = throughput_matrix(jobs, cluster)
    t = true_t if aware else _agnostic(true_t)
    m, _ = t.shape
    scale = np.array([job.scale for job in jobs], dtype=np.float64)
    workers = np.array(cluster.workers, dtype=np.float64)
    steps = np.array(
        remaining if remaining is not None else [j.steps for j in jobs], dtype=np.float64
    )
    what = f"{policy} ({'aware' if aware else 'agnostic'})"
    coef = _fair_coef(t, jobs, scale, workers)
    if policy == "max_min_fairness":
        x, z = _max_z(t, coef, np.ones(m), scale, workers, what)
        level = np.full(m, z * (1 - 1e-9))
        x = _max_sum(t, t * coef.reshape(m, 1), scale, workers, what, floor=(coef, level))
    elif policy == "min_makespan":
        x, _ = _max_z(t, np.ones(m), steps, scale, workers, what)
    elif policy == "fifo":
        weights = t * (_fifo_order(m) / np.maximum(t.max(axis=1), 1e-12)).reshape(m, 1)
        x = _max_sum(t, weights, scale, workers, what)
    else:
        x = _min_cost(t, jobs, cluster, scale, workers, steps, slo_left_s, what)
    x = np.clip(x, 0.0, 1.0)
    if not aware:
        x = _spread(x, true_t, scale, workers)
    return Allocation(
        x, objective(policy, true_t, x, jobs, cluster, remaining=steps), policy, aware
    )


def objective(
    policy: Policy,
    t: Array,
    x: Array,
    jobs: Sequence[ClusterJob],
    cluster: Cluster,
    *,
    remaining: Array | None = None,
) -> float:
    """The value of ``policy``'s objective for allocation ``x`` under throughputs ``t``:
    the minimum normalised throughput (max_min_fairness, higher is better), the makespan
    in seconds (min_makespan, lower), the arrival-weighted speed (fifo, higher), the
    steps per dollar-hour (min_cost, higher)."""
    tput = effective_throughput(t, x)
    if policy == "max_min_fairness":
        scale = np.array([job.scale for job in jobs], dtype=np.float64)
        workers = np.array(cluster.workers, dtype=np.float64)
        return float(np.min(tput * _fair_coef(t, jobs, scale, workers)))
    if policy == "min_makespan":
        steps = remaining if remaining is not None else np.array([j.steps for j in jobs])
        return float(np.max(steps / np.maximum(tput, 1e-300)))
    if policy == "fifo":
        return float(np.sum(tput / t.max(axis=1) * _fifo_order(len(jobs))))
    return float(np.sum(t * x / _prices(cluster)))


def _fair_coef(t: Array, jobs: Sequence[ClusterJob], scale: Array, workers: Array) -> Array:
    """``scale_m / (w_m * throughput(m, X_equal))``: LAS's normalisation."""
    share = workers / max(workers.sum(), 1.0)
    equal = np.maximum((t * share).sum(axis=1), 1e-12)
    return np.asarray(scale / np.array([job.weight for job in jobs]) / equal, dtype=np.float64)


def _fifo_order(m: int) -> Array:
    return (m - np.arange(m)).astype(np.float64)


def _spread(x: Array, t: Array, scale: Array, workers: Array) -> Array:
    """An agnostic scheduler's placement: each job's total time spread over the types
    it can run on in proportion to their workers (it takes whatever device is free),
    kept where that would oversubscribe a type."""
    runs = (t > 0).astype(np.float64) * workers.reshape(1, -1)
    share = runs / np.maximum(runs.sum(axis=1, keepdims=True), 1e-12)
    spread = x.sum(axis=1, keepdims=True) * share
    if np.all(spread.T @ scale <= workers * (1 + 1e-9)):
        return np.asarray(spread, dtype=np.float64)
    return x


def _prices(cluster: Cluster) -> Array:
    if cluster.prices is None:
        raise PlanError("min_cost needs a price_per_hour for every device type")
    return np.maximum(np.array(cluster.prices, dtype=np.float64), 1e-12).reshape(1, -1)


def _min_cost(
    t: Array,
    jobs: Sequence[ClusterJob],
    cluster: Cluster,
    scale: Array,
    workers: Array,
    steps: Array,
    slo_left_s: Sequence[float | None] | None,
    what: str,
) -> Array:
    weights = t / _prices(cluster)
    left = list(slo_left_s) if slo_left_s is not None else [job.slo_s for job in jobs]
    # An SLO already missed constrains nothing more: the job competes on cost alone.
    need = np.array(
        [s / d if d is not None and d > 0 else 0.0 for s, d in zip(steps, left, strict=True)]
    )
    if not need.any():
        return _max_sum(t, weights, scale, workers, what)
    m = len(jobs)
    # Meet as much of every SLO as the cluster allows: the largest common fraction first.
    _, z = _max_z(t, np.ones(m), need, scale, workers, what)
    level = need * min(z, 1.0) * (1 - 1e-9)
    return _max_sum(t, weights, scale, workers, what, floor=(np.ones(m), level))


def _agnostic(t: Array) -> Array:
    """Each job's mean throughput over the types it can run on, on every such type."""
    runs = t > 0
    mean = np.where(runs.any(axis=1), t.sum(axis=1) / np.maximum(runs.sum(axis=1), 1), 0.0)
    return np.where(runs, mean.reshape(-1, 1), 0.0)
