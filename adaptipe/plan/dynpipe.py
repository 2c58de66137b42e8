"""DynPipe's communication-aware 1F1B partitioner (DynPipe §IV-C, Eq. 4-7, Algorithm 1).

A pipeline's per-iteration time is built from the input side: the first S-1 stages,
merged, take W(l', S-1) per iteration; the last stage takes W_{l'+1->l} (Eq. 6: the sum
of its layers' forward and backward times) and the link between them c (Eq. 7: the
boundary activation plus the gradient coming back, over the link's bandwidth). Eq. 4
combines the two into one 1F1B cycle and Eq. 5 minimises over the boundary l'.

Scope: one worker per stage (r = r' = 1). DynPipe also places intra-stage data and
tensor parallelism (r workers per stage, the all-gather and all-reduce terms of Eq. 6);
that needs a collective-communication model and is left out here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError
from adaptipe.plan.condense import Condensed, condense
from adaptipe.plan.partition import Partition
from adaptipe.plan.staleness import StalenessModel
from adaptipe.profile.types import Profile

__all__ = ["cycle_time", "iteration_time", "link_bandwidths", "plan_dynpipe"]

_F = npt.NDArray[np.float64]


def cycle_time(merged_s: float, comm_s: float, last_s: float) -> float:
    """One 1F1B cycle of a merged stage (A), a link (c) and the last stage (B): DynPipe Eq. 4.

    Case 1 (B < A + c): (c + A + B) / 2; case 2: B. Taken literally, case 1 lets an
    unbalanced pair undercut the slower side's own compute (A=10, B=0, c=0 gives 5),
    which a 1F1B stage cannot do: each stage runs one forward and one backward per
    cycle. We therefore return max(Eq. 4, A, B). The result is non-decreasing in A
    (and in c and B), which makes the recursive DP over Eq. 5 exact.
    """
    eq4 = (comm_s + merged_s + last_s) / 2.0 if last_s < merged_s + comm_s else last_s
    return max(eq4, merged_s, last_s)


def _cycle_times(merged: _F, comm: _F, last: _F) -> _F:
    eq4 = np.where(last < merged + comm, (comm + merged + last) / 2.0, last)
    out: _F = np.maximum(np.maximum(eq4, merged), last)
    return out


def link_bandwidths(
    bandwidth_Bps: float | Sequence[float], count: int, *, exact: bool = True
) -> list[float]:
    """The bandwidths of the ``count`` stage boundaries, checked.

    A scalar applies to every boundary. A sequence lists one link per boundary, in
    pipeline order; with ``exact`` it must hold exactly ``count`` values, otherwise at
    least ``count`` (a chain of workers whose first ``count`` links a shorter pipeline uses).
    """
    scalar = isinstance(bandwidth_Bps, int | float)
    if isinstance(bandwidth_Bps, int | float):
        given = [float(bandwidth_Bps)]
    else:
        given = [float(b) for b in bandwidth_Bps]
    for i, b in enumerate(given):
        if not b > 0:  # also rejects NaN
            name = "bandwidth_Bps" if scalar else f"bandwidth_Bps[{i}]"
            raise PlanError(f"{name} must be a bandwidth in bytes/s in (0, inf] (got {b})")
    if scalar:
        return given * count
    if len(given) < count or (exact and len(given) != count):
        need = f"{count}" if exact else f"at least {count}"
        raise PlanError(
            f"bandwidth_Bps lists one bandwidth per stage boundary: need {need} values for "
            f"{count + 1} stages (got {len(given)})"
        )
    return given[:count]


def _comm(profile: Profile, split: int, bandwidth: float) -> float:
    """Eq. 7 with r = r' = 1: activation of layer split-1 plus gradient into layer split."""
    layers = profile.layers
    return (layers[split - 1].activation_bytes + layers[split].gradient_bytes) / bandwidth


