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

__all__ = ["Controller", "Decision", "Keep"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Keep the partition (``bounds`` None) or move to ``bounds``; ``reason`` says why,
    ``predicted_gain_s`` the seconds per iteration the controller expects to save."""

    bounds: tuple[int, ...] | None = None
    reason: str = ""
    predicted_gain_s: float | None = None

    @property
    def moves(self) -> bool:
        return self.bounds is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "bounds": list(self.bounds) if self.bounds is not None else None,
            "reason": self.reason,
            "predicted_gain_s": self.predicted_gain_s,
        }


class Controller(Protocol):
    """Decides, from one observation, whether and where to re-partition."""

    name: str

    def decide(self, observation: Observation) -> Decision: ...


class Keep:
    """The static plan: never moves (``[adapt] controller = "none"``, and the baseline
    every controller is measured against)."""

    name = "none"

    def decide(self, observation: Observation) -> Decision:
        return Decision(reason="static plan")
