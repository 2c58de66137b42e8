"""PipeDream-2BW's planner (Narayanan's dissertation, §3.3): choose the pipeline depth p,
the data-parallel width d, the micro-batch size b and whether to recompute activations,
for the highest throughput that fits in a device's memory (Algorithm 1).

For every (d, p) with ``d * p <= devices`` and every candidate b dividing the largest
safe global batch B into ``m = B / (d * b) >= p`` micro-batches per pipeline and step
(2BW's gradient accumulation: two weight versions suffice when a step spans at least p
micro-batches), with and without recomputation, the layers are cut into p contiguous
stages minimising the slowest stage's time per micro-batch (a DP over cut points), and
the configuration is kept if every stage fits. Per micro-batch of size b, stage i takes
(§3.3.3, "THROUGHPUT")

    t_i = max(c * T_comp_i(b) + T_comm_in_i(b),  T_allreduce_i / m)

where ``c = 4/3`` with recomputation (the forward runs again), ``T_comp`` sums the
layers' forward and backward seconds, scaled from the profile's micro-batch size to b
(linearly: the profile says nothing of arithmetic intensity), ``T_comm_in`` moves the
boundary activation and its gradient over ``bandwidth_Bps`` (the factor 2 of the
dissertation), and ``T_allreduce`` is a ring all-reduce of the stage's weight
gradients among its d replicas, ``2 (d - 1) / d * |W_i|`` bytes over
``allreduce_bandwidth_Bps``, once per step. Without a flush the pipeline starts a
micro-batch every ``max_i t_i``: throughput ``d * b / max_i t_i`` samples per second.

Memory of stage i (§3.3.3, "MEMORY", per stage rather than the model's average): two
weight versions and the optimizer state, the activation stashes of its in-flight
micro-batches (``p - i`` under 1F1B; one with recomputation) and the stage inputs of
every in-flight micro-batch (``p - i``):

    2 |W_i| + |O_i| + k |A_i(b)| + (p - i) |A_in_i(b)|,   k = p - i, or 1 recomputing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile

__all__ = ["RECOMPUTE_FACTOR", "TwoBWPlan", "config_cost", "plan_2bw"]

RECOMPUTE_FACTOR = 4.0 / 3.0  # c_extra: backward ~ 2x forward, so one more forward is 4/3


@dataclass(frozen=True, slots=True, kw_only=True)
class TwoBWPlan:
    """The chosen configuration and what the cost model says of it."""

    depth: int  # p
    width: int  # d
    microbatch: int  # b
    recompute: bool
    accumulation: int  # m: micro-batches per pipeline per optimizer step
    partition: Partition
    samples_per_s: float
    stage_s: tuple[float, ...]  # t_i per micro-batch
    stage_bytes: tuple[int, ...]
    considered: int

    def to_json(self) -> dict[str, Any]:
        return {
            "depth": self.depth,
            "width": self.width,
            "microbatch": self.microbatch,
            "recompute": self.recompute,
            "accumulation": self.accumulation,
            "bounds": list(self.partition.bounds),
            "samples_per_s": self.samples_per_s,
            "stage_s": list(self.stage_s),
            "stage_bytes": list(self.stage_bytes),
            "considered": self.considered,
        }


@dataclass(frozen=True, slots=True)
class _Costs:
    profile: Profile
    microbatch: int
    width: int
    depth: int
    recompute: bool
    accumulation: int
    bandwidth_Bps: float
    allreduce_Bps: float

    @property
    def scale(self) -> float:
        return self.microbatch / self.profile.microbatch

    def stage_s(self, start: int, end: int) -> float:
        layers = self.profile.layers[start:end]
        comp = sum(layer.compute_s for layer in layers) * self.scale
        if self.recompute:
            comp *= RECOMPUTE_FACTOR
        comm = 0.0
        if start > 0 and math.isfinite(self.bandwidth_Bps):
            edge = self.profile.layers[start - 1].activation_bytes * self.scale
            comm = 2.0 * edge / self.bandwidth_Bps
        sync = 0.0
        if self.width > 1 and math.isfinite(self.allreduce_Bps):
            weights = sum(layer.param_bytes for layer in layers)
            sync = 2.0 * (self.width - 1) / self.width * weights / self.allreduce_Bps
        return max(comp + comm, sync / self.accumulation)

    def stage_bytes(self, start: int, end: int, stage: int) -> int:
        layers = self.profile.layers[start:end]
        inflight = self.depth - stage
        weights = sum(layer.param_bytes for layer in layers)
        optimizer = sum(layer.optimizer_bytes for layer in layers)
        stash = sum(layer.saved_bytes for layer in layers) * self.scale
        inputs = self.profile.layers[start - 1].activation_bytes * self.scale if start else 0.0
        kept = 1 if self.recompute else inflight
        return int(2 * weights + optimizer + kept * stash + inflight * inputs)


def config_cost(costs: _Costs, bounds: Sequence[int]) -> tuple[float, list[float], list[int]]:
    """Throughput (samples/s), per-stage seconds and bytes of ``bounds`` under ``costs``."""
    pairs = list(itertools.pairwise(bounds))
    times = [costs.stage_s(a, b) for a, b in pairs]
    sizes = [costs.stage_bytes(a, b, i) for i, (a, b) in enumerate(pairs)]
    slowest = max(times)
    rate = costs.width * costs.microbatch / slowest if slowest > 0 else math.inf
    return rate, times, sizes


def _best_cut(costs: _Costs, memory_limit: float) -> tuple[float, tuple[int, ...]] | None:
    """The cut into ``costs.depth`` stages minimising the slowest stage among those whose
    every stage fits (DP over the last cut; memory depends on the stage's index)."""
    n, p = costs.profile.num_layers, costs.depth
    if p > n:
        return None
    inf = math.inf
    # best[k][j]: the least slowest-stage time for layers [0, j) in k stages (k = 1..p).
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[-1] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                if costs.stage_bytes(i, j, k - 1) > memory_limit:
                    continue
                value = max(best[k - 1][i], costs.stage_s(i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[p][n] == inf:
        return None
    bounds, j = [n], n
    for k in range(p, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    return best[p][n], tuple(reversed(bounds))


def _candidates(batch: int) -> list[int]:
    """Micro-batch sizes to try: the powers of two up to the global batch, and it."""
    sizes = {1 << k for k in range(batch.bit_length()) if (1 << k) <= batch}
    return sorted(sizes | {batch})


def plan_2bw(
    profile: Profile,
    *,
    devices: int,
    memory_limit_bytes: float,
    batch_size: int,
    bandwidth_Bps: float = math.inf,
    allreduce_bandwidth_Bps: float | None = None,
    microbatches: Sequence[int] | None = None,
    max_width: int | None = None,
) -> TwoBWPlan:
    """The highest-throughput (p, d, b, recompute) that fits (see the module doc).

    ``batch_size`` is the largest safe global batch B; ``microbatches`` the sizes to try
    (default: powers of two up to B); ``max_width`` caps d (1: pipelines only, what
    adaptipe runs without replicated stages)."""
    if devices < 1 or batch_size < 1 or not memory_limit_bytes > 0:
        raise PlanError(
            f"2bw planner: devices ({devices}) and batch_size ({batch_size}) must be >= 1 "
            f"and memory_limit_bytes > 0 (got {memory_limit_bytes})"
        )
    allreduce = bandwidth_Bps if allreduce_bandwidth_Bps is None else allreduce_bandwidth_Bps
    sizes = sorted(set(microbatches)) if microbatches else _candidates(batch_size)
    best: TwoBWPlan | None = None
    considered = 0
    for width in range(1, min(devices, max_width or devices) + 1):
        for depth in range(1, devices // width + 1):
            for b in sizes:
                if batch_size % (width * b):
                    continue
                accumulation = batch_size // (width * b)
                if accumulation < depth:
                    continue
                for recompute in (False, True):
                    considered += 1
                    costs = _Costs(profile, b, width, depth, recompute, accumulation,
                                   bandwidth_Bps, allreduce)  # fmt: skip
                    found = _best_cut(costs, memory_limit_bytes)
                    if found is None:
                        continue
                    rate, times, used = config_cost(costs, found[1])
                    if best is None or _better(rate, b, recompute, best):
                        partition = Partition(
                            model=profile.model, num_layers=profile.num_layers,
                            bounds=found[1], planner="2bw", predicted_s=max(times),
                            meta={"width": width, "microbatch": b, "recompute": recompute,
                                  "accumulation": accumulation, "samples_per_s": rate},
                        )  # fmt: skip
                        best = TwoBWPlan(
                            depth=depth, width=width, microbatch=b, recompute=recompute,
                            accumulation=accumulation, partition=partition,
                            samples_per_s=rate, stage_s=tuple(times),
                            stage_bytes=tuple(used), considered=0,
                        )  # fmt: skip
    if best is None:
        raise PlanError(
            f"2bw planner: no configuration of {devices} device(s) fits in "
            f"{memory_limit_bytes:.3g} bytes per device with a global batch of {batch_size}"
        )
    return TwoBWPlan(**{**_fields(best), "considered": considered})


def _better(rate: float, b: int, recompute: bool, best: TwoBWPlan) -> bool:
    """Higher throughput; on a tie (within 1e-9), the larger micro-batch, then no
    recomputation (the dissertation's "largest micro-batch that fits")."""
    if not math.isclose(rate, best.samples_per_s, rel_tol=1e-9):
        return rate > best.samples_per_s
    return (b, not recompute) > (best.microbatch, not best.recompute)


def _fields(plan: TwoBWPlan) -> dict[str, Any]:
    return {name: getattr(plan, name) for name in plan.__slots__}