def _stage_compute(profile: Profile, bounds: Sequence[int]) -> list[float]:
    """Eq. 6 with r = 1: a stage's forward plus backward times."""
    return [
        sum(layer.compute_s for layer in profile.layers[a:b]) for a, b in itertools.pairwise(bounds)
    ]


def iteration_time(
    profile: Profile, bounds: Sequence[int], bandwidth_Bps: float | Sequence[float]
) -> float:
    """Per-iteration time of a partition by folding Eq. 4 from the input stage (Eq. 5)."""
    bws = link_bandwidths(bandwidth_Bps, len(bounds) - 2)
    times = _stage_compute(profile, bounds)
    total = times[0]
    for s in range(1, len(times)):
        total = cycle_time(total, _comm(profile, bounds[s], bws[s - 1]), times[s])
    return total


def _tables(
    profile: Profile, max_stages: int, bws: list[float]
) -> tuple[_F, npt.NDArray[np.int64]]:
    """``W[s, j]``: best time of layers [0, j) in s stages (Eq. 5); ``arg[s, j]``: the last split."""
    n = profile.num_layers
    prefix = np.concatenate([[0.0], np.cumsum([layer.compute_s for layer in profile.layers])])
    act = np.array([0.0] + [float(layer.activation_bytes) for layer in profile.layers])
    grad = np.array([float(layer.gradient_bytes) for layer in profile.layers] + [0.0])
    table = np.full((max_stages + 1, n + 1), math.inf)
    arg = np.zeros((max_stages + 1, n + 1), dtype=np.int64)
    table[1, 1:] = prefix[1:]
    for s in range(2, max_stages + 1):
        comm = (act + grad) / bws[s - 2]  # comm[i]: split before layer i, between stages s-1 and s
        for j in range(s, n + 1):
            splits = np.arange(s - 1, j)
            vals = _cycle_times(table[s - 1, splits], comm[splits], prefix[j] - prefix[splits])
            k = int(vals.argmin())
            table[s, j] = vals[k]
            arg[s, j] = splits[k]
    return table, arg


def _bounds(arg: npt.NDArray[np.int64], stages: int, n: int) -> tuple[int, ...]:
    out, j = [n], n
    for s in range(stages, 1, -1):
        j = int(arg[s, j])
        out.append(j)
    out.append(0)
    return tuple(reversed(out))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no infinity


