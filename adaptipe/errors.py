"""The error types users see. Every message names where the bad value came from."""

from __future__ import annotations

__all__ = ["AdaptipeError", "PlanError", "ScheduleError"]


class AdaptipeError(Exception):
    """Base class of every error adaptipe raises on purpose."""


class PlanError(AdaptipeError, ValueError):
    """A profile, partition, config or other plan file (or value) is malformed.

    The message names the source (file or object), the field, the value and what is allowed.
    """


class ScheduleError(AdaptipeError, ValueError):
    """A schedule is invalid: the message names the stage, the instruction and why."""
