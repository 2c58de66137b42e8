"""The best partition for the pipeline as it runs now: DynPipe's planner on measured
times, with each stage's slowdown.

A stage that runs slower than its layers' profile (interference, a throttled device)
slows whatever layers it holds. `stage_slowdowns` reads that factor per stage from an
`Observation` (measured over profiled seconds of the layers it holds), and
`best_partition` runs DynPipe's Eq. 4-5 dynamic programme (`adaptipe.plan.dynpipe`)
with every candidate's layers scaled by the slowdown of the stage that would hold them,
over the measured link bandwidths. What it predicts for its best partition, against
what the bottleneck stage measures now, is what the threshold controller compares.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from adaptipe.controllers.observation import Observation
from adaptipe.errors import PlanError
from adaptipe.plan.dynpipe import cycle_time

__all__ = [
    "best_partition",
    "latest_ratios",
    "predicted_time",
    "stage_ratios",
    "stage_slowdowns",
]


def stage_ratios(obs: Observation) -> list[list[float]]:
    """Per window iteration, per stage in force: its layers' measured forward + backward
    seconds over their profiled seconds (NaN where a layer of it was not measured)."""
    stages = [range(obs.bounds[s], obs.bounds[s + 1]) for s in range(obs.num_stages)]
    profiled = [sum(obs.layer_forward_s[i] + obs.layer_backward_s[i] for i in r) for r in stages]
    out = []
    for fwd, bwd in zip(obs.measured_forward_s, obs.measured_backward_s, strict=True):
        row = []
        for layers, want in zip(stages, profiled, strict=True):
            measured = sum(fwd[i] + bwd[i] for i in layers)
            ok = want > 0 and math.isfinite(measured)
            row.append(measured / want if ok else math.nan)
        out.append(row)
    return out


def latest_ratios(ratios: Sequence[Sequence[float]], stages: int) -> list[float]:
    """Per stage the smaller of the last two rows of `stage_ratios` (the last alone where
    the one before is missing; NaN for no rows): a load that arrives stays, a
    one-iteration spike (the bed's link shaping stalled a stage for one iteration at its
    onset) does not."""
    if not ratios:
        return [math.nan] * stages
    last = list(ratios[-1])
    if len(ratios) >= 2:
        last = [min(a, b) if math.isfinite(b) else a for a, b in zip(last, ratios[-2], strict=True)]
    return last


def stage_slowdowns(obs: Observation) -> tuple[float, ...]:
    """Per stage: the window's median of `stage_ratios` (1.0 where nothing was measured)."""
    rows = stage_ratios(obs)
    out = []
    for s in range(obs.num_stages):
        ratios = [row[s] for row in rows if math.isfinite(row[s])]
        out.append(statistics.median(ratios) if ratios else 1.0)
    return tuple(out)


def predicted_time(
    obs: Observation, bounds: Sequence[int], slowdowns: Sequence[float] | None = None
) -> float:
    """DynPipe's per-iteration time of ``bounds`` (Eq. 4-5) with stage ``s``'s layers at
    ``slowdowns[s]`` times their profile and the observed link bandwidths."""
    slow = stage_slowdowns(obs) if slowdowns is None else tuple(slowdowns)
    bws = obs.boundary_bandwidths()
    work = [obs.layer_forward_s[i] + obs.layer_backward_s[i] for i in range(obs.num_layers)]
    total = slow[0] * sum(work[bounds[0] : bounds[1]])
    for s in range(1, len(bounds) - 1):
        comm = obs.boundary_bytes[bounds[s] - 1] / bws[s - 1]
        total = cycle_time(total, comm, slow[s] * sum(work[bounds[s] : bounds[s + 1]]))
    return total


def best_partition(
    obs: Observation, slowdowns: Sequence[float] | None = None
) -> tuple[tuple[int, ...], float]:
    """The partition with the least predicted time (`predicted_time`) for the observed
    stage count, and that time. Exact: Eq. 4 is non-decreasing in the merged stages'
    time, so the best prefix per (stage, boundary) is all the programme keeps."""
    slow = stage_slowdowns(obs) if slowdowns is None else tuple(slowdowns)
    stages, n = obs.num_stages, obs.num_layers
    if len(slow) != stages:
        raise PlanError(f"best_partition: {len(slow)} slowdowns for {stages} stages")
    if n < stages:
        raise PlanError(f"best_partition: {n} layers cannot fill {stages} stages")
    bws = obs.boundary_bandwidths()
    work = [obs.layer_forward_s[i] + obs.layer_backward_s[i] for i in range(n)]
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    # best[j]: the least folded time of stages 0..s over layers [0, j); how[s][j]: its split
    best = [math.inf] * (n + 1)
    for j in range(1, n - stages + 2):
        best[j] = slow[0] * prefix[j]
    how: list[list[int]] = [[0] * (n + 1)]
    for s in range(1, stages):
        nxt = [math.inf] * (n + 1)
        split = [0] * (n + 1)
        for j in range(s + 1, n - stages + s + 2):  # stage s holds [i, j)
            for i in range(s, j):
                if not math.isfinite(best[i]):
                    continue
                comm = obs.boundary_bytes[i - 1] / bws[s - 1]
                t = cycle_time(best[i], comm, slow[s] * (prefix[j] - prefix[i]))
                if t < nxt[j]:
                    nxt[j], split[j] = t, i
        best = nxt
        how.append(split)
    bounds = [n]
    for s in range(stages - 1, 0, -1):
        bounds.append(how[s][bounds[-1]])
    bounds.append(0)
    return tuple(reversed(bounds)), best[n]