def _check_stages(value: int, n: int, model: str, name: str, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= n:
        raise PlanError(
            f"{name}: cannot split {n} {unit} of {model!r} into {value} stages (allowed: 1..{n})"
        )


def _condense(profile: Profile, top_k: int, bandwidth_Bps: float | Sequence[float]) -> Condensed:
    """Algorithm 2's top_k blocks; ranking layers by communication needs one bandwidth,
    so the slowest link's."""
    if isinstance(bandwidth_Bps, int | float):
        slowest = float(bandwidth_Bps)
    else:
        slowest = min(bandwidth_Bps, default=math.inf)
    return condense(profile, top_k, bandwidth_Bps=slowest)


def _stage_counts(
    work: Profile,
    *,
    num_stages: int | None,
    max_stages: int | None,
    bandwidth_Bps: float | Sequence[float],
    staleness: StalenessModel | None,
    unit: str,
) -> tuple[list[float], list[int]]:
    """The boundary bandwidths and the stage counts to try: ``num_stages`` alone, or
    Algorithm 1's S = 1..max_stages (checked, at most one stage per layer or block)."""
    n = work.num_layers
    if num_stages is not None:
        if max_stages is not None:
            raise PlanError("plan_dynpipe: give num_stages or max_stages, not both")
        _check_stages(num_stages, n, work.model, "dynpipe", unit)
        return link_bandwidths(bandwidth_Bps, num_stages - 1), [num_stages]
    if staleness is None:
        raise PlanError(
            "plan_dynpipe: choosing the stage count needs a StalenessModel (Eq. 3); "
            "give staleness=... or num_stages=..."
        )
    if max_stages is None:
        max_stages = n if isinstance(bandwidth_Bps, int | float) else len(bandwidth_Bps) + 1
    if isinstance(max_stages, bool) or not isinstance(max_stages, int) or max_stages < 1:
        raise PlanError(f"max_stages must be an integer >= 1 (got {max_stages!r})")
    # More stages than layers (blocks) cannot exist: Algorithm 1's S <= N meets S <= M.
    bws = link_bandwidths(bandwidth_Bps, min(max_stages, n) - 1, exact=False)
    return bws, list(range(1, min(max_stages, n) + 1))


def plan_dynpipe(
    profile: Profile,
    *,
    num_stages: int | None = None,
    max_stages: int | None = None,
    bandwidth_Bps: float | Sequence[float] = math.inf,
    staleness: StalenessModel | None = None,
    top_k: int | None = None,
) -> Partition:
    """DynPipe's plan: the Eq. 5 DP for a stage count, or Algorithm 1 to choose it.

    Args:
        num_stages: plan exactly this many stages (needs no staleness model).
        max_stages: with ``num_stages`` unset, try S = 1..max_stages (the GPU count N
            of Algorithm 1; default: the number of layers, or the length of a bandwidth
            list plus one) and keep the S minimising T(S) W(S), T from Eq. 3.
        bandwidth_Bps: one bandwidth for every link, or one per stage boundary.
        staleness: Eq. 2-3 constants; required when choosing the stage count.
        top_k: plan on the model condensed into top_k blocks (Algorithm 2) and map back.

    ``predicted_s`` is W(S); ``meta["candidates"]`` lists W, T and T*W for every S tried.
    """
    link_bandwidths(bandwidth_Bps, 0, exact=False)  # validates every value
    condensed = None
    work = profile
    if top_k is not None:
        condensed = _condense(profile, top_k, bandwidth_Bps)
        work = condensed.profile
    n = work.num_layers
    bws, tried = _stage_counts(
        work,
        num_stages=num_stages,
        max_stages=max_stages,
        bandwidth_Bps=bandwidth_Bps,
        staleness=staleness,
        unit="blocks" if condensed else "layers",
    )
    table, arg = _tables(work, max(tried), bws)

    def expand(bounds: tuple[int, ...]) -> list[int]:
        return [condensed.block_bounds[b] for b in bounds] if condensed else list(bounds)

    candidates: list[dict[str, Any]] = []
    best_s, best_wall = tried[0], math.inf
    for s in tried:
        w = float(table[s, n])
        t = staleness.iterations(s) if staleness else math.inf
        wall = t * w if math.isfinite(t) else math.inf
        candidates.append(
            {
                "num_stages": s,
                "iteration_s": w,
                "iterations": _finite(t),
                "wall_clock_s": _finite(wall),
                "bounds": expand(_bounds(arg, s, n)),
            }
        )
        if wall < best_wall:
            best_s, best_wall = s, wall
    if staleness is not None and num_stages is None and not math.isfinite(best_wall):
        raise PlanError(
            f"plan_dynpipe: no stage count reaches epsilon={staleness.epsilon}: the staleness "
            "term 2 lr^2 S^3 L^2 xi^2 of Eq. 3 exceeds it even for S = 1"
        )
    bounds = _bounds(arg, best_s, n)
    comm = [_comm(work, bounds[s], bws[s - 1]) for s in range(1, best_s)]
    meta: dict[str, Any] = {
        "stage_compute_s": _stage_compute(work, bounds),
        "boundary_comm_s": comm,
        "bandwidth_Bps": [_finite(b) for b in bws[: best_s - 1]],
        "iterations": candidates[tried.index(best_s)]["iterations"],
        "wall_clock_s": candidates[tried.index(best_s)]["wall_clock_s"],
        "staleness": staleness.to_json() if staleness else None,
    }
    if num_stages is None:
        meta["candidates"] = candidates
    part = Partition(
        model=work.model,
        num_layers=n,
        bounds=bounds,
        planner="dynpipe",
        predicted_s=float(table[best_s, n]),
        meta=meta,
    )
    return condensed.expand(part) if condensed else part
