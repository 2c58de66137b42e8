"""The threshold controller: re-partition when the pipeline runs clearly slower than the
best partition would, for long enough, and the gain pays for the move.

At each check it compares the time the partition in force takes on the measured
per-layer times (DynPipe's Eq. 4-5 over each stage's measured slowdown: the bottleneck
stage's measured time, through the planner's model) with what the planner predicts for
the best partition, each candidate's layers scaled by the slowdown of the stage that
would hold them (`adaptipe.controllers.replan`). Both sides go through one model, so
what the model leaves out (framework overhead, waits) cannot pass for a gain; the
measured iteration time is reported beside them. It moves when

- the partition in force takes longer than the best by more than ``margin`` at
  ``patience`` consecutive checks,
- the best partition differs from the one in force,
- the predicted gain over ``horizon`` iterations exceeds the move's stall
  (`adaptipe.sim.migration.MigrationCost` on the moving layers' state and the slowest
  link the moves cross),
- no move came in the last ``cooldown`` iterations and fewer than ``max_per_hour``
  moves in the last hour.

A check whose measured iteration is more than ``unexplained`` times what the model puts
the partition in force at, against the usual factor, waits for the telemetry of what
slowed it (`adaptipe.controllers.model_lag`): it neither counts toward ``patience`` nor
breaks it.

With a `Recall` (live runs, ``[adapt].recall``) the partitions the run has held are
ranked beside the planner's best at what they measured (`adaptipe.controllers.recall`):
the best is the least of them, and a move back to one is judged by the same rules.

Every decision says why, with the numbers it compared.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adaptipe.controllers.base import Decision
from adaptipe.controllers.model_lag import ModelLag
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.recall import Recall, measured_iteration_s
from adaptipe.controllers.replan import best_partition, predicted_time, stage_slowdowns
from adaptipe.errors import PlanError
from adaptipe.sim.migration import MigrationCost, moved_layers

__all__ = ["UNMEASURED_BPS", "Threshold", "ThresholdSettings"]

UNMEASURED_BPS = 1e9
"""A link no telemetry measured is priced at 1 GB/s (about loopback gloo's here)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ThresholdSettings:
    # the partition in force over the best, beyond 1: the planner erred by up to 16%
    # between neighbouring cuts on measured times here (bench/bench_adaptive.py)
    margin: float = 0.20
    patience: int = 3  # consecutive checks over the margin (K)
    cooldown: int = 20  # iterations after a move before the next
    max_per_hour: int = 6
    horizon: int = 100  # iterations a move's gain is counted over
    # measured over modelled beyond this many times its usual: wait a check for the
    # telemetry (`adaptipe.controllers.model_lag`); 0 never waits
    unexplained: float = 2.0

    def __post_init__(self) -> None:
        for name, low in (("patience", 1), ("cooldown", 0), ("max_per_hour", 1), ("horizon", 1)):
            if getattr(self, name) < low:
                raise PlanError(f"threshold: {name} must be >= {low} (got {getattr(self, name)})")
        if not self.margin >= 0:
            raise PlanError(f"threshold: margin must be >= 0 (got {self.margin})")
        if not (self.unexplained == 0 or self.unexplained > 1):
            raise PlanError(f"threshold: unexplained must be 0 or > 1 (got {self.unexplained})")


class Threshold:
    """See the module doc. ``clock`` (seconds) counts moves per hour; ``recall``
    remembers what the partitions held measured (None: the planner alone)."""

    name = "threshold"

    def __init__(
        self,
        settings: ThresholdSettings = ThresholdSettings(),
        *,
        cost: MigrationCost | None = None,
        clock: Callable[[], float] = time.monotonic,
        recall: Recall | None = None,
    ) -> None:
        self.settings, self._clock = settings, clock
        self.recall = recall
        self.cost = cost if cost is not None else MigrationCost()
        self._over = 0  # consecutive checks over the margin
        self._last_move: int | None = None  # iteration of the last move
        self._moves: deque[float] = deque()  # clock times of the moves
        self.lag = ModelLag(settings.unexplained)

    def decide(self, obs: Observation) -> Decision:
        s = self.settings
        measured = measured_iteration_s(obs)
        if measured is None:
            return Decision(reason="nothing measured yet")
        slow = stage_slowdowns(obs)
        bounds, best = best_partition(obs, slow)
        # the planner's cycle per micro-batch, times the micro-batches: an iteration
        best *= obs.microbatches
        current = predicted_time(obs, obs.bounds, slow) * obs.microbatches
        recalled = ""
        if self.recall is not None:
            self.recall.observe(obs, slow)
            bounds, best, recalled = self._recalled(obs, slow, bounds, best, current)
        ratio = current / best if best > 0 else math.inf
        seen = (
            f"in force {current * 1e3:.1f} ms (iteration measured {measured * 1e3:.1f} ms), "
            f"best {bounds} predicted {best * 1e3:.1f} ms{recalled}"
        )
        usual = self.lag.wait(measured, current)
        if usual is not None:
            return Decision(
                reason=f"{seen}: measured {measured / current:.1f}x the model's figure "
                f"against {usual:.1f}x at the checks before; waiting a check for the "
                f"telemetry of what slowed it ({self._over}/{s.patience} checks)"
            )
        self._over = self._over + 1 if ratio > 1 + s.margin else 0
        if self._over < s.patience:
            return Decision(reason=f"{seen}: within the margin {self._over}/{s.patience} checks")
        if bounds == tuple(obs.bounds):
            return Decision(reason=f"{seen}: the partition in force is the best")
        gain = current - best
        stall = self._stall(obs, bounds)
        if gain * s.horizon <= stall:
            return Decision(
                reason=f"{seen}: gain {gain * s.horizon:.3f} s over {s.horizon} iterations "
                f"does not pay the move's {stall:.3f} s"
            )
        if self._last_move is not None and obs.iteration - self._last_move < s.cooldown:
            return Decision(reason=f"{seen}: cooling down since iteration {self._last_move}")
        now = self._clock()
        while self._moves and now - self._moves[0] > 3600:
            self._moves.popleft()
        if len(self._moves) >= s.max_per_hour:
            return Decision(reason=f"{seen}: {s.max_per_hour} moves in the last hour already")
        self._over = 0
        self._last_move = obs.iteration
        self._moves.append(now)
        return Decision(
            bounds=bounds,
            predicted_gain_s=gain,
            reason=f"{seen}: {ratio:.2f}x for {s.patience} checks; gain {gain * 1e3:.1f} ms "
            f"per iteration against a {stall:.3f} s move",
        )

    def settled(self) -> bool:
        """No check is counting toward a move or waiting for the model
        (`adaptipe.controllers.unchanged`)."""
        return self._over == 0 and not self.lag.waited

    def state_dict(self) -> dict[str, Any]:
        """Checks over the margin, the last move, the moves of the last hour (as ages, so
        a resume in another process counts them from its own clock), the last checks'
        measured-over-modelled factors."""
        now = self._clock()
        out: dict[str, Any] = {
            "over": self._over,
            "last_move": self._last_move,
            "move_ages_s": [now - t for t in self._moves],
            **self.lag.state_dict(),
        }
        if self.recall is not None:
            out["recall"] = self.recall.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        now = self._clock()
        self._over = int(state.get("over", 0))
        last = state.get("last_move")
        self._last_move = int(last) if last is not None else None
        self._moves = deque(now - float(age) for age in state.get("move_ages_s", []))
        self.lag.load_state_dict(state)
        if self.recall is not None and isinstance(state.get("recall"), dict):
            self.recall.load_state_dict(state["recall"])

    def _recalled(
        self,
        obs: Observation,
        slow: tuple[float, ...],
        bounds: tuple[int, ...],
        best: float,
        current: float,
    ) -> tuple[tuple[int, ...], float, str]:
        """The best of the planner's best and the partitions held under these conditions
        (`Recall.known`), those at what they measured against what the partition in force
        measures now (`Recall.corrected`); and a note for the reason when that changed the
        planner's figure."""
        assert self.recall is not None
        options = {bounds: best}
        for known in self.recall.known(obs, slow):
            options[known] = predicted_time(obs, known, slow) * obs.microbatches
        scored = {
            b: self.recall.corrected(obs, b, t, in_force_s=current, slowdowns=slow)
            for b, t in options.items()
        }
        pick = min(scored, key=lambda b: (scored[b], b))
        if pick == bounds and scored[pick] == best:
            return bounds, best, ""
        note = (
            f" (recalled: the planner's best {bounds} {best * 1e3:.1f} ms, "
            f"{scored[bounds] * 1e3:.1f} ms by what it measured)"
        )
        return pick, scored[pick], note

    def _stall(self, obs: Observation, bounds: tuple[int, ...]) -> float:
        moving = moved_layers(obs.bounds, bounds)
        nbytes = sum(obs.state_bytes[i] for i in moving)
        slowest = min(obs.boundary_bandwidths(), default=math.inf)
        return self.cost.stall_s(nbytes, slowest if math.isfinite(slowest) else UNMEASURED_BPS)
