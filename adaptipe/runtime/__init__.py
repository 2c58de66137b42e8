"""The runtime: stage workers executing a `Schedule` for real over torch.distributed.

The names below load on first use, so commands that only read a run directory (``adaptipe
stop``) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adaptipe.runtime.config import RunConfig, load_config
    from adaptipe.runtime.launch import (
        Plans,
        StageFailed,
        TrainSummary,
        prepare,
        resolve_plans,
        train,
    )

__all__ = [
    "Plans",
    "RunConfig",
    "StageFailed",
    "TrainSummary",
    "load_config",
    "prepare",
    "resolve_plans",
    "train",
]
_FROM_CONFIG = ("RunConfig", "load_config")


def __getattr__(name: str) -> object:
    if name in _FROM_CONFIG:
        return getattr(importlib.import_module("adaptipe.runtime.config"), name)
    if name in __all__:
        return getattr(importlib.import_module("adaptipe.runtime.launch"), name)
    raise AttributeError(f"module 'adaptipe.runtime' has no attribute {name!r}")
