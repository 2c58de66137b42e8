"""A partition's iterations under changing conditions: the simulator for the adaptive
controllers and their environments.

`LayerCosts` holds a model's per-layer costs per micro-batch (a profile's, or the
measured ones a controller observed); `iteration_times` sums them over the stages of a
partition and runs the schedule (`adaptipe.sim.engine.simulate_iterations`) for as many
iterations as there are rows of conditions: per iteration a slowdown per stage and a
bandwidth per stage boundary (both directions). Iterations whose bandwidths are equal
run as one vectorised block; the pipeline starts each block empty, as the synchronous
schedules do every iteration anyway.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError
from adaptipe.profile.types import Profile
from adaptipe.schedule.build import build_schedule
from adaptipe.schedule.types import Schedule
from adaptipe.sim.costs import CostModel
from adaptipe.sim.engine import simulate_iterations

__all__ = ["LayerCosts", "iteration_times", "unlimited"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCosts:
    """Per layer and micro-batch: forward, backward and optimizer seconds, the bytes of
    the layer's output (sent forward across a cut after it) and of the gradient into it
    (sent backward across a cut before it); an iteration is ``microbatches`` of
    ``samples_per_microbatch`` samples through ``schedule``."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    gradient_bytes: tuple[int, ...]
    update_s: tuple[float, ...] = ()
    microbatches: int = 1
    samples_per_microbatch: int = 1
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        for name in ("backward_s", "activation_bytes", "gradient_bytes"):
            if len(getattr(self, name)) != n:
                raise PlanError(
                    f"LayerCosts: {name} has {len(getattr(self, name))} layers, not {n}"
                )
        if self.update_s and len(self.update_s) != n:
            raise PlanError(f"LayerCosts: update_s has {len(self.update_s)} layers, not {n}")
        if self.microbatches < 1 or self.samples_per_microbatch < 1:
            raise PlanError("LayerCosts: microbatches and samples_per_microbatch must be >= 1")

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    @property
    def samples_per_iteration(self) -> int:
        return self.microbatches * self.samples_per_microbatch

    @classmethod
    def from_profile(
        cls, profile: Profile, *, microbatches: int, schedule: str = "1f1b"
    ) -> LayerCosts:
        """A profile's layers (per micro-batch of ``profile.microbatch`` samples)."""
        layers = profile.layers
        return cls(
            forward_s=tuple(x.forward_s for x in layers),
            backward_s=tuple(x.backward_s for x in layers),
            activation_bytes=tuple(int(x.activation_bytes) for x in layers),
            gradient_bytes=tuple(int(x.gradient_bytes) for x in layers),
            update_s=tuple(x.update_s for x in layers),
            microbatches=microbatches,
            samples_per_microbatch=profile.microbatch,
            schedule=schedule,
        )

    def cost_model(self, bounds: Sequence[int], bandwidth_Bps: Sequence[float]) -> CostModel:
        """The simulator's costs of partition ``bounds`` with link ``s <-> s + 1`` at
        ``bandwidth_Bps[s]`` in both directions (inf: free)."""
        stages = len(bounds) - 1
        if (
            bounds[0] != 0
            or bounds[-1] != self.num_layers
            or any(a >= b for a, b in itertools.pairwise(bounds))
        ):
            raise PlanError(
                f"LayerCosts: {list(bounds)} is not a partition of {self.num_layers} layers "
                "(increasing, from 0 to the layer count)"
            )
        if len(bandwidth_Bps) != stages - 1:
            raise PlanError(
                f"LayerCosts: {len(bandwidth_Bps)} bandwidths for {stages - 1} stage boundaries"
            )

        def per_stage(values: Sequence[float]) -> list[float]:
            return [float(sum(values[bounds[s] : bounds[s + 1]])) for s in range(stages)]

        links = {}
        for s, bw in enumerate(bandwidth_Bps):
            links[(s, s + 1)] = links[(s + 1, s)] = (float(bw), 0.0)
        return CostModel(
            forward_s=[per_stage(self.forward_s)],
            backward_s=[per_stage(self.backward_s)],
            update_s=[per_stage(self.update_s)] if self.update_s else (),
            activation_bytes=[[self.activation_bytes[bounds[s + 1] - 1] for s in range(stages)]],
            gradient_bytes=[[self.gradient_bytes[bounds[s]] for s in range(stages)]],
            links=links,
            samples_per_microbatch=self.samples_per_microbatch,
        )


@functools.lru_cache(maxsize=64)
def _schedule(name: str, stages: int, microbatches: int) -> Schedule:
    return build_schedule(name, stages=stages, microbatches=microbatches)


def iteration_times(
    costs: LayerCosts,
    bounds: Sequence[int],
    slowdown: npt.ArrayLike,
    bandwidth_Bps: npt.ArrayLike,
) -> FloatArray:
    """Seconds of each iteration of partition ``bounds``: ``slowdown`` is ``(K, stages)``,
    ``bandwidth_Bps`` ``(K, stages - 1)`` (inf: unlimited); returns ``(K,)``."""
    slow = np.asarray(slowdown, dtype=np.float64)
    stages = len(bounds) - 1
    bws = np.asarray(bandwidth_Bps, dtype=np.float64).reshape(len(slow), stages - 1)
    if slow.ndim != 2 or slow.shape[1] != stages:
        raise PlanError(f"iteration_times: slowdown must be (K, {stages}) (got {slow.shape})")
    schedule = _schedule(costs.schedule, stages, costs.microbatches)
    out = np.empty(len(slow))
    start = 0
    while start < len(slow):
        end = start + 1
        while end < len(slow) and np.array_equal(bws[end], bws[start]):
            end += 1
        model = costs.cost_model(bounds, [float(b) for b in bws[start]])
        result = simulate_iterations(schedule, model, end - start, slowdown=slow[start:end])
        out[start:end] = result.iteration_s
        start = end
    return out


def unlimited(stages: int, iterations: int = 1) -> FloatArray:
    """``(iterations, stages - 1)`` bandwidths that never bind."""
    return np.full((iterations, max(stages - 1, 0)), math.inf)
