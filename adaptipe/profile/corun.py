"""`profile_co_running`: a profile measured while every stage core is busy.

A pipeline's stages compute at the same time, one process per core, and on small
machines they share caches, memory bandwidth and (on virtual machines) the host's
cores: a layer is slower in the pipeline than when profiled alone. Here ``processes``
copies of the profiler run at once, each pinned to its own core as the stage workers
pin themselves, start together, and their per-layer times are averaged (`mean_profile`),
so the profile carries the contention of co-running stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.profile.children import pin_to_core, run_children
from adaptipe.profile.types import Profile, mean_profile

__all__ = ["profile_co_running"]


def _child(
    rank: int, model: str, config: dict[str, Any], kwargs: dict[str, Any], start: Any, out: Any
) -> None:
    try:
        pin_to_core(rank)
        from adaptipe.models import get_model
        from adaptipe.profile.profiler import profile_model

        spec = get_model(model, **config)
        start.wait()
        out.put((rank, profile_model(spec, **kwargs).to_json()))
    except BaseException as exc:  # report, never hang the parent
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def profile_co_running(
    model: str,
    config: dict[str, Any] | None = None,
    *,
    processes: int,
    timeout_s: float = 600.0,
    **kwargs: Any,
) -> Profile:
    """Profile zoo model ``model`` in ``processes`` pinned processes at once; mean times.

    ``kwargs`` go to `adaptipe.profile.profile_model` (``microbatch`` is required;
    ``threads`` defaults to 1, as the stage workers run).
    """
    if processes < 1:
        raise PlanError(f"profile_co_running: processes must be >= 1 (got {processes})")
    if "microbatch" not in kwargs:
        raise PlanError("profile_co_running: microbatch is required")
    kwargs.setdefault("threads", 1)
    raw = run_children(
        _child,
        [(model, dict(config or {}), kwargs)] * processes,
        timeout_s=timeout_s,
        what="profile_co_running",
    )
    merged = mean_profile(
        [Profile.from_json(data, source=f"co-running profiler {r}") for r, data in enumerate(raw)]
    )
    return dataclasses.replace(merged, meta={**merged.meta, "co_running_processes": processes})
