"""Re-partitioning controllers: the protocol (`Controller`: ``decide(Observation) ->
Decision``), what they observe (`observe` builds an `Observation` from telemetry), the
static baseline (`Keep`), the threshold rule (`Threshold`, on DynPipe's planner with
measured slowdowns, `adaptipe.controllers.replan`), the candidate partitions
(`adaptipe.controllers.candidates`), the other baselines
(`adaptipe.controllers.baselines`) and the learned models: the LSTM speed predictor
(`adaptipe.controllers.predictor`), the PPO switch policy
(`adaptipe.controllers.switch_policy`) and the random-forest interference model
(`adaptipe.controllers.interference`), shipped as artifacts
(`adaptipe.controllers.artifacts`). The learned modules are imported on demand: they
pull in torch and scikit-learn."""

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
