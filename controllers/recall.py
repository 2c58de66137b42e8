"""What the partitions a run has held measured, under which conditions: a controller's
memory of partitions it has run (issue 22, the "after" phase).

A controller ranks partitions with a model (DynPipe's planner on measured slowdowns for
the threshold rule; the speed predictor for the learned chain). The model leaves out
what it cannot see (a stage's loss, its optimizer step, waits, layers that run slower
than their profile in the pipeline), and on the 2-stage CNN of
``bench/bench_adaptive.py`` that put neighbouring cuts up to about 20% away from what
they measured: once a slowdown ended, going back to the partition that had been best
before it (27% faster on the job-array) read as within the margin, and no controller
went back. Its error also moves with the conditions: cut 3 measured 1.05-1.1x the
planner's figure on a quiet machine and 1.6x with its last stage slowed 3x, while cut 4
read 1.2-1.3x in both; a stage's measured slowdown carries what its layers' profile
misjudges (the CNN's last two layers ran at 1.2x their profile), so the planner's
figure for a partition shifts with which layers the stage in force holds.

`Recall` keeps what a partition measured instead: per partition a controller has seen
in force (and per blocks an iteration, which a successive-halving rung changes) and per
conditions (the per-stage slowdowns the check measured and each stage boundary's
measured link bandwidth), the moving mean of the measured iteration seconds. A later
check whose slowdowns are each within ``tolerance`` (a factor) of an entry's, and whose
links are each within ``link_tolerance`` of the entry's (or unmeasured in both), is
under the same conditions, and a partition held under them is ranked at what it
measured there against what the partition in force measures now; a partition never
held under them keeps the model's figure, as before. The comparison is made in the
model's frame (the candidate at the in-force prediction times the two measurements'
ratio), so with nothing remembered every decision is what it was without `Recall`.
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


def _factor(a: float, b: float) -> float:
    """The factor between two positive values (1.0 for two unmeasured, 0.0, links)."""
    if a == b:
        return 1.0
    return max(a, b) / min(a, b) if min(a, b) > 0 else math.inf


def _links(obs: Observation) -> tuple[float, ...]:
    """Per stage boundary the measured bandwidth (B/s), 0.0 where unmeasured."""
    return tuple(bw if math.isfinite(bw) else 0.0 for bw in obs.boundary_bandwidths())


@dataclass(slots=True)
class _Entry:
    slowdowns: tuple[float, ...]  # the conditions: per-stage slowdowns, moving mean
    links: tuple[float, ...]  # ... and per-boundary bandwidth (0.0: unmeasured)
    seconds: float  # the measured iteration, moving mean
    checks: int = 1

    def near(self, slowdowns: Sequence[float], links: Sequence[float]) -> tuple[float, float]:
        """How far these conditions are: the largest factor between two stages'
        slowdowns, and between two boundaries' bandwidths (inf for other counts)."""
        if len(slowdowns) != len(self.slowdowns) or len(links) != len(self.links):
            return math.inf, math.inf
        stages = max(map(_factor, slowdowns, self.slowdowns), default=1.0)
        return stages, max(map(_factor, links, self.links), default=1.0)


