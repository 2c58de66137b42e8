"""The controller protocol: ``decide(Observation) -> Decision``.

A controller reads one `Observation` (what the manager built from telemetry) and
returns a `Decision`: keep the partition, or move to other layer bounds, with why and
what it expects to gain. The manager acts on it off the training path (a re-partition
is a plan version the workers adopt at their next boundary); the gymnasium
environments step the simulator with it. Decisions are plain records, logged in
``control.jsonl``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from adaptipe.controllers.observation import Observation
from adaptipe.errors import PlanError

__all__ = ["METHODS", "Controller", "Decision", "Keep", "Stateful"]

METHODS = ("live", "restart")
"""How a move is made: ``live`` migrates the moving layers while training runs (the
runtime's plan switch); ``restart`` stops training, checkpoints and restarts on the new
partition (PipeDream-Re's way, `adaptipe.controllers.baselines.RestartAtEpoch`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Keep the partition (``bounds`` None) or move to ``bounds``; ``reason`` says why,
    ``predicted_gain_s`` the seconds per iteration the controller expects to save,
    ``method`` how the move is made (one of `METHODS`)."""

    bounds: tuple[int, ...] | None = None
    reason: str = ""
    predicted_gain_s: float | None = None
    method: str = "live"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise PlanError(f"Decision.method must be one of {METHODS} (got {self.method!r})")

    @property
    def moves(self) -> bool:
        return self.bounds is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "bounds": list(self.bounds) if self.bounds is not None else None,
            "reason": self.reason,
            "predicted_gain_s": self.predicted_gain_s,
            "method": self.method,
        }


class Controller(Protocol):
    """Decides, from one observation, whether and where to re-partition."""

    name: str

    def decide(self, observation: Observation) -> Decision: ...


class Stateful(Protocol):
    """A controller whose decisions depend on earlier ones (patience counters, the last
    move, what it planned for). Its state is plain JSON, saved with the run's
    checkpoints by the manager (`adaptipe.runtime.adapt_loop`), so a resumed run goes on
    deciding as the interrupted one would have. Weights it adapted go to files under the
    run directory, which the state names by path and sha256
    (`adaptipe.controllers.online`). With online tuning the resumed run starts from the
    saved weights but not from the tuner's samples and optimizer state, and a decision
    can depend on whether a background round had finished: close to the interrupted
    run, not the same."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Keep:
    """The static plan: never moves (``[adapt] controller = "none"``, and the baseline
    every controller is measured against)."""

    name = "none"

    def decide(self, observation: Observation) -> Decision:
        return Decision(reason="static plan")
