"""Checks that keep without asking the controller: its readings have not moved since a
check it settled on (``[adapt].unchanged``).

A controller that checks every iteration reacts within one iteration of a change, and
pays for it on every quiet one: the learned chain's models and DynPipe's planner take
1-3 ms of CPU a check, on the core the manager shares with a stage (on the bed, stage
0's; session 22 measured stage 0's gap between iterations at 3.6-5.4 ms with a
controller against 1.0-1.3 without, on iterations of 40-60 ms). Most checks see what
the check before saw and keep.

`Unchanged` remembers the readings of the last check the controller settled on (it
kept the partition and says it is `Settles.settled`: no patience counting toward a
move, nothing the next check would do differently on the same readings). A later
check under the same partition and blocks whose readings are all near those keeps at
once, for at most ``most`` checks in a row (then the controller is asked again, so a
slow drift is seen). The readings are what the controller's decision turns on: per
stage the window's mean compute and iteration seconds (each within ``tolerance``, a
fraction), each link's bandwidth (within a factor `LINK_FACTOR`) and each worker's
device features (each within `DEVICE_STEP`: they are fractions and logs,
`adaptipe.monitor.features`, which the interference forest reads). Per-layer readings
are left out: a small layer's seconds moved by more than 5% from one window to the next
on a quiet machine in most checks, and a stage's slowdown is its layers' sum. A link
that nothing saturates reads 95-150 MB/s from window to window on the bed; a throttle
moves it 4x or more (its end shows on the live probe's reading, not on the iteration).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from adaptipe.controllers.observation import Observation

__all__ = ["DEVICE_STEP", "LINK_FACTOR", "Settles", "Unchanged", "readings"]

LINK_FACTOR = 2.0
DEVICE_STEP = 0.1


@runtime_checkable
class Settles(Protocol):
    """A controller that can say its last decision (a keep) would be the same on the
    same readings; only such controllers have checks kept by `Unchanged`."""

    def settled(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class _Readings:
    key: tuple[tuple[int, ...], int]  # the partition and its blocks an iteration
    seconds: tuple[float, ...]  # per stage: mean compute, then mean iteration
    links: tuple[float, ...]  # B/s, by link name
    device: tuple[float, ...]  # per worker, its features


def _means(rows: Sequence[Sequence[float]]) -> list[float]:
    return [statistics.fmean(c) for c in zip(*rows, strict=True)] if rows else []


def readings(obs: Observation) -> _Readings:
    """What a controller decides on from ``obs``, for `Unchanged` to compare."""
    links = obs.link_bandwidth_Bps
    return _Readings(
        (tuple(obs.bounds), obs.microbatches),
        tuple(float(v) for v in (*_means(obs.stage_compute_s), *_means(obs.stage_iteration_s))),
        tuple(float(links[k]) for k in sorted(links)),
        tuple(float(v) for row in obs.device for v in row),
    )


def _near(a: _Readings, b: _Readings, tolerance: float) -> bool:
    shapes = (len(a.seconds), len(a.links), len(a.device))
    if a.key != b.key or shapes != (len(b.seconds), len(b.links), len(b.device)):
        return False
    for x, y in zip(a.seconds, b.seconds, strict=True):
        if not (math.isfinite(x) and math.isfinite(y) and abs(x - y) <= tolerance * max(x, y)):
            return False
    for x, y in zip(a.links, b.links, strict=True):
        if not (x > 0 and y > 0 and max(x, y) <= LINK_FACTOR * min(x, y)):
            return False
    return all(abs(x - y) <= DEVICE_STEP for x, y in zip(a.device, b.device, strict=True))


@dataclass(slots=True)
class Unchanged:
    """See the module doc. ``tolerance`` 0 turns it off."""

    tolerance: float = 0.05
    most: int = 8
    _settled: _Readings | None = None
    _since: int | None = None  # the iteration of the check it settled on
    _kept: int = 0  # checks kept in a row since

    def since(self, obs: Observation) -> int | None:
        """The iteration of the settled check whose readings ``obs``'s match (this
        check keeps, counted), or None: ask the controller (what it settled on is
        forgotten until `asked` says so again, so a call that raises leaves nothing)."""
        settled = self._settled  # None unless `asked` kept one (never with tolerance 0)
        if (
            settled is not None
            and self._kept < self.most
            and _near(readings(obs), settled, self.tolerance)
        ):
            self._kept += 1
            return self._since
        self._settled = self._since = None
        return None

    def asked(self, obs: Observation, *, settled: bool) -> None:
        """The controller decided on ``obs``: remember its readings where it kept and
        says it is settled, else forget."""
        self._kept = 0
        if settled and self.tolerance > 0:
            self._settled, self._since = readings(obs), obs.iteration
        else:
            self._settled = self._since = None
