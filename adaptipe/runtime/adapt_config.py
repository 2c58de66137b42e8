"""``[adapt]``: how a run takes on a new partition, and scripted re-partitions.

::

    [adapt]
    method = "live"          # live: layers move between the running workers at one
                             # boundary (stop-and-copy, `adaptipe.runtime.migration`);
                             # checkpoint: through a checkpoint written there;
                             # restart: checkpoint, stop the workers, start them again
                             # on the new partition (the field's baseline)
    timeout_s = 60           # a migration message later than this fails the migration

    [[adapt.repartition]]    # scripted: from iteration 10 on, layers 0-2 | 3-7
    iteration = 10
    bounds = [0, 3, 8]

A scripted re-partition is committed as a plan version before the workers start, and
comes into force exactly at its iteration (windows end there).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.serial import get_float, get_int, get_list, get_str

__all__ = ["METHODS", "AdaptSection", "Repartition", "parse_adapt"]

METHODS = ("live", "checkpoint", "restart")


@dataclass(frozen=True, slots=True, kw_only=True)
class Repartition:
    """From ``iteration`` on, the stages hold layers ``bounds[s]`` to ``bounds[s + 1]``."""

    iteration: int
    bounds: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptSection:
    method: str = "live"
    timeout_s: float = 60.0
    repartition: tuple[Repartition, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "timeout_s": self.timeout_s,
            "repartition": [
                {"iteration": r.iteration, "bounds": list(r.bounds)} for r in self.repartition
            ],
        }


def parse_adapt(
    raw: Any, *, source: str, num_layers: int, stages: int, iterations: int | None
) -> AdaptSection:
    """Read ``[adapt]``; every error names the file, the field and what is allowed."""
    if not isinstance(raw, Mapping):
        raise PlanError(f"{source}: [adapt] must be a table (got {type(raw).__name__})")
    allowed = ("method", "timeout_s", "repartition")
    for key in raw:
        if key not in allowed:
            raise PlanError(
                f"{source}: unknown field [adapt].{key} (allowed: {', '.join(allowed)})"
            )
    method = get_str(
        raw, "method", source=source, prefix="[adapt].", choices=METHODS, default="live"
    )
    timeout = get_float(raw, "timeout_s", source=source, prefix="[adapt].", default=60.0)
    if timeout <= 0:
        raise PlanError(f"{source}: [adapt].timeout_s must be > 0 (got {timeout:g})")
    entries = get_list(raw, "repartition", source=source, prefix="[adapt].", default=[])
    out: list[Repartition] = []
    for n, entry in enumerate(entries):
        where = f"[[adapt.repartition]] #{n + 1}"
        out.append(_repartition(entry, source, where, num_layers, stages, iterations))
    its = [r.iteration for r in out]
    if its != sorted(set(its)):
        raise PlanError(f"{source}: [[adapt.repartition]] iterations must increase (got {its})")
    return AdaptSection(method=method, timeout_s=timeout, repartition=tuple(out))


def _repartition(
    entry: Any, source: str, where: str, num_layers: int, stages: int, iterations: int | None
) -> Repartition:
    if not isinstance(entry, Mapping):
        raise PlanError(f"{source}: {where} must be a table with iteration and bounds")
    for key in entry:
        if key not in ("iteration", "bounds"):
            raise PlanError(f"{source}: unknown field {where}.{key} (allowed: iteration, bounds)")
    iteration = get_int(entry, "iteration", source=source, prefix=f"{where}.", minimum=1)
    if iterations is not None and iteration >= iterations:
        raise PlanError(
            f"{source}: {where}.iteration = {iteration} is not before the last iteration "
            f"(allowed: 1..{iterations - 1} for [train].iterations = {iterations})"
        )
    bounds = get_list(entry, "bounds", source=source, prefix=f"{where}.")
    ok = (
        all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
        and len(bounds) == stages + 1
        and bounds[:1] == [0]
        and bounds[-1:] == [num_layers]
        and all(a < b for a, b in itertools.pairwise(bounds))
    )
    if not ok:
        raise PlanError(
            f"{source}: {where}.bounds = {bounds!r} is not a partition of this model: "
            f"{stages + 1} increasing layer indices from 0 to {num_layers} (one stage per "
            f"[pipeline] virtual stage, each at least one layer)"
        )
    return Repartition(iteration=iteration, bounds=tuple(bounds))