@dataclass(slots=True)
class Recall:
    """Per (partition, blocks an iteration) and conditions (`_Entry`): the exponential
    moving mean of the measured iteration seconds over the checks it was in force.
    ``weight``: the newest check's share; an entry counts once ``min_checks`` checks made
    it; ``tolerance``: the largest factor between two checks' slowdowns of a stage for
    one entry to serve both, ``link_tolerance`` between their bandwidths of a boundary
    (a lightly used link reads at its fast end, which depends on the sizes sent: the same
    loopback link read 137-190 MB/s at cut 3 and 57-60 at cut 4 of bench_adaptive's CNN;
    a throttle moves it tenfold or more); at most ``entries`` conditions a partition
    (the oldest go)."""

    weight: float = 0.5
    min_checks: int = 2
    tolerance: float = 1.25
    link_tolerance: float = 4.0
    entries: int = 8
    _seen: dict[str, list[_Entry]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1 or self.min_checks < 1 or self.entries < 1:
            raise PlanError(
                f"recall: weight in (0, 1], min_checks >= 1 and entries >= 1 (got "
                f"{self.weight}, {self.min_checks}, {self.entries})"
            )
        if not (self.tolerance >= 1 and self.link_tolerance >= 1):
            raise PlanError(
                f"recall: tolerance and link_tolerance must be >= 1 (got {self.tolerance}, "
                f"{self.link_tolerance})"
            )

    def _entry(self, key: str, slowdowns: Sequence[float], links: Sequence[float]) -> _Entry | None:
        found = []
        for i, e in enumerate(self._seen.get(key, [])):
            stages, bws = e.near(slowdowns, links)
            if stages <= self.tolerance and bws <= self.link_tolerance:
                found.append((stages, bws, i, e))
        return min(found, key=lambda f: f[:3])[3] if found else None

    def observe(self, obs: Observation, slowdowns: Sequence[float]) -> float | None:
        """Record the partition in force under ``slowdowns``: the window's measured
        iteration (`measured_iteration_s`). Returns the entry's seconds, None when
        nothing was measured."""
        measured = measured_iteration_s(obs)
        if measured is None or not (math.isfinite(measured) and measured > 0):
            return None
        key = _key(obs.bounds, obs.microbatches)
        links = _links(obs)
        entry = self._entry(key, slowdowns, links)
        if entry is None:
            listed = self._seen.setdefault(key, [])
            listed.append(_Entry(tuple(float(v) for v in slowdowns), links, measured))
            del listed[: max(0, len(listed) - self.entries)]
            return measured
        w = self.weight
        entry.seconds += w * (measured - entry.seconds)
        entry.slowdowns = tuple(
            a + w * (b - a) for a, b in zip(entry.slowdowns, slowdowns, strict=True)
        )
        entry.links = tuple(
            b if a == 0.0 or b == 0.0 else a + w * (b - a)
            for a, b in zip(entry.links, links, strict=True)
        )
        entry.checks += 1
        return entry.seconds

    def seconds(
        self, obs: Observation, bounds: Sequence[int], slowdowns: Sequence[float]
    ) -> float | None:
        """What ``bounds`` measured an iteration at ``obs``'s blocks under conditions near
        ``slowdowns`` and ``obs``'s links; None until such an entry counts."""
        entry = self._entry(_key(bounds, obs.microbatches), slowdowns, _links(obs))
        return entry.seconds if entry is not None and entry.checks >= self.min_checks else None

    def corrected(
        self,
        obs: Observation,
        bounds: Sequence[int],
        predicted_s: float,
        *,
        in_force_s: float,
        slowdowns: Sequence[float],
    ) -> float:
        """The model's ``predicted_s`` for ``bounds``, or, where ``bounds`` was held under
        conditions near ``slowdowns``, the in-force partition's model figure
        ``in_force_s`` times what ``bounds`` measured over what the partition in force
        measures now (the model's frame)."""
        if tuple(bounds) == tuple(obs.bounds):
            return predicted_s
        then = self.seconds(obs, bounds, slowdowns)
        now = measured_iteration_s(obs)
        if then is None or now is None or not now > 0 or not math.isfinite(in_force_s):
            return predicted_s
        return in_force_s * then / now

    def known(self, obs: Observation, slowdowns: Sequence[float]) -> list[tuple[int, ...]]:
        """The partitions of ``obs``'s stage count and blocks, other than the one in
        force, held under conditions near ``slowdowns``."""
        out = []
        suffix = f"/{obs.microbatches}"
        for key in self._seen:
            if not key.endswith(suffix):
                continue
            bounds = tuple(int(b) for b in key[: -len(suffix)].split(","))
            if len(bounds) != obs.num_stages + 1 or bounds[-1] != obs.num_layers:
                continue
            seen = self.seconds(obs, bounds, slowdowns)
            if bounds != tuple(obs.bounds) and seen is not None:
                out.append(bounds)
        return sorted(out)

    def measured(self, obs: Observation, slowdowns: Sequence[float]) -> dict[str, float]:
        """For the logs: milliseconds an iteration each partition held under conditions
        near ``slowdowns`` measured (``"0,3,6"``: ms), the one in force included."""
        out = {}
        for b in sorted({*self.known(obs, slowdowns), tuple(obs.bounds)}):
            got = self.seconds(obs, b, slowdowns)
            if got is not None:
                out[",".join(map(str, b))] = round(got * 1e3, 3)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            key: [
                {
                    "slowdowns": list(e.slowdowns),
                    "links_Bps": list(e.links),
                    "seconds": e.seconds,
                    "checks": e.checks,
                }
                for e in listed
            ]
            for key, listed in self._seen.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seen = {
            str(key): [
                _Entry(
                    tuple(float(v) for v in e["slowdowns"]),
                    tuple(float(v) for v in e.get("links_Bps", [])),
                    float(e["seconds"]),
                    int(e["checks"]),
                )
                for e in listed
                if float(e["seconds"]) > 0
            ]
            for key, listed in state.items()
            if isinstance(listed, list)
        }
