"""A check whose measured iteration the model cannot explain waits for the telemetry.

The controllers price partitions through the planner's model on what the telemetry
measured: each stage's layer times and each link's newest bandwidth. A throttled link
slows the iterations at once, but its first readings come a check or two later (a link
is read as it carries, `adaptipe.monitor.linktimer`), and until they do the model
prices every cut at the old rate. On bench_adaptive's bed both controllers moved on
that: threshold at a throttle's onset to the cut best before it (in force 22 ms by the
model against 149 ms measured), ppo at a step from 200 to 10 Mbit/s back to the cut
best at 200 (realised -230 ms an iteration), each move paying a stop-and-copy over the
slow link and holding the right move back by a cooldown (docs/benchmarks.md, session
27).

`ModelLag` compares the window's measured iteration with the model's figure for the
partition in force, at every check. Their factor is steady while the model sees what
the stages do (about 1.1-1.4 on the bed: framework overhead and waits the model leaves
out); a check whose factor is more than ``limit`` times the median of the checks before
waits. The factors then start afresh, so a model that never catches up holds one check
only.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from adaptipe.errors import PlanError

__all__ = ["FACTORS", "ModelLag"]

FACTORS = 8
"""Checks whose factors the usual one is the median of."""


@dataclass(slots=True)
class ModelLag:
    """See the module doc; ``limit`` 0 never waits. ``waited``: the last check did."""

    limit: float = 2.0
    waited: bool = False
    _factors: deque[float] = field(default_factory=lambda: deque(maxlen=FACTORS))

    def __post_init__(self) -> None:
        if not (self.limit == 0 or self.limit > 1):
            raise PlanError(f"the model lag limit must be 0 or > 1 (got {self.limit})")

    def wait(self, measured_s: float | None, modelled_s: float) -> float | None:
        """The usual factor (measured over modelled, the median of the checks before)
        when this check's is beyond it by ``limit`` times: the check waits. None: it
        decides (nothing measured, no figure, or a factor the model explains)."""
        self.waited = False
        if measured_s is None or not modelled_s > 0:
            return None
        factor = measured_s / modelled_s
        usual = statistics.median(self._factors) if len(self._factors) >= 3 else None
        if self.limit > 0 and usual is not None and factor > self.limit * usual:
            self._factors.clear()
            self.waited = True
            return usual
        if math.isfinite(factor):
            self._factors.append(factor)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"factors": list(self._factors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._factors = deque((float(f) for f in state.get("factors", [])), maxlen=FACTORS)
