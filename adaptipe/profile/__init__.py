"""Per-layer profiles: the `Profile` type and the profiler that measures one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from adaptipe.profile.types import PROFILE_VERSION, LayerProfile, Profile

if TYPE_CHECKING:
    from adaptipe.profile.profiler import profile_model

__all__ = ["PROFILE_VERSION", "LayerProfile", "Profile", "profile_model"]


def __getattr__(name: str) -> Any:
    # The profiler needs torch; planning and simulating do not, so load it on first use.
    if name == "profile_model":
        from adaptipe.profile.profiler import profile_model

        return profile_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
