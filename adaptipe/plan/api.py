"""One entry point for every planner, and per-stage times for reports."""

from __future__ import annotations

import math
from collections.abc import Sequence

from adaptipe.errors import PlanError
from adaptipe.plan.dynpipe import link_bandwidths, plan_dynpipe
from adaptipe.plan.partition import Partition
from adaptipe.plan.pipedream import Level, plan_pipedream, plan_pipeline_stages
from adaptipe.plan.staleness import StalenessModel
from adaptipe.profile.types import Profile

__all__ = ["PLANNERS", "boundary_times", "plan", "stage_times"]

PLANNERS = ("pipedream", "dynpipe", "even")


def _reject(planner: str, **options: object) -> None:
    """Options a planner would silently ignore are an error: say which planner takes them."""
    takes = {
        "levels": "pipedream",
        "memory_limit_bytes": "pipedream",
        "staleness": "dynpipe",
        "top_k": "dynpipe",
        "max_stages": "dynpipe",
    }
    for name, value in options.items():
        if value is not None:
            raise PlanError(f"planner {planner!r} does not take {name} (only {takes[name]} does)")


def plan(
    profile: Profile,
    *,
    planner: str,
    num_stages: int | None,
    bandwidth_Bps: float | Sequence[float] = math.inf,
    levels: Sequence[Level] | None = None,
    memory_limit_bytes: float | None = None,
    staleness: StalenessModel | None = None,
    top_k: int | None = None,
    max_stages: int | None = None,
) -> Partition:
    """Partition ``profile`` with ``planner`` (one of `PLANNERS`).

    - ``pipedream``: with ``num_stages``, exactly that many unreplicated stages on a flat
      network of ``bandwidth_Bps``; with ``levels`` instead, the hierarchical DP that
      also chooses stage count and replication.
    - ``dynpipe``: the communication-aware DP for ``num_stages``, or, without it, the
      stage count minimising T(S) W(S) given ``staleness`` (Algorithm 1).
    - ``even``: ``num_stages`` stages of equal layer counts (no cost model, so no
      ``predicted_s``; ``meta["stage_times"]`` holds `stage_times`).
    """
    if planner == "pipedream":
        _reject(planner, staleness=staleness, top_k=top_k, max_stages=max_stages)
        if not isinstance(bandwidth_Bps, int | float):
            raise PlanError(
                "planner 'pipedream' takes one bandwidth_Bps for the whole network (got a list)"
            )
        if levels is not None:
            if num_stages is not None:
                raise PlanError(
                    "planner 'pipedream' takes num_stages (fixed straight pipeline) or levels "
                    "(hierarchical DP choosing stages and replication), not both"
                )
            if bandwidth_Bps != math.inf:
                raise PlanError(
                    "planner 'pipedream' with levels reads bandwidths from each Level, not bandwidth_Bps"
                )
            return plan_pipedream(profile, levels=levels, memory_limit_bytes=memory_limit_bytes)
        if num_stages is None:
            raise PlanError("planner 'pipedream' needs num_stages or levels")
        return plan_pipeline_stages(
            profile,
            num_stages=num_stages,
            bandwidth_Bps=bandwidth_Bps,
            memory_limit_bytes=memory_limit_bytes,
        )
    if planner == "dynpipe":
        _reject(planner, levels=levels, memory_limit_bytes=memory_limit_bytes)
        return plan_dynpipe(
            profile,
            num_stages=num_stages,
            max_stages=max_stages,
            bandwidth_Bps=bandwidth_Bps,
            staleness=staleness,
            top_k=top_k,
        )
    if planner == "even":
        _reject(
            planner,
            levels=levels,
            memory_limit_bytes=memory_limit_bytes,
            staleness=staleness,
            top_k=top_k,
            max_stages=max_stages,
        )
        if num_stages is None:
            raise PlanError("planner 'even' needs num_stages")
        part = Partition.even(
            model=profile.model, num_layers=profile.num_layers, num_stages=num_stages
        )
        times = stage_times(profile, part, bandwidth_Bps)
        return Partition(
            model=part.model,
            num_layers=part.num_layers,
            bounds=part.bounds,
            planner="even",
            meta={"stage_times": times},
        )
    raise PlanError(f"unknown planner {planner!r} (allowed: {', '.join(PLANNERS)})")


def boundary_times(
    profile: Profile, partition: Partition, bandwidth_Bps: float | Sequence[float] = math.inf
) -> list[float]:
    """Seconds to move one micro-batch's activation forward and gradient back across each
    stage boundary (DynPipe Eq. 7 with one worker per side): S - 1 values."""
    partition.check_model(model=profile.model, num_layers=profile.num_layers)
    bws = link_bandwidths(bandwidth_Bps, partition.num_stages - 1)
    layers = profile.layers
    return [
        (
            layers[partition.bounds[b] - 1].activation_bytes
            + layers[partition.bounds[b]].gradient_bytes
        )
        / bws[b - 1]
        for b in range(1, partition.num_stages)
    ]


def stage_times(
    profile: Profile, partition: Partition, bandwidth_Bps: float | Sequence[float] = math.inf
) -> list[float]:
    """Per-stage busy time per micro-batch: forward + backward of its layers plus sending its
    output activation (to the next stage) and its input gradient (to the previous one),
    divided by its replicas, which each handle 1/replicas of the micro-batches.

    ``bandwidth_Bps`` is one value or one per boundary (S - 1 values).
    """
    partition.check_model(model=profile.model, num_layers=profile.num_layers)
    bws = link_bandwidths(bandwidth_Bps, partition.num_stages - 1)
    out = []
    for s in range(partition.num_stages):
        first, last = partition.bounds[s], partition.bounds[s + 1] - 1
        busy = sum(profile.layers[i].compute_s for i in partition.layers(s))
        if s + 1 < partition.num_stages:
            busy += profile.layers[last].activation_bytes / bws[s]
        if s > 0:
            busy += profile.layers[first].gradient_bytes / bws[s - 1]
        out.append(busy / partition.replicas[s])
    return out
