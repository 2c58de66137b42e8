"""What a layer migration costs the pipeline: `MigrationCost`, fitted from measurements.

A stop-and-copy move (migration part 1) stalls every stage for the time the state
takes to cross plus a fixed part (agreeing, checking digests, rebuilding the stage,
the shape handshake): ``stall = fixed_s + bytes / (efficiency x bandwidth)``.

A streamed move (`adaptipe.runtime.streamed`) stalls the switch only briefly, but the
iterations it streams through pay for what the stages do to send, check and replay the
state: ``cost = stream_fixed_s + stream_s_per_byte x (state + one step's log)`` seconds
of training lost in all. It can only catch up while the gradient log takes at most
``log_share`` of the link's spare bandwidth.

A restart (PipeDream-Re: stop, checkpoint, start again on the new partition) costs
``restart_s`` whatever moves: the processes, the checkpoint round trip and the pipeline
warm-up dominate.

The simulator and the controllers price a switch with these, the way the runtime pays
it; `MigrationCost.fit` and `MigrationCost.fit_streamed` take what
``bench/bench_migration.py`` measures, and `choose_transfer` is the crossover that
``[adapt] transfer = "auto"`` follows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from adaptipe.errors import PlanError

__all__ = ["UNMEASURED_BPS", "MigrationCost", "choose_transfer", "layer_owners", "moved_layers"]

UNMEASURED_BPS = 1e9
"""A link no telemetry measured is priced at 1 GB/s (about loopback gloo's here)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MigrationCost:
    """What moves cost (see the module doc).

    The defaults are ``bench/bench_migration.py``'s fit on this 2-core machine (zoo GPT
    with 4.8 MB and 76 MB of state moving, loopback; ``bench/results/``,
    docs/benchmarks.md); fit your own with `fit` and `fit_streamed`.
    """

    fixed_s: float = 0.0239
    efficiency: float = 1.30  # a move's throughput over the link's measured bandwidth
    stream_fixed_s: float = 0.0281
    stream_s_per_byte: float = 3.81e-9
    log_share: float = 0.8
    # bench_migration's restarts took 3.9-5.2 s on this machine (its two restart runs:
    # median switch spans 3.9 s and 5.2 s, worst stalls 4.0 s and 4.9 s): their middle
    restart_s: float = 4.5

    def __post_init__(self) -> None:
        if not (self.fixed_s >= 0 and math.isfinite(self.fixed_s)):
            raise PlanError(f"MigrationCost.fixed_s must be >= 0 (got {self.fixed_s})")
        if not self.efficiency > 0:
            raise PlanError(f"MigrationCost.efficiency must be > 0 (got {self.efficiency})")
        if not (self.restart_s >= 0 and math.isfinite(self.restart_s)):
            raise PlanError(f"MigrationCost.restart_s must be >= 0 (got {self.restart_s})")

    def stall_s(self, nbytes: int, bandwidth_Bps: float) -> float:
        """The seconds a move of ``nbytes`` over a ``bandwidth_Bps`` link stalls training."""
        if nbytes <= 0:
            return 0.0
        if not bandwidth_Bps > 0:
            raise PlanError(f"bandwidth must be > 0 (got {bandwidth_Bps})")
        return self.fixed_s + nbytes / (self.efficiency * bandwidth_Bps)

    def switch_s(self, method: str, nbytes: int, bandwidth_Bps: float) -> float:
        """The seconds a switch moving ``nbytes`` of state over a ``bandwidth_Bps`` link
        stalls training: ``"live"`` a stop-and-copy move (`stall_s`), ``"restart"`` a
        restart on the new partition (``restart_s``, whatever the bytes)."""
        if method == "live":
            return self.stall_s(nbytes, bandwidth_Bps)
        if method == "restart":
            return self.restart_s
        raise PlanError(f"switch method must be 'live' or 'restart' (got {method!r})")

    def streamed_s(self, state_bytes: int, log_bytes: int) -> float:
        """The training seconds a streamed move of ``state_bytes`` (its gradient log
        ``log_bytes`` a step) costs in all: the streaming iterations' slowdown and the
        switch."""
        if state_bytes <= 0:
            return 0.0
        return self.stream_fixed_s + self.stream_s_per_byte * (state_bytes + log_bytes)

    def fit_streamed(self, samples: Sequence[tuple[int, float]]) -> MigrationCost:
        """This model with ``stream_fixed_s`` and ``stream_s_per_byte`` fitted by least
        squares on ``(bytes streamed, training seconds lost)`` samples of streamed moves."""
        fixed, slope = _line(
            [float(b) for b, _ in samples], [s for _, s in samples], "fit_streamed"
        )
        return replace(self, stream_fixed_s=max(fixed, 0.0), stream_s_per_byte=slope)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float, float]]) -> MigrationCost:
        """Least squares over ``(bytes, bandwidth_Bps, stall_s)`` samples: stall against
        bytes / bandwidth, the intercept being ``fixed_s`` (clipped at 0)."""
        fixed, slope = _line([b / bw for b, bw, _ in samples], [s for _, _, s in samples], "fit")
        return cls(fixed_s=max(fixed, 0.0), efficiency=1.0 / slope)

    def to_json(self) -> dict[str, Any]:
        return {
            "fixed_s": self.fixed_s,
            "efficiency": self.efficiency,
            "stream_fixed_s": self.stream_fixed_s,
            "stream_s_per_byte": self.stream_s_per_byte,
            "log_share": self.log_share,
            "restart_s": self.restart_s,
        }


def _line(xs: Sequence[float], ys: Sequence[float], what: str) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b), with b > 0."""
    if len(xs) < 2:
        raise PlanError(f"MigrationCost.{what} needs at least 2 samples (got {len(xs)})")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise PlanError(f"MigrationCost.{what} needs samples of different sizes or bandwidths")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    if slope <= 0:
        raise PlanError(f"MigrationCost.{what}: the cost does not grow with the bytes moved")
    return my - slope * mx, slope


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
    log keeps up within the spare bandwidth and streaming costs training less than
    copying the whole state at the boundary."""
    if state_bytes <= 0 or not bandwidth_Bps > 0:
        return "stop_and_copy"
    spare = bandwidth_Bps * max(1.0 - comm_share, 0.05)
    fits = log_bytes <= cost.log_share * spare * iteration_s
    cheaper = cost.streamed_s(state_bytes, log_bytes) < cost.stall_s(state_bytes, bandwidth_Bps)
    return "streamed" if fits and cheaper else "stop_and_copy"


def moved_layers(old: Sequence[int], new: Sequence[int]) -> list[int]:
    """The layers whose stage differs between layer bounds ``old`` and ``new``."""
    if len(old) != len(new) or old[0] != new[0] or old[-1] != new[-1]:
        raise PlanError(f"bounds {list(old)} and {list(new)} are not of one pipeline")
    was, now = layer_owners(old), layer_owners(new)
    return [old[0] + i for i, (a, b) in enumerate(zip(was, now, strict=True)) if a != b]


def layer_owners(bounds: Sequence[int]) -> list[int]:
    """Per layer from ``bounds[0]`` on: the stage of ``bounds`` holding it."""
    return [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
