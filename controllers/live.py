"""A controller live in the manager: the `Decider` that `adaptipe.runtime.adapt_loop`
calls, built from a run's ``[adapt]`` by `decider`.

Each call builds an `Observation` (`observe`) from the telemetry since the last plan
change, under the partition in force, and asks the controller (``[adapt].controller``:
`Threshold` with ``[adapt]``'s margin, patience, cooldown, max_per_hour and horizon) to
decide. The verdict carries what it decided on: the measured iteration time, the best
partition DynPipe's planner predicts on the measured slowdowns, and those slowdowns.

The per-layer baseline is the run's ``profile.json`` when it has one. A run planned
without a profile (an even or a given partition) has none; profiling the model in the
manager would compete with the workers for the cores, so the first window the loop
observes becomes the baseline: per layer, the median of the measured forward and
backward seconds (bytes unknown: 0, so a move is priced at the cost model's fixed
stall). Slowdowns are then relative to how the run started.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from adaptipe.controllers.base import Controller, Keep
from adaptipe.controllers.observation import Observation, observe
from adaptipe.controllers.replan import best_partition, predicted_time, stage_slowdowns
from adaptipe.controllers.threshold import Threshold, ThresholdSettings
from adaptipe.monitor.schema import Record
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import LayerProfile, Profile
from adaptipe.runtime.adapt_config import AdaptSection
from adaptipe.runtime.adapt_loop import Verdict
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir
from adaptipe.serial import load_json_file

__all__ = ["LiveDecider", "decider", "from_settings"]


def from_settings(adapt: AdaptSection) -> Controller:
    """The controller ``[adapt].controller`` names, with ``[adapt]``'s settings."""
    if adapt.controller == "threshold":
        settings = ThresholdSettings(
            margin=adapt.margin,
            patience=adapt.patience,
            cooldown=adapt.cooldown,
            max_per_hour=adapt.max_per_hour,
            horizon=adapt.horizon,
        )
        return Threshold(settings)
    return Keep()


class LiveDecider:
    """Observe, then decide (see the module doc); one call at a time."""

    def __init__(
        self, controller: Controller, profile: Profile | None, *, window: int, workers: int
    ) -> None:
        self.controller, self.profile = controller, profile
        self.name = controller.name
        self.window, self.workers = window, workers

    def __call__(self, records: Sequence[Record], partition: Partition) -> Verdict:
        if self.profile is None:
            self.profile = baseline(records, partition, window=self.window, workers=self.workers)
        obs = observe(records, self.profile, partition, window=self.window, workers=self.workers)
        decision = self.controller.decide(obs)
        return Verdict(bounds=decision.bounds, decision=decision.to_json(), inputs=inputs(obs))


def decider(run: RunDir, cfg: RunConfig) -> LiveDecider:
    """The `DeciderFactory` for ``adaptipe train`` and ``adaptipe manage``."""
    profile = (
        load_json_file(run.profile_json, Profile.from_json) if run.profile_json.exists() else None
    )
    return LiveDecider(
        from_settings(cfg.adapt),
        profile,
        window=cfg.adapt.window,
        workers=cfg.pipeline.stages,
    )


def inputs(obs: Observation) -> dict[str, Any]:
    """What a decision is logged with: the measured iteration, the partition in force
    and the best one as the planner predicts them on the measured slowdowns (milliseconds
    per iteration), the best partition and the per-stage slowdowns."""
    slow = stage_slowdowns(obs)
    bounds, best = best_partition(obs, slow)
    measured = (
        statistics.median(max(row) for row in obs.stage_iteration_s)
        if obs.stage_iteration_s
        else None
    )
    current = predicted_time(obs, obs.bounds, slow)
    return {
        "measured_ms": round(measured * 1e3, 3) if measured is not None else None,
        "in_force_ms": round(current * 1e3, 3) if math.isfinite(current) else None,
        "predicted_best_ms": round(best * 1e3, 3) if math.isfinite(best) else None,
        "best_bounds": list(bounds),
        "slowdowns": [round(s, 3) for s in slow],
        "window": list(obs.iterations[:1] + obs.iterations[-1:]),
    }


def baseline(
    records: Sequence[Record], partition: Partition, *, window: int, workers: int
) -> Profile:
    """A profile of measured per-layer seconds: the median over the last ``window``
    complete iterations in ``records`` (bytes 0; see the module doc)."""
    zero = LayerProfile(
        name="",
        kind="measured",
        forward_s=0.0,
        backward_s=0.0,
        activation_bytes=0,
        gradient_bytes=0,
        saved_bytes=0,
        param_bytes=0,
        optimizer_bytes=0,
        num_params=0,
    )
    blank = Profile(
        model=partition.model,
        microbatch=1,
        device="measured",
        layers=(zero,) * partition.num_layers,
    )
    obs = observe(records, blank, partition, window=window, workers=workers)

    def median(rows: Sequence[Sequence[float]], layer: int) -> float:
        seen = [row[layer] for row in rows if math.isfinite(row[layer])]
        return statistics.median(seen) if seen else 0.0

    layers = tuple(
        LayerProfile(
            name=f"layer{i}",
            kind="measured",
            forward_s=median(obs.measured_forward_s, i),
            backward_s=median(obs.measured_backward_s, i),
            activation_bytes=0,
            gradient_bytes=0,
            saved_bytes=0,
            param_bytes=0,
            optimizer_bytes=0,
            num_params=0,
        )
        for i in range(partition.num_layers)
    )
    meta = {"baseline": f"measured, iterations {obs.iterations[0]}-{obs.iterations[-1]}"}
    return Profile(model=partition.model, microbatch=1, device="measured", layers=layers, meta=meta)
