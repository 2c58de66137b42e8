"""Baseline re-partitioning controllers: what a learned controller must beat.

Each reads the stages' slowdowns from an observation (`adaptipe.controllers.replan.
stage_slowdowns`), finds the best candidate partition under them
(`adaptipe.controllers.candidates.top_k`, simulated) and compares it with the partition
in force under the same simulator; they differ only in when they look and what they
believe:

- `AlwaysBest`: moves whenever the best candidate is predicted faster, no margin, no
  patience (DESIGN's "always switch").
- `Straggler`: moves when a stage's slowdown has doubled or halved since the partition
  was planned (the 2x / 0.5x straggler rule).
- `Stale`: `AlwaysBest` on the slowdowns it measured at its previous check (DynPipe's
  "DynPipe-w/o RF").
- `RestartAtEpoch`: re-partitions only at epoch boundaries, by restarting (DynPipe's
  "PipeDream-Re").

With `Keep` (never moves) and `Threshold` (margin, patience, cost) they make up
`BASELINES`, by the name each answers to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from adaptipe.controllers.base import Controller, Decision, Keep
from adaptipe.controllers.candidates import BLOCKS, FAMILIES, SCREEN, score, top_k
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.replan import stage_slowdowns
from adaptipe.controllers.threshold import Threshold
from adaptipe.errors import PlanError

__all__ = [
    "BASELINES",
    "AlwaysBest",
    "AlwaysBestSettings",
    "RestartAtEpoch",
    "RestartAtEpochSettings",
    "Stale",
    "StaleSettings",
    "Straggler",
    "StragglerSettings",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Search:
    """Where the best partition is looked for (`adaptipe.controllers.candidates.top_k`)."""

    include: tuple[str, ...] = ("autopipe", "dynpipe")
    blocks: int = BLOCKS  # DynPipe's top-k
    screen: int | None = SCREEN

    def __post_init__(self) -> None:
        if not self.include or any(f not in FAMILIES for f in self.include):
            raise PlanError(f"include must name some of {FAMILIES} (got {list(self.include)})")
        if self.blocks < 1:
            raise PlanError(f"blocks must be >= 1 (got {self.blocks})")


@dataclass(frozen=True, slots=True, kw_only=True)
class AlwaysBestSettings(_Search):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class StaleSettings(_Search):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerSettings(_Search):
    factor: float = 2.0  # a stage this much slower (or 1 / this faster) than planned for

    def __post_init__(self) -> None:
        _Search.__post_init__(self)
        if not self.factor > 1:
            raise PlanError(f"straggler: factor must be > 1 (got {self.factor})")


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartAtEpochSettings(_Search):
    # a restart may land anywhere: the planner's best partition is a candidate too
    include: tuple[str, ...] = ("autopipe", "dynpipe", "planner")
    epoch_iterations: int = 100

    def __post_init__(self) -> None:
        _Search.__post_init__(self)
        if self.epoch_iterations < 1:
            raise PlanError(
                f"restart_at_epoch: epoch_iterations must be >= 1 (got {self.epoch_iterations})"
            )


def _best(
    obs: Observation, slow: Sequence[float], search: _Search, *, method: str = "live"
) -> Decision:
    """Move to the best candidate under ``slow`` if it is predicted faster than the
    partition in force under the same, else keep; the reason gives both times."""
    current = score(obs, [obs.bounds], slow)[0][1]
    best = top_k(obs, slow, 1, include=search.include, blocks=search.blocks, screen=search.screen)
    seen = f"in force {current * 1e3:.1f} ms at slowdowns {_fmt(slow)}"
    if not best:
        return Decision(reason=f"{seen}: no other candidate")
    bounds, t = best[0]
    seen += f", best {bounds} {t * 1e3:.1f} ms"
    if t >= current:
        return Decision(reason=f"{seen}: the partition in force is the best")
    return Decision(
        bounds=bounds,
        predicted_gain_s=current - t,
        method=method,
        reason=f"{seen}: {(current - t) * 1e3:.1f} ms faster",
    )


def _fmt(slow: Sequence[float]) -> str:
    return "(" + ", ".join(f"{v:.2f}" for v in slow) + ")"


class AlwaysBest:
    """Moves to the best scored candidate whenever it is predicted faster than the
    partition in force: no margin, no patience, no price on the move."""

    name = "always_best"

    def __init__(self, settings: AlwaysBestSettings = AlwaysBestSettings()) -> None:
        self.settings = settings

    def decide(self, observation: Observation) -> Decision:
        return _best(observation, stage_slowdowns(observation), self.settings)


class Straggler:
    """DynPipe's straggler-triggered re-partition with a 2x / 0.5x trigger.

    DynPipe re-partitions "when external tasks or GPU stragglers interrupt current
    training session" and, "since the number of GPU stragglers typically represents a
    small fraction of the total workforce, we can begin with an existing optimal
    solution and incrementally refine it" (§V-B). The paper states no numeric trigger;
    this baseline makes it one: a stage is a straggler once its slowdown is at least
    ``factor`` (2) times what the partition in force was planned for, and has recovered
    once it is at most 1 / ``factor`` (0.5) times that. Either fires a re-plan to the
    best candidate (if faster than the partition in force), and the slowdowns it fired
    on become what the partition is planned for. The first plan is the profile's (every
    stage at 1).
    """

    name = "straggler"

    def __init__(self, settings: StragglerSettings = StragglerSettings()) -> None:
        self.settings = settings
        self._planned: tuple[float, ...] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"planned": list(self._planned) if self._planned is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        planned = state.get("planned")
        self._planned = tuple(float(x) for x in planned) if planned is not None else None

    def decide(self, observation: Observation) -> Decision:
        slow = stage_slowdowns(observation)
        if self._planned is None or len(self._planned) != len(slow):
            self._planned = (1.0,) * len(slow)
        f = self.settings.factor
        ratios = [s / p for s, p in zip(slow, self._planned, strict=True)]
        fired = [s for s, r in enumerate(ratios) if r >= f or r <= 1 / f]
        if not fired:
            worst = max(ratios, key=lambda r: max(r, 1 / r))
            return Decision(
                reason=f"no straggler: slowdowns {_fmt(slow)} against planned "
                f"{_fmt(self._planned)} (at most {worst:.2f}x, trigger {f:g}x / {1 / f:g}x)"
            )
        self._planned = slow
        decision = _best(observation, slow, self.settings)
        what = ", ".join(f"stage {s} {ratios[s]:.2f}x" for s in fired)
        return replace(decision, reason=f"straggler rule fired ({what}); {decision.reason}")


class Stale:
    """`AlwaysBest` on stale information: it plans on the slowdowns it measured at its
    previous check, so it acts one check late (DynPipe's "DynPipe-w/o RF ... uses stale
    interference information instead of random forest", §VII-A3)."""

    name = "stale"

    def __init__(self, settings: StaleSettings = StaleSettings()) -> None:
        self.settings = settings
        self._previous: tuple[float, ...] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"previous": list(self._previous) if self._previous is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        previous = state.get("previous")
        self._previous = tuple(float(x) for x in previous) if previous is not None else None

    def decide(self, observation: Observation) -> Decision:
        previous, self._previous = self._previous, stage_slowdowns(observation)
        if previous is None or len(previous) != observation.num_stages:
            return Decision(reason="no earlier measurement to plan on")
        decision = _best(observation, previous, self.settings)
        return replace(decision, reason=f"planned on the previous check's: {decision.reason}")


class RestartAtEpoch:
    """PipeDream-Re: "Pipeline via PipeDream while restarting the training for model
    re-partition at epoch boundary" (DynPipe §VII-A3). At the first check in a new epoch
    of ``epoch_iterations`` it moves to the best candidate if faster, with method
    ``"restart"`` (priced by `adaptipe.sim.migration.MigrationCost.switch_s`); between
    boundaries it keeps. The first check only notes the epoch."""

    name = "restart_at_epoch"

    def __init__(self, settings: RestartAtEpochSettings = RestartAtEpochSettings()) -> None:
        self.settings = settings
        self._epoch: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch = state.get("epoch")
        self._epoch = int(epoch) if epoch is not None else None

    def decide(self, observation: Observation) -> Decision:
        epoch = observation.iteration // self.settings.epoch_iterations
        last, self._epoch = self._epoch, epoch
        if last is None or epoch <= last:
            return Decision(reason=f"within epoch {epoch}: re-partitions only at its end")
        decision = _best(observation, stage_slowdowns(observation), self.settings, method="restart")
        return replace(decision, reason=f"epoch {epoch} begins; {decision.reason}")


BASELINES: dict[str, Callable[[], Controller]] = {
    "none": Keep,
    "threshold": Threshold,
    "always_best": AlwaysBest,
    "straggler": Straggler,
    "stale": Stale,
    "restart_at_epoch": RestartAtEpoch,
}
"""Every baseline by its ``name``, each with its default settings."""
