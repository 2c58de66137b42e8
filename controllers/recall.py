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

A partition left within the last ``revisit_checks`` checks is ranked no better than it
measured when it was left, against what the partition in force measures now, even where
the links no longer read as they did (its own guard, `corrected`). A link's reading
depends on the cut it carries (the bed's unshaped link: 95-150 MB/s carrying 64 KB
messages, 300-690 MB/s carrying 512 KB, 68-86 once busy enough to be held at its
saturated rate), so after a move the entry of the partition just left often stops
matching; the model's figure then sent a controller back, and after a throttle ended
two runs flipped between cuts 2 and 3 every cooldown, each move measured slower than
the one it undid (session 23). The guard stands down once the stage slowdowns changed
beyond ``tolerance`` or a link reads more than ``link_tolerance`` times faster than it
did there (a throttle ended: a return may now pay), and it only ever raises a figure.
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


def _stages_factor(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest factor between two stages' slowdowns (same stage count)."""
    return max(map(_factor, a, b), default=1.0)


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
        stages = _stages_factor(slowdowns, self.slowdowns)
        return stages, max(map(_factor, links, self.links), default=1.0)


@dataclass(slots=True)
class _Left:
    """A partition's conditions and measured seconds at the check it was last in force."""

    check: int
    slowdowns: tuple[float, ...]
    links: tuple[float, ...]
    seconds: float


def _network_improved(now: Sequence[float], then: Sequence[float], factor: float) -> bool:
    """Whether a boundary measured in both reads more than ``factor`` times faster now."""
    return len(now) != len(then) or any(
        a > factor * b for a, b in zip(now, then, strict=True) if a > 0 and b > 0
    )


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
    (the oldest go); ``revisit_checks``: how many checks after it was left a partition
    ranks no better than it measured then (the module doc; 0: never)."""

    weight: float = 0.5
    min_checks: int = 2
    tolerance: float = 1.25
    link_tolerance: float = 4.0
    entries: int = 8
    revisit_checks: int = 50
    _seen: dict[str, list[_Entry]] = field(default_factory=dict)
    _checks: int = 0  # checks observed
    _held: tuple[str, _Left] | None = None  # the partition in force, at its last check
    _left: dict[str, _Left] = field(default_factory=dict)  # partitions left, newest check

    def __post_init__(self) -> None:
        if (
            not 0 < self.weight <= 1
            or self.min_checks < 1
            or self.entries < 1
            or self.revisit_checks < 0
        ):
            raise PlanError(
                f"recall: weight in (0, 1], min_checks >= 1, entries >= 1 and "
                f"revisit_checks >= 0 (got {self.weight}, {self.min_checks}, {self.entries}, "
                f"{self.revisit_checks})"
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
        self._checks += 1
        if self._held is not None and self._held[0] != key:
            self._left[self._held[0]] = self._held[1]
        self._left.pop(key, None)
        for gone in [k for k, v in self._left.items() if not self._recent(v)]:
            del self._left[gone]
        seconds = self._update(key, slowdowns, links, measured)
        self._held = key, _Left(self._checks, tuple(map(float, slowdowns)), links, seconds)
        return seconds

    def _recent(self, left: _Left) -> bool:
        return self._checks - left.check <= self.revisit_checks

    def _update(
        self, key: str, slowdowns: Sequence[float], links: tuple[float, ...], measured: float
    ) -> float:
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
        measures now (the model's frame). A partition left within ``revisit_checks``
        checks and not matched so ranks no better than that figure from what it measured
        when it was left (the module doc)."""
        if tuple(bounds) == tuple(obs.bounds) or not math.isfinite(in_force_s):
            return predicted_s
        now = measured_iteration_s(obs)
        if now is None or not now > 0:
            return predicted_s
        then = self.seconds(obs, bounds, slowdowns)
        if then is not None:
            return in_force_s * then / now
        left = self.left_seconds(obs, bounds, slowdowns)
        return predicted_s if left is None else max(predicted_s, in_force_s * left / now)

    def left_seconds(
        self, obs: Observation, bounds: Sequence[int], slowdowns: Sequence[float]
    ) -> float | None:
        """What ``bounds`` measured when it was left, where that was within
        ``revisit_checks`` checks, the stage slowdowns are still near and no link reads
        more than ``link_tolerance`` times faster now; else None."""
        left = self._left.get(_key(bounds, obs.microbatches))
        if left is None or not self._recent(left) or len(slowdowns) != len(left.slowdowns):
            return None
        if _stages_factor(slowdowns, left.slowdowns) > self.tolerance:
            return None
        if _network_improved(_links(obs), left.links, self.link_tolerance):
            return None
        return left.seconds

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

    def left_ms(self, obs: Observation, slowdowns: Sequence[float]) -> dict[str, float]:
        """For the logs: the partitions the revisit guard holds now (`left_seconds`), at
        the milliseconds an iteration they measured when they were left."""
        out = {}
        for key in sorted(self._left):
            bounds, _, blocks = key.partition("/")
            cut = tuple(int(b) for b in bounds.split(","))
            got = (
                self.left_seconds(obs, cut, slowdowns) if blocks == str(obs.microbatches) else None
            )
            if got is not None:
                out[bounds] = round(got * 1e3, 3)
        return out

    def state_dict(self) -> dict[str, Any]:
        """``seen``: per partition key its entries; ``checks``, ``held`` and ``left``: the
        revisit guard's memory (a resume keeps it)."""
        return {
            "seen": {
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
            },
            "checks": self._checks,
            "held": None if self._held is None else [self._held[0], _left_json(self._held[1])],
            "left": {key: _left_json(v) for key, v in self._left.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes `state_dict`'s form, and the bare ``seen`` mapping of checkpoints written
        before the revisit guard."""
        if isinstance(state.get("seen"), dict):
            held = state.get("held")
            self._checks = int(state.get("checks", 0))
            self._held = (str(held[0]), _left_from(held[1])) if isinstance(held, list) else None
            self._left = {str(k): _left_from(v) for k, v in dict(state.get("left", {})).items()}
            state = state["seen"]
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


def _left_json(left: _Left) -> dict[str, Any]:
    return {
        "check": left.check,
        "slowdowns": list(left.slowdowns),
        "links_Bps": list(left.links),
        "seconds": left.seconds,
    }


def _left_from(data: dict[str, Any]) -> _Left:
    return _Left(
        int(data["check"]),
        tuple(float(v) for v in data["slowdowns"]),
        tuple(float(v) for v in data["links_Bps"]),
        float(data["seconds"]),
    )
