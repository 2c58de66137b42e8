"""Stage readings calibrated across partitions: what a stage's position costs.

A stage's measured slowdown (`adaptipe.controllers.replan.stage_slowdowns`: its layers'
measured seconds over their baseline) carries what the stage's place in the pipeline
costs as well as what slows it. A core that waited for its next block runs the block's
first operations slower (caches, clocks: a 50 us layer took 2-3x as long after a 10-15
ms wait on this machine), and the last stage's backward begins with the loss. Spread
over a stage of several layers that is a few percent; a stage left holding one small
layer reads 2-3x on a quiet machine: on bench_adaptive's CNN the last layer alone on
stage 1 read 2.8. A controller that reads that as interference never moves layers back
onto the stage once the cause of the move has ended.

`Positions` calibrates each partition by the move that made it. A stage is a worker on
its own device: what interferes with it (another job on its core, a throttled link) does
not change in the few iterations a move takes, so whatever its reading changed by
across the switch, its new place did: the new partition's *factor* for the stage is its
reading after the switch over its reading just before it (as calibrated then; the
smaller of its last two iterations', so a one-iteration spike does not count). From
then on the stage's measured seconds are divided by its factor, so every controller
decides on an observation in which a stage reads as it did before the move until its
conditions change. A stage that kept its layers keeps its factor; the partition a run
starts on has factor 1 everywhere (the baseline is measured against it). The factor is
estimated on the iterations after the switch's own (which pays for the move) and fixed
once ``settle`` of them are in (or have passed, where the window is smaller).

Where conditions do change during a move, the factor carries the change until the next
move: a throttle that ends in the iterations of the switch reads as the position's cost.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from adaptipe.controllers.observation import Observation
from adaptipe.controllers.replan import latest_ratios, stage_ratios
from adaptipe.errors import PlanError

__all__ = ["Positions"]

Bounds = tuple[int, ...]


def _same_layers(old: Bounds, new: Bounds) -> list[bool]:
    """Per stage of ``new``: whether it holds the layers it held under ``old``."""
    return [(old[s], old[s + 1]) == (new[s], new[s + 1]) for s in range(len(new) - 1)]


@dataclass(slots=True)
class Positions:
    """Per stage of the partition in force, the factor its position costs (see the
    module doc); `apply` gives the observation controllers decide on."""

    settle: int = 3
    _bounds: Bounds | None = None  # the partition in force at the last call
    _factors: tuple[float, ...] = ()  # per stage of _bounds
    _settled: bool = False
    _readings: tuple[float, ...] = ()  # per stage: calibrated, the last call's `latest_ratios`
    _before: tuple[float, ...] = ()  # ... the last call's before the move
    _before_bounds: Bounds | None = None
    _before_factors: tuple[float, ...] = ()
    _since: int = -1  # the first iteration seen after the move (its switch's own, at best)

    def __post_init__(self) -> None:
        if self.settle < 1:
            raise PlanError(f"positions: settle must be >= 1 (got {self.settle})")

    @property
    def factors(self) -> tuple[float, ...]:
        """Per stage of the partition in force (1.0 until it is calibrated)."""
        return self._factors

    def apply(self, obs: Observation) -> Observation:
        """``obs`` with each stage's measured seconds divided by its position's factor,
        after noting what the partition in force reads now."""
        bounds = tuple(obs.bounds)
        if self._bounds is None or len(bounds) != len(self._bounds):
            # the partition the run started on (or another stage count): the reference
            self._bounds, self._factors, self._settled = bounds, (1.0,) * obs.num_stages, True
        elif bounds != self._bounds:
            self._before, self._before_bounds = self._readings, self._bounds
            self._before_factors = self._factors
            self._bounds, self._settled = bounds, False
            self._factors = self._kept()
            self._since = obs.iterations[0] if obs.iterations else obs.iteration
        if not self._settled:
            self._calibrate(obs)
        out = _scaled(obs, self._factors)
        self._readings = tuple(latest_ratios(stage_ratios(out), obs.num_stages))
        return out

    def _kept(self) -> tuple[float, ...]:
        """Per stage of the new partition: its factor before the move where it kept its
        layers, else 1.0 (until calibrated)."""
        assert self._bounds is not None and self._before_bounds is not None
        same = _same_layers(self._before_bounds, self._bounds)
        return tuple(f if kept else 1.0 for f, kept in zip(self._before_factors, same, strict=True))

    def _calibrate(self, obs: Observation) -> None:
        """Each moved stage's factor: its raw reading since the switch (the switch's own
        iteration left out) over its calibrated reading before it."""
        assert self._before_bounds is not None
        keep = [k for k, it in enumerate(obs.iterations) if it > self._since]
        if not keep:
            return
        rows = stage_ratios(obs)
        factors = list(self._kept())
        same = _same_layers(self._before_bounds, tuple(obs.bounds))
        for s in range(obs.num_stages):
            if same[s] or s >= len(self._before):
                continue
            now = [rows[k][s] for k in keep if math.isfinite(rows[k][s])]
            before = self._before[s]
            if now and math.isfinite(before) and before > 0:
                factor = statistics.median(now) / before
                factors[s] = factor if math.isfinite(factor) and factor > 0 else 1.0
        self._factors = tuple(factors)
        # fixed once `settle` iterations are in, or have passed (a window smaller than that)
        self._settled = len(keep) >= self.settle or obs.iteration - self._since >= self.settle

    def state_dict(self) -> dict[str, Any]:
        def nums(values: Sequence[float]) -> list[float | None]:
            return [v if math.isfinite(v) else None for v in values]

        return {
            "bounds": list(self._bounds) if self._bounds is not None else None,
            "factors": list(self._factors),
            "settled": self._settled,
            "readings": nums(self._readings),
            "before": nums(self._before),
            "before_bounds": list(self._before_bounds) if self._before_bounds else None,
            "before_factors": list(self._before_factors),
            "since": self._since,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def nums(values: Any) -> tuple[float, ...]:
            return tuple(math.nan if v is None else float(v) for v in values or [])

        def bounds(value: Any) -> Bounds | None:
            return tuple(int(b) for b in value) if value else None

        self._bounds = bounds(state.get("bounds"))
        self._factors = nums(state.get("factors"))
        self._settled = bool(state.get("settled", True))
        self._readings = nums(state.get("readings"))
        self._before = nums(state.get("before"))
        self._before_bounds = bounds(state.get("before_bounds"))
        self._before_factors = nums(state.get("before_factors"))
        self._since = int(state.get("since", -1))


def _scaled(obs: Observation, factors: Sequence[float]) -> Observation:
    """``obs`` with every measured layer's seconds divided by its stage's factor."""
    if all(f == 1.0 for f in factors):
        return obs
    stages = itertools.pairwise(obs.bounds)
    per_layer = [f for f, (lo, hi) in zip(factors, stages, strict=True) for _ in range(lo, hi)]

    def scale(rows: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(v / f for v, f in zip(row, per_layer, strict=True)) for row in rows)

    return replace(
        obs,
        measured_forward_s=scale(obs.measured_forward_s),
        measured_backward_s=scale(obs.measured_backward_s),
    )
