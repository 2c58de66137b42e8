"""The runtime: stage workers executing a `Schedule` for real over torch.distributed."""

from adaptipe.runtime.launch import StageFailed, TrainSummary, resolve_plans, train

__all__ = ["StageFailed", "TrainSummary", "resolve_plans", "train"]
