"""What the decision loop's committed moves gained (`adaptipe.runtime.adapt_loop`).

Once a move's first ``window`` iterations have merged, its outcome is an event::

    {"event": "decision_outcome", "iteration" (the decision's), "version", "switched_at",
     "before_s", "after_s", "predicted_gain_s", "realised_gain_s"}

comparing the median merged iteration time of the ``window`` iterations before the
switch with that of the first ``window`` from it on (its stall included); a move the
workers could not make (a failed migration rolls back) has ``switched_at`` null.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaptipe.runtime.planversion import adoptions
from adaptipe.runtime.rundir import RunDir

__all__ = ["Outcomes"]


@dataclass(slots=True)
class _Pending:
    """A committed move whose realised gain is still to be measured."""

    iteration: int
    version: int
    predicted_gain_s: float | None


class Outcomes:
    """The moves committed in ``run`` whose outcome is still to come (see the module doc),
    and the merged iteration times they will be measured on."""

    def __init__(self, run: RunDir, window: int) -> None:
        self.run, self.window = run, window
        self._pending: list[_Pending] = []
        self._times: dict[int, float] = {}  # merged iteration -> its seconds

    def add(self, iteration: int, version: int, predicted_gain_s: float | None) -> None:
        """A move decided at ``iteration`` was committed as ``version``."""
        self._pending.append(_Pending(iteration, version, predicted_gain_s))

    def merged(
        self, merged: Sequence[Mapping[str, Any]], latest: int, *, keep_from: int
    ) -> list[dict[str, Any]]:
        """Take the newly merged iterations (``latest`` the newest so far); the outcomes
        now measured. Times from ``keep_from - window`` on are kept (a check in flight
        from there may still commit a move)."""
        for rec in merged:
            self._times[int(rec["iteration"])] = float(rec["iteration_s"])
        out = self._measured(latest) if merged and self._pending else []
        keep = min([keep_from, *(p.iteration for p in self._pending)]) - self.window
        self._times = {i: t for i, t in self._times.items() if i > keep}
        return out

    def _measured(self, latest: int) -> list[dict[str, Any]]:
        adopted = adoptions(self.run)
        window, out, still = self.window, [], []
        for p in self._pending:
            switched = adopted.get(p.version)
            if switched is None and max(adopted, default=0) > p.version:
                out.append(_outcome(p, None, None, None))  # rolled back
            elif switched is not None and latest >= switched + window - 1:
                before = self._median(switched - window, switched - 1)
                after = self._median(switched, switched + window - 1)
                out.append(_outcome(p, switched, before, after))
            else:
                still.append(p)
        self._pending = still
        return out

    def _median(self, first: int, last: int) -> float | None:
        times = [self._times[i] for i in range(first, last + 1) if i in self._times]
        return statistics.median(times) if times else None


def _outcome(
    p: _Pending, switched: int | None, before: float | None, after: float | None
) -> dict[str, Any]:
    realised = before - after if before is not None and after is not None else None
    return {
        "event": "decision_outcome",
        "iteration": p.iteration,
        "version": p.version,
        "switched_at": switched,
        "before_s": before,
        "after_s": after,
        "predicted_gain_s": p.predicted_gain_s,
        "realised_gain_s": realised,
    }
