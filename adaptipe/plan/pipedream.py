"""PipeDream's topology-aware partitioner (Narayanan's dissertation, §2.4.1).

`plan_pipedream` is the hierarchical dynamic programme: level k of the topology has
m_k components of level k-1 joined by links of bandwidth B_k, and for k = 1..L

    T^k(i->j, m) = (1/m) max(A^{k-1}(i->j, m_{k-1}), 2 (m-1) sum_l |w_l| / B_k)
    A^k(i->j, m) = min( T^k(i->j, m),
                        min_{i<=s<j} min_{1<=m'<m} max(A^k(i->s, m-m'), 2 a_s / B_k,
                                                        T^k(s+1->j, m')) )

with A^0(i->j, 1) = sum_l T_l. The dissertation writes A^k(i->j, m) as the split term
and initialises A^k(i->j, 1) = T^k(i->j, 1); we also let a single stage take all m
components (the T^k term), since pure data parallelism on a sub-range is one of the
configurations the optimiser must be able to pick (and is what m = 1 reduces to).
The answer is A^L(0->N, m_L): every worker is used, the slowest stage time per
micro-batch is minimised, and the plan is flattened to one stage list whose replica
counts multiply down the levels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile

__all__ = ["Level", "plan_pipedream", "plan_pipeline_stages", "stage_memory_bytes"]

_F = npt.NDArray[np.float64]
_I = npt.NDArray[np.int64]


def _check_bandwidth(value: float, name: str) -> None:
    if not value > 0:  # also rejects NaN
        raise PlanError(f"{name} must be a bandwidth in bytes/s in (0, inf] (got {value})")


@dataclass(frozen=True, slots=True)
class Level:
    """Level k of the topology: ``workers`` (m_k) components of level k-1 joined by
    links of ``bandwidth_Bps`` (B_k). Level 1 is the devices inside one server."""

    workers: int
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise PlanError(f"Level.workers must be an integer >= 1 (got {self.workers!r})")
        _check_bandwidth(self.bandwidth_Bps, "Level.bandwidth_Bps")


def stage_memory_bytes(profile: Profile, start: int, end: int, *, inflight: int) -> int:
    """Bytes one device needs to hold layers ``start..end-1`` with ``inflight`` micro-batches.

    Weight stashing (PipeDream §2.3) keeps one weight version per in-flight micro-batch
    (the newest is the live copy), the optimizer state once, and the saved activations
    of every in-flight micro-batch until its backward pass.
    """
    layers = profile.layers[start:end]
    weights = sum(layer.param_bytes for layer in layers)
    saved = sum(layer.saved_bytes for layer in layers)
    optimizer = sum(layer.optimizer_bytes for layer in layers)
    return inflight * (weights + saved) + optimizer


@dataclass(frozen=True, slots=True)
class _Tables:
    """One level's DP: ``value[i, j, m]`` = A^k over layers [i, j) with m components."""

    value: _F
    choice: _I  # -1: one stage (T^k); else s * (m_k + 1) + m' (split before layer s)
    boundary: _F  # 2 a_{s-1} / B_k for a split before layer s (0 when costing memory)


