"""What the partitions a run has held measured, beside what a controller's model said of
them: a controller's memory of its own errors (issue 22, the "after" phase).

A controller ranks partitions with a model (DynPipe's planner on measured slowdowns for
the threshold rule; the speed predictor for the learned chain). The model leaves out
what it cannot see (a stage's loss, its optimizer step, waits), and on the 2-stage CNN of
``bench/bench_adaptive.py`` that put neighbouring cuts up to about 20% apart from what
they measured: once a slowdown ended, going back to the partition that was best before
it (27% faster on the job-array) read as within the margin, and no controller moved
back.

`Recall` keeps, per partition a controller has seen in force (and per blocks an
iteration, which a successive-halving rung changes), the moving mean of the measured
iteration seconds over what the controller predicted for it at the same check: the
model's error there, as a ratio. A candidate the run has measured is then ranked at its
prediction times its own ratio over the ratio of the partition in force; a candidate
never held keeps its prediction (it shares the in-force partition's error, as before).
The comparison stays in the model's frame, so with nothing remembered every decision is
what it was without `Recall`; and as ratios, the in-force partition against a measured
candidate compares what each measured, each moved by what the model says changed since
(an additive error would not: in the model's frame it can take a candidate below zero).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from adaptipe.controllers.observation import Observation
from adaptipe.errors import PlanError

__all__ = ["Recall", "measured_iteration_s"]


def measured_iteration_s(obs: Observation) -> float | None:
    """The window's median over iterations of the slowest stage's iteration seconds (what
    the threshold rule reports as measured); None when nothing was measured."""
    rows = [max(row) for row in obs.stage_iteration_s if row]
    return statistics.median(rows) if rows else None


def _key(bounds: Sequence[int], microbatches: int) -> str:
    return f"{','.join(str(int(b)) for b in bounds)}/{int(microbatches)}"


@dataclass(slots=True)
class Recall:
    """Per (partition, blocks an iteration): the exponential moving mean of measured
    over predicted seconds an iteration, over the checks it was in force. ``weight``:
    the newest check's share; a ratio counts once ``min_checks`` checks made it."""

    weight: float = 0.5
    min_checks: int = 2
    _ratio: dict[str, float] = field(default_factory=dict)
    _checks: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1 or self.min_checks < 1:
            raise PlanError(
                f"recall: weight in (0, 1] and min_checks >= 1 (got {self.weight}, "
                f"{self.min_checks})"
            )

    def observe(self, obs: Observation, predicted_s: float) -> float | None:
        """Record the partition in force: the window's measured iteration against
        ``predicted_s`` (the controller's seconds an iteration for it, now). Returns the
        ratio, None when nothing was measured or the prediction is not finite and > 0."""
        measured = measured_iteration_s(obs)
        if measured is None or not (math.isfinite(predicted_s) and predicted_s > 0):
            return None
        key = _key(obs.bounds, obs.microbatches)
        error = measured / predicted_s
        before = self._ratio.get(key)
        now = error if before is None else before + self.weight * (error - before)
        self._ratio[key] = now
        self._checks[key] = self._checks.get(key, 0) + 1
        return now

    def ratio(self, bounds: Sequence[int], microbatches: int) -> float | None:
        """Measured over predicted for ``bounds`` at ``microbatches`` blocks, None until
        it counts."""
        key = _key(bounds, microbatches)
        if self._checks.get(key, 0) < self.min_checks:
            return None
        return self._ratio[key]

    def corrected(self, obs: Observation, bounds: Sequence[int], predicted_s: float) -> float:
        """``predicted_s`` for ``bounds`` times its own ratio over the in-force
        partition's (the model's frame); unchanged unless both count."""
        mine = self.ratio(bounds, obs.microbatches)
        ours = self.ratio(obs.bounds, obs.microbatches)
        if mine is None or ours is None or tuple(bounds) == tuple(obs.bounds):
            return predicted_s
        return predicted_s * mine / ours

    def known(self, obs: Observation) -> list[tuple[int, ...]]:
        """The partitions of ``obs``'s stage count and blocks whose ratio counts."""
        out = []
        suffix = f"/{obs.microbatches}"
        for key, checks in self._checks.items():
            if checks >= self.min_checks and key.endswith(suffix):
                bounds = tuple(int(b) for b in key[: -len(suffix)].split(","))
                if len(bounds) == obs.num_stages + 1 and bounds[-1] == obs.num_layers:
                    out.append(bounds)
        return sorted(out)

    def state_dict(self) -> dict[str, Any]:
        return {"ratio": dict(self._ratio), "checks": dict(self._checks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ratio = state.get("ratio", {})
        checks = state.get("checks", {})
        self._ratio = {str(k): float(v) for k, v in ratio.items() if float(v) > 0}
        self._checks = {str(k): int(v) for k, v in checks.items() if k in self._ratio}
