"""The error types users see. Every message names where the bad value came from."""

from __future__ import annotations

__all__ = ["AdaptipeError", "NetbedError", "PlanError", "ScheduleError"]


class AdaptipeError(Exception):
    """Base class of every error adaptipe raises on purpose."""


class PlanError(AdaptipeError, ValueError):
    """A profile, partition, config or other plan file (or value) is malformed.

    The message names the source (file or object), the field, the value and what is allowed.
    """


class ScheduleError(AdaptipeError, ValueError):
    """A schedule is invalid: the message names the stage, the instruction and why."""


class NetbedError(AdaptipeError, RuntimeError):
    """A test bed of namespace hosts cannot be built, changed or removed here.

    The message says why (not root, no ``ip`` command, a qdisc this kernel lacks, or the
    ``ip``/``tc`` command that failed with its error) and what would work instead.
    """