def _solve_level(
    prev: _F, wsum: _F, bnd: _F, level: Level, *, replication: bool, memory: bool, top: bool
) -> _Tables:
    n = prev.shape[0] - 1
    mk = level.workers
    stage = np.full((n + 1, n + 1, mk + 1), math.inf)
    for m in range(1, mk + 1 if replication else 2):
        if memory:  # replicas hold the whole stage: memory does not shrink with m
            stage[:, :, m] = prev
        else:
            sync = 2.0 * (m - 1) * wsum / level.bandwidth_Bps if m > 1 else 0.0
            stage[:, :, m] = np.maximum(prev, sync) / m
    value = np.full_like(stage, math.inf)
    choice = np.full(stage.shape, -1, dtype=np.int64)
    # Only A^L(0 -> N) is needed at the top; lower levels feed T^{k+1} for every (i, j).
    rows = slice(0, 1) if top else slice(0, n)
    nrows = 1 if top else n
    for j in range(1, n + 1):
        for m in range(1, mk + 1):
            best = stage[rows, j, m].copy()
            pick = np.full(nrows, -1, dtype=np.int64)
            if m > 1 and j > 1:
                # cand[i, s-1, m'-1] = max(A(i->s, m-m'), 2a/B, T(s->j, m')); A is inf for s <= i.
                left = value[rows, 1:j, m - 1 : 0 : -1]
                right = stage[1:j, j, 1:m]
                cand = np.maximum(np.maximum(left, bnd[1:j, None]), right).reshape(nrows, -1)
                k = cand.argmin(axis=1)
                got = cand[np.arange(nrows), k]
                better = got < best
                best = np.where(better, got, best)
                code = (1 + k // (m - 1)) * (mk + 1) + (1 + k % (m - 1))
                pick = np.where(better, code, pick)
            value[rows, j, m] = best
            choice[rows, j, m] = pick
    return _Tables(value=value, choice=choice, boundary=bnd)


def _range_table(values: Sequence[float], n: int, *, empty: float = math.inf) -> _F:
    """``out[i, j]`` = sum of values[i:j] for i < j, ``empty`` otherwise."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])
    out: _F = prefix[None, :] - prefix[:, None]
    out[np.tril_indices(n + 1)] = empty
    return out


def _run(
    profile: Profile, levels: Sequence[Level], *, replication: bool, memory_limit: float | None
) -> tuple[float, list[tuple[int, int, int, float]], list[float], float]:
    """Solve every level; return (A^L, stages (start, end, replicas, time), boundary times,
    and, only when no plan fits, the smallest achievable per-device memory; else NaN)."""
    n = profile.num_layers
    workers = math.prod(level.workers for level in levels)
    # 0 (not inf) off the valid ranges: the sync term there must not become inf / inf = NaN.
    wsum = _range_table([layer.param_bytes for layer in profile.layers], n, empty=0.0)
    act = np.array([0.0] + [float(layer.activation_bytes) for layer in profile.layers])
    # PipeDream sizes in-flight micro-batches by NOAM = ceil(workers / input-stage replicas),
    # but a stage's position in the final pipeline is unknown inside the DP, so every
    # stage is checked against the upper bound NOAM <= workers (conservative).
    mem = np.full((n + 1, n + 1), math.inf)
    for i in range(n):
        for j in range(i + 1, n + 1):
            mem[i, j] = stage_memory_bytes(profile, i, j, inflight=workers)
    compute = _range_table([layer.compute_s for layer in profile.layers], n)
    if memory_limit is not None:
        compute = np.where(mem <= memory_limit, compute, math.inf)

    def solve(base: _F, memory: bool) -> list[_Tables]:
        tables, prev = [], base
        for k, level in enumerate(levels):
            bnd = np.zeros(n + 1) if memory else 2.0 * act / level.bandwidth_Bps
            t = _solve_level(
                prev,
                wsum,
                bnd,
                level,
                replication=replication,
                memory=memory,
                top=k == len(levels) - 1,
            )
            tables.append(t)
            prev = t.value[:, :, level.workers]
        return tables

    tables = solve(compute, memory=False)
    top = levels[-1].workers
    best = float(tables[-1].value[0, n, top])
    if not math.isfinite(best):  # for the error message: the leanest plan's largest stage
        return best, [], [], float(solve(mem, memory=True)[-1].value[0, n, top])

    Pieces = tuple[list[tuple[int, int, int, float]], list[float]]

    def expand_stage(k: int, i: int, j: int, m: int) -> Pieces:
        # T^k(i->j, m): the level-(k-1) sub-pipeline over [i, j) on each of m components.
        stages: list[tuple[int, int, int, float]]
        bounds: list[float]
        if k == 0:
            stages, bounds = [(i, j, 1, float(compute[i, j]))], []
        else:
            stages, bounds = expand(k - 1, i, j, levels[k - 1].workers)
        sync = 2.0 * (m - 1) * float(wsum[i, j]) / levels[k].bandwidth_Bps if m > 1 else 0.0
        return [(a, b, r * m, max(t, sync) / m) for a, b, r, t in stages], [x / m for x in bounds]

    def expand(k: int, i: int, j: int, m: int) -> Pieces:
        code = int(tables[k].choice[i, j, m])
        if code < 0:
            return expand_stage(k, i, j, m)
        s, mp = divmod(code, levels[k].workers + 1)
        ls, lb = expand(k, i, s, m - mp)
        rs, rb = expand_stage(k, s, j, mp)
        return ls + rs, [*lb, float(tables[k].boundary[s]), *rb]

    stages, bounds = expand(len(levels) - 1, 0, n, top)
    return best, stages, bounds, math.nan


def _level_meta(levels: Sequence[Level]) -> list[dict[str, Any]]:
    # JSON has no infinity: an unlimited link is written as null.
    return [
        {
            "workers": lv.workers,
            "bandwidth_Bps": lv.bandwidth_Bps if math.isfinite(lv.bandwidth_Bps) else None,
        }
        for lv in levels
    ]


def _partition(
    profile: Profile,
    levels: Sequence[Level],
    *,
    replication: bool,
    memory_limit_bytes: float | None,
    what: str,
) -> Partition:
    if memory_limit_bytes is not None and not memory_limit_bytes > 0:
        raise PlanError(f"memory_limit_bytes must be > 0 bytes or None (got {memory_limit_bytes})")
    workers = math.prod(level.workers for level in levels)
    best, stages, comm, smallest = _run(
        profile, levels, replication=replication, memory_limit=memory_limit_bytes
    )
    if not math.isfinite(best):
        if memory_limit_bytes is not None and math.isfinite(smallest):
            raise PlanError(
                f"{what}: no plan of {profile.model!r} fits memory_limit_bytes={memory_limit_bytes:.0f}; "
                f"the smallest per-device requirement of any plan is {smallest:.0f} bytes "
                f"(weights, optimizer state and activations for {workers} in-flight micro-batches)"
            )
        raise PlanError(f"{what}: no feasible plan of {profile.model!r} on {workers} workers")
    bounds_out = (*(a for a, _, _, _ in stages), profile.num_layers)
    replicas = tuple(r for _, _, r, _ in stages)
    meta: dict[str, Any] = {
        "stage_times": [t for _, _, _, t in stages],
        "boundary_times": comm,
        "noam": math.ceil(workers / replicas[0]),
        "workers": workers,
        "levels": _level_meta(levels),
        "inflight_assumed": workers,
        "memory_bytes": [
            stage_memory_bytes(profile, a, b, inflight=workers) for a, b, _, _ in stages
        ],
        "memory_limit_bytes": memory_limit_bytes,
    }
    return Partition(
        model=profile.model,
        num_layers=profile.num_layers,
        bounds=bounds_out,
        replicas=replicas,
        planner="pipedream",
        predicted_s=best,
        meta=meta,
    )


def plan_pipedream(
    profile: Profile,
    *,
    levels: Sequence[Level],
    memory_limit_bytes: float | None = None,
    replication: bool = True,
) -> Partition:
    """PipeDream's hierarchical DP: stages and per-stage replication on all workers.

    Args:
        profile: per-layer T_l (forward + backward), a_l (activation bytes), |w_l| (param bytes).
        levels: the topology from the innermost level (devices in a server) outwards.
        memory_limit_bytes: per-device memory; stages that exceed it are never chosen
            (see `stage_memory_bytes`; in-flight count = total workers, an upper bound).
        replication: allow data-parallel stages; with False every stage has one worker,
            so the pipeline has exactly as many stages as workers.

    ``predicted_s`` is A^L(0->N, m_L), the slowest stage's time per micro-batch;
    ``meta`` holds ``stage_times``, ``boundary_times`` (2 a_s / B_k, scaled by the
    replication of the enclosing components), ``noam`` and ``levels``.
    """
    if not levels:
        raise PlanError("plan_pipedream: levels must name at least one topology level")
    workers = math.prod(level.workers for level in levels)
    if not replication and workers > profile.num_layers:
        raise PlanError(
            f"plan_pipedream: without replication every one of the {workers} workers needs its own "
            f"stage, but {profile.model!r} has only {profile.num_layers} layers (allowed: workers <= layers)"
        )
    return _partition(
        profile,
        levels,
        replication=replication,
        memory_limit_bytes=memory_limit_bytes,
        what="pipedream",
    )


def plan_pipeline_stages(
    profile: Profile,
    *,
    num_stages: int,
    bandwidth_Bps: float = math.inf,
    memory_limit_bytes: float | None = None,
) -> Partition:
    """Exactly ``num_stages`` unreplicated stages on a flat network (PipeDream's objective).

    Minimises, over contiguous partitions, max(max_s sum_{l in s} T_l, max_b 2 a_b / B):
    the one-level DP with m_1 = ``num_stages`` and no replication.
    """
    n = profile.num_layers
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= n:
        raise PlanError(
            f"cannot split {n} layers of {profile.model!r} into {num_stages} stages (allowed: 1..{n})"
        )
    _check_bandwidth(bandwidth_Bps, "bandwidth_Bps")
    part = _partition(
        profile,
        [Level(num_stages, bandwidth_Bps)],
        replication=False,
        memory_limit_bytes=memory_limit_bytes,
        what=f"pipedream with {num_stages} stages",
    )
    return part
