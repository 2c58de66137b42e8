"""The runtime: stage workers executing a `Schedule` for real over torch.distributed."""

from adaptipe.runtime.launch import Plans, StageFailed, TrainSummary, prepare, resolve_plans, train

__all__ = ["Plans", "StageFailed", "TrainSummary", "prepare", "resolve_plans", "train"]
