"""Partitioners: PipeDream's hierarchical DP and DynPipe's communication-aware DP."""

from adaptipe.plan.api import PLANNERS, plan, stage_times
from adaptipe.plan.condense import Condensed, condense
from adaptipe.plan.dynpipe import plan_dynpipe
from adaptipe.plan.partition import PARTITION_VERSION, Partition
from adaptipe.plan.pipedream import Level, plan_pipedream, plan_pipeline_stages
from adaptipe.plan.staleness import StalenessModel, estimate_staleness_model

__all__ = [
    "PARTITION_VERSION",
    "PLANNERS",
    "Condensed",
    "Level",
    "Partition",
    "StalenessModel",
    "condense",
    "estimate_staleness_model",
    "plan",
    "plan_dynpipe",
    "plan_pipedream",
    "plan_pipeline_stages",
    "stage_times",
]
