"""Re-partitioning controllers: the protocol (`Controller`: ``decide(Observation) ->
Decision``), what they observe (`observe` builds an `Observation` from telemetry) and
the static baseline (`Keep`). The threshold rule and the learned controllers (AutoPipe,
DynPipe) come next."""

from adaptipe.controllers.base import Controller, Decision, Keep
from adaptipe.controllers.observation import Observation, observe

__all__ = ["Controller", "Decision", "Keep", "Observation", "observe"]
