"""Re-partitioning controllers: the protocol (`Controller`: ``decide(Observation) ->
Decision``), what they observe (`observe` builds an `Observation` from telemetry), the
static baseline (`Keep`) and the threshold rule (`Threshold`, on DynPipe's planner with
measured slowdowns, `adaptipe.controllers.replan`). The learned controllers (AutoPipe,
DynPipe) come next."""

from adaptipe.controllers.base import Controller, Decision, Keep
from adaptipe.controllers.observation import Observation, observe
from adaptipe.controllers.threshold import Threshold, ThresholdSettings

__all__ = [
    "Controller",
    "Decision",
    "Keep",
    "Observation",
    "Threshold",
    "ThresholdSettings",
    "observe",
]
