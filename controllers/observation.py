"""What a re-partitioning controller sees: `Observation`, built from the run's telemetry.

Every controller (the threshold rule, the learned ones, the gymnasium environments'
agents) decides from the same plain record, so one built from a live run's telemetry
and one built from a simulated trace are interchangeable. It holds:

- **static per-layer metrics** from the run's profile: forward and backward seconds,
  the bytes a stage boundary after the layer carries, and the bytes of the layer's
  state (parameters and optimizer state: what moving it costs);
- **the last ``window`` iterations** of what the stages measured: per-layer forward and
  backward seconds per micro-batch (telemetry's ``stage_stats`` records carry each
  layer's sum over an iteration's ``microbatches``, by global layer index, so they
  survive a re-partition; the profile's are per micro-batch too), per-stage compute and
  iteration seconds;
- **per-link bandwidth** (``link_sample`` records, the smoothed estimate): the newest
  sample per (src, dst);
- **device status**: each stage's latest device sample as the fixed feature vector of
  `adaptipe.monitor.features`;
- **the partition in force** (layer bounds) and the iteration it was observed at.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.monitor.schema import DeviceSample, LinkSample, Record, StageStats
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile

__all__ = ["Observation", "observe"]

OBSERVATION_KIND = "observation"
OBSERVATION_VERSION = 1

Rows = tuple[tuple[float, ...], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """One decision point's view of a running pipeline (see the module doc)."""

    iteration: int  # the last iteration every stage has reported
    bounds: tuple[int, ...]  # the partition in force
    layer_forward_s: tuple[float, ...]  # profiled, per layer
    layer_backward_s: tuple[float, ...]
    boundary_bytes: tuple[int, ...]  # bytes a stage boundary after the layer carries
    state_bytes: tuple[int, ...]  # parameters + optimizer state per layer
    iterations: tuple[int, ...] = ()  # the window's iterations, oldest first
    measured_forward_s: Rows = ()  # [window][layer]; NaN where no stage reported it
    measured_backward_s: Rows = ()
    stage_compute_s: Rows = ()  # [window][worker]
    stage_iteration_s: Rows = ()
    link_bandwidth_Bps: Mapping[str, float] = field(default_factory=dict)  # "src-dst"
    device: Rows = ()  # [worker]: the latest device sample's features
    microbatches: int = 1  # per iteration: a planner's cycle times this is an iteration

    @classmethod
    def from_profile(
        cls,
        profile: Profile,
        bounds: Sequence[int],
        *,
        microbatches: int = 1,
        link_bandwidth_Bps: Mapping[str, float] | None = None,
    ) -> Observation:
        """What the profile alone says of partition ``bounds``, nothing measured yet (the
        planner's view before a run; `observe` adds the measurements)."""
        return cls(
            iteration=0,
            bounds=tuple(int(b) for b in bounds),
            layer_forward_s=tuple(layer.forward_s for layer in profile.layers),
            layer_backward_s=tuple(layer.backward_s for layer in profile.layers),
            boundary_bytes=_boundary_bytes(profile),
            state_bytes=tuple(
                int(layer.param_bytes + layer.optimizer_bytes) for layer in profile.layers
            ),
            link_bandwidth_Bps=dict(link_bandwidth_Bps or {}),
            microbatches=microbatches,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_forward_s)

    def boundary_bandwidth_Bps(self, s: int) -> float:
        """Stage boundary ``s``'s bandwidth (between stages s and s + 1): the slower of
        its two directions measured, since activations cross one way and gradients the
        other (DynPipe Eq. 7 prices both); inf where neither is measured."""
        pairs = (f"{s}-{s + 1}", f"{s + 1}-{s}")
        got = [self.link_bandwidth_Bps[k] for k in pairs if self.link_bandwidth_Bps.get(k, 0) > 0]
        return min(got) if got else math.inf

    def boundary_bandwidths(self) -> tuple[float, ...]:
        """`boundary_bandwidth_Bps` of every stage boundary, in pipeline order."""
        return tuple(self.boundary_bandwidth_Bps(s) for s in range(self.num_stages - 1))

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": OBSERVATION_KIND,
            "version": OBSERVATION_VERSION,
            "iteration": self.iteration,
            "bounds": list(self.bounds),
            "layer_forward_s": list(self.layer_forward_s),
            "layer_backward_s": list(self.layer_backward_s),
            "boundary_bytes": list(self.boundary_bytes),
            "state_bytes": list(self.state_bytes),
            "iterations": list(self.iterations),
            "measured_forward_s": [list(r) for r in self.measured_forward_s],
            "measured_backward_s": [list(r) for r in self.measured_backward_s],
            "stage_compute_s": [list(r) for r in self.stage_compute_s],
            "stage_iteration_s": [list(r) for r in self.stage_iteration_s],
            "link_bandwidth_Bps": dict(self.link_bandwidth_Bps),
            "device": [list(r) for r in self.device],
            "microbatches": self.microbatches,
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "observation") -> Observation:
        if not isinstance(data, dict) or data.get("kind") != OBSERVATION_KIND:
            raise PlanError(f"{source}: not an observation")
        if data.get("version") != OBSERVATION_VERSION:
            raise PlanError(f"{source}: observation version {data.get('version')} is not 1")
        try:

            def rows(key: str) -> Rows:
                return tuple(tuple(float(v) for v in row) for row in data.get(key, []))

            return cls(
                iteration=int(data["iteration"]),
                bounds=tuple(int(b) for b in data["bounds"]),
                layer_forward_s=tuple(float(v) for v in data["layer_forward_s"]),
                layer_backward_s=tuple(float(v) for v in data["layer_backward_s"]),
                boundary_bytes=tuple(int(v) for v in data["boundary_bytes"]),
                state_bytes=tuple(int(v) for v in data["state_bytes"]),
                iterations=tuple(int(v) for v in data.get("iterations", [])),
                measured_forward_s=rows("measured_forward_s"),
                measured_backward_s=rows("measured_backward_s"),
                stage_compute_s=rows("stage_compute_s"),
                stage_iteration_s=rows("stage_iteration_s"),
                link_bandwidth_Bps={
                    str(k): float(v) for k, v in data.get("link_bandwidth_Bps", {}).items()
                },
                device=rows("device"),
                microbatches=int(data.get("microbatches", 1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{source}: malformed observation ({exc})") from None


def observe(
    records: Iterable[Record],
    profile: Profile,
    partition: Partition,
    *,
    window: int = 8,
    workers: int | None = None,
    microbatches: int = 1,
) -> Observation:
    """The observation after ``records`` (telemetry, oldest first): the last ``window``
    iterations that every stage has reported, under ``partition``. ``workers``: the
    stage processes (default: one per partition stage; fewer with interleaved chunks);
    ``microbatches``: per iteration (the measured per-layer sums are divided by it).

    Raises `PlanError` when the profile does not describe the partition's model or no
    iteration has been reported by every stage yet.
    """
    if window < 1:
        raise PlanError(f"observe: window must be >= 1 (got {window})")
    if len(profile.layers) != partition.num_layers:
        raise PlanError(
            f"observe: the profile has {len(profile.layers)} layers, the partition "
            f"{partition.num_layers}"
        )
    stages = partition.num_stages if workers is None else workers
    by_iteration: dict[int, dict[int, StageStats]] = {}
    links: dict[str, list[tuple[float, float]]] = {}
    device: dict[int, DeviceSample] = {}
    for rec in records:
        if isinstance(rec, StageStats):
            by_iteration.setdefault(rec.iteration, {})[rec.stage] = rec
        elif isinstance(rec, LinkSample):
            links.setdefault(f"{rec.src}-{rec.dst}", []).append((rec.time_s, rec.bandwidth_Bps))
        elif isinstance(rec, DeviceSample) and (
            rec.stage not in device or rec.time_s >= device[rec.stage].time_s
        ):
            device[rec.stage] = rec
    complete = sorted(it for it, got in by_iteration.items() if len(got) >= stages)
    if not complete:
        raise PlanError("observe: no iteration has been reported by every stage yet")
    chosen = complete[-window:]
    layers = len(profile.layers)
    if microbatches < 1:
        raise PlanError(f"observe: microbatches must be >= 1 (got {microbatches})")
    fwd = tuple(_per_layer(by_iteration[it], layers, "forward_s", microbatches) for it in chosen)
    bwd = tuple(_per_layer(by_iteration[it], layers, "backward_s", microbatches) for it in chosen)
    compute = tuple(
        tuple(float(by_iteration[it][s].compute_s) for s in range(stages)) for it in chosen
    )
    iteration_s = tuple(
        tuple(float(by_iteration[it][s].iteration_s) for s in range(stages)) for it in chosen
    )
    # each sample is already the link's estimate (`adaptipe.monitor.bandwidth.LinkTimer`):
    # a mean over the window on top lagged a throttled link's onset by several iterations
    bandwidth = {pair: max(samples)[1] for pair, samples in links.items()}
    return replace(
        Observation.from_profile(profile, partition.bounds, microbatches=microbatches),
        iteration=chosen[-1],
        iterations=tuple(chosen),
        measured_forward_s=fwd,
        measured_backward_s=bwd,
        stage_compute_s=compute,
        stage_iteration_s=iteration_s,
        link_bandwidth_Bps=bandwidth,
        device=_device_rows(device, stages),
    )


def _boundary_bytes(profile: Profile) -> tuple[int, ...]:
    """Per layer i: what a stage boundary after it carries, its output forward plus the
    gradient into layer i + 1 back (DynPipe Eq. 7); the last layer's is its output."""
    layers = profile.layers
    return tuple(
        int(layer.activation_bytes + (layers[i + 1].gradient_bytes if i + 1 < len(layers) else 0))
        for i, layer in enumerate(layers)
    )


def _per_layer(
    stats: Mapping[int, StageStats], layers: int, attr: str, microbatches: int
) -> tuple[float, ...]:
    out = [float("nan")] * layers
    for rec in stats.values():
        for i, value in enumerate(getattr(rec, attr)):
            if 0 <= rec.first_layer + i < layers:
                out[rec.first_layer + i] = float(value) / microbatches
    return tuple(out)


def _device_rows(device: Mapping[int, DeviceSample], stages: int) -> Rows:
    from adaptipe.monitor.features import FEATURES, feature_vector

    zero = (0.0,) * len(FEATURES)
    return tuple(
        tuple(float(v) for v in feature_vector(device[s])) if s in device else zero
        for s in range(stages)
    )
