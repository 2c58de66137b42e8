"""What a layer migration costs the pipeline: `MigrationCost`, fitted from measurements.

A stop-and-copy move (migration part 1) stalls every stage for the time the state
takes to cross plus a fixed part (agreeing, checking digests, rebuilding the stage,
the shape handshake): ``stall = fixed_s + bytes / (efficiency x bandwidth)``. The
simulator and the controllers price a switch with it, the way the runtime pays it;
`MigrationCost.fit` takes (bytes, link bandwidth, measured stall) triples, such as
``bench/bench_migration.py`` prints, and fits the two constants by least squares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adaptipe.errors import PlanError

__all__ = ["UNMEASURED_BPS", "MigrationCost", "choose_transfer", "moved_layers"]

UNMEASURED_BPS = 1e9
"""A link no telemetry measured is priced at 1 GB/s (about loopback gloo's here)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MigrationCost:
    """``stall_s = fixed_s + bytes / (efficiency x bandwidth)``.

    The defaults are session 10's stop-and-copy figures for the zoo GPT on loopback
    (2.38 MB in 13 ms of transfer within a 26-29 ms stall); fit your own with `fit`.
    """

    fixed_s: float = 0.015
    efficiency: float = 1.0  # share of the link's bandwidth a move achieves
    # A streamed move (`adaptipe.runtime.streamed`) stalls the switch for its last
    # logged step: ``stream_fixed_s + log_bytes / (efficiency x bandwidth)``; it can
    # only catch up when the log takes at most ``log_share`` of the spare bandwidth.
    stream_fixed_s: float = 0.03
    log_share: float = 0.5

    def __post_init__(self) -> None:
        if not (self.fixed_s >= 0 and math.isfinite(self.fixed_s)):
            raise PlanError(f"MigrationCost.fixed_s must be >= 0 (got {self.fixed_s})")
        if not self.efficiency > 0:
            raise PlanError(f"MigrationCost.efficiency must be > 0 (got {self.efficiency})")

    def stall_s(self, nbytes: int, bandwidth_Bps: float) -> float:
        """The seconds a move of ``nbytes`` over a ``bandwidth_Bps`` link stalls training."""
        if nbytes <= 0:
            return 0.0
        if not bandwidth_Bps > 0:
            raise PlanError(f"bandwidth must be > 0 (got {bandwidth_Bps})")
        return self.fixed_s + nbytes / (self.efficiency * bandwidth_Bps)

    def streamed_stall_s(self, log_bytes: int, bandwidth_Bps: float) -> float:
        """The seconds a streamed move's switch stalls training (its last logged step)."""
        if not bandwidth_Bps > 0:
            raise PlanError(f"bandwidth must be > 0 (got {bandwidth_Bps})")
        return self.stream_fixed_s + log_bytes / (self.efficiency * bandwidth_Bps)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float, float]]) -> MigrationCost:
        """Least squares over ``(bytes, bandwidth_Bps, stall_s)`` samples: stall against
        bytes / bandwidth, the intercept being ``fixed_s`` (clipped at 0)."""
        if len(samples) < 2:
            raise PlanError(f"MigrationCost.fit needs at least 2 samples (got {len(samples)})")
        xs = [b / bw for b, bw, _ in samples]
        ys = [s for _, _, s in samples]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            raise PlanError("MigrationCost.fit needs samples of different sizes or bandwidths")
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        if slope <= 0:
            raise PlanError("MigrationCost.fit: the stall does not grow with the bytes moved")
        return cls(fixed_s=max(my - slope * mx, 0.0), efficiency=1.0 / slope)

    def to_json(self) -> dict[str, Any]:
        return {
            "fixed_s": self.fixed_s,
            "efficiency": self.efficiency,
            "stream_fixed_s": self.stream_fixed_s,
            "log_share": self.log_share,
        }


def choose_transfer(
    cost: MigrationCost,
    *,
    state_bytes: int,
    log_bytes: int,
    bandwidth_Bps: float,
    iteration_s: float,
    comm_share: float,
) -> str:
    """``"streamed"`` or ``"stop_and_copy"`` for a move of ``state_bytes`` whose gradient
    log is ``log_bytes`` a step, over a link of ``bandwidth_Bps`` that the pipeline's own
    traffic keeps busy ``comm_share`` of an ``iteration_s`` iteration: streamed when the
    log keeps up within the spare bandwidth and its switch stalls less than copying the
    whole state at the boundary."""
    if state_bytes <= 0 or not bandwidth_Bps > 0:
        return "stop_and_copy"
    spare = bandwidth_Bps * max(1.0 - comm_share, 0.05)
    fits = log_bytes <= cost.log_share * spare * iteration_s
    faster = cost.streamed_stall_s(log_bytes, bandwidth_Bps) < cost.stall_s(
        state_bytes, bandwidth_Bps
    )
    return "streamed" if fits and faster else "stop_and_copy"


def moved_layers(old: Sequence[int], new: Sequence[int]) -> list[int]:
    """The layers whose stage differs between layer bounds ``old`` and ``new``."""
    if len(old) != len(new) or old[0] != new[0] or old[-1] != new[-1]:
        raise PlanError(f"bounds {list(old)} and {list(new)} are not of one pipeline")

    def owner(bounds: Sequence[int], layer: int) -> int:
        return next(s for s in range(len(bounds) - 1) if bounds[s] <= layer < bounds[s + 1])

    return [i for i in range(old[0], old[-1]) if owner(old, i) != owner(new, i)]
