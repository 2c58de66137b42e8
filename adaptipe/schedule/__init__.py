"""Schedules: one instruction-list form, generators for every schedule, one validator."""

from adaptipe.schedule.build import SCHEDULE_NAMES, build_schedule
from adaptipe.schedule.types import (
    Backward,
    Forward,
    Instruction,
    OptimizerStep,
    Recompute,
    RecvActivation,
    RecvGradient,
    Schedule,
    SendActivation,
    SendGradient,
)
from adaptipe.schedule.validate import in_flight, validate

__all__ = [
    "SCHEDULE_NAMES",
    "Backward",
    "Forward",
    "Instruction",
    "OptimizerStep",
    "Recompute",
    "RecvActivation",
    "RecvGradient",
    "Schedule",
    "SendActivation",
    "SendGradient",
    "build_schedule",
    "in_flight",
    "validate",
]
