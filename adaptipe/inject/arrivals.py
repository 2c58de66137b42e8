"""Interference levels as in DynPipe: injections that arrive as a Poisson process.

DynPipe (Sec. VII-A5) runs "light" interference as an external task queue with some
arrival rate and "heavy" interference with that rate tripled. A ``[[poisson]]`` level
draws arrivals with exponential gaps at ``rate_per_min x multiplier`` per minute, a
kind uniformly from ``kinds`` (fields from the ``[poisson.<kind>]`` table), a stage
uniformly from ``stages`` for the stage kinds, and a duration from an exponential
distribution with mean ``mean_duration_s`` (at least ``min_duration_s``). Arrivals may
overlap, as independent external tasks do. ``[levels]`` maps level names to multipliers::

    [levels]                # the defaults; add your own
    light = 1.0
    heavy = 3.0

    [[poisson]]
    level = "heavy"
    rate_per_min = 1.0      # arrivals per minute at multiplier 1
    mean_duration_s = 30
    kinds = ["cpu_hog", "memory"]
    start_s = 0
    end_s = 600             # or give expand() a horizon
    [poisson.memory]
    gib = 0.5

`expand` turns the levels into concrete, seeded injections before anything runs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.inject.scenario import (
    KINDS,
    SPECS,
    FieldReader,
    Injection,
    InjectorSpec,
    LinkThrottle,
    Scenario,
    Slowdown,
)
from adaptipe.serial import get_list, get_str

__all__ = ["PoissonLevel", "arrival_times", "expand", "parse_poisson"]

DEFAULT_LEVELS: dict[str, float] = {"light": 1.0, "heavy": 3.0}
_POSITIVE = {"kind": "float", "low": 0.0}
_AT_LEAST_0 = {"kind": "float", "minimum": 0.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class PoissonLevel:
    """Random arrivals of `specs` (one template per kind; stages drawn from `stages`)."""

    origin: str
    level: str
    multiplier: float
    specs: tuple[InjectorSpec, ...]
    stages: tuple[int, ...]
    rate_per_min: float = field(metadata=_POSITIVE)  # at multiplier 1
    mean_duration_s: float = field(metadata=_POSITIVE)
    min_duration_s: float = field(default=1.0, metadata=_AT_LEAST_0)
    start_s: float = field(default=0.0, metadata=_AT_LEAST_0)
    end_s: float | None = field(default=None, metadata=_POSITIVE)

    @property
    def arrivals_per_min(self) -> float:
        return self.rate_per_min * self.multiplier


_READ = tuple(f for f in fields(PoissonLevel) if "kind" in f.metadata)
_FIELDS = ("level", "kinds", "stages", *(f.name for f in _READ))


def parse_poisson(data: Mapping[str, Any], reader: FieldReader) -> tuple[PoissonLevel, ...]:
    """The ``[levels]`` and ``[[poisson]]`` sections of a scenario."""
    raw = data.get("levels", {})
    if not isinstance(raw, Mapping):
        raise reader.fail("[levels]", f"must be a table (got {type(raw).__name__})")
    for name, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise reader.fail(f"[levels].{name}", f"must be a number > 0 (got {value!r})")
    levels = DEFAULT_LEVELS | {k: float(v) for k, v in raw.items()}
    tables = get_list(data, "poisson", source=reader.source, default=[])
    return tuple(_level(reader, t, f"poisson[{i}]", levels) for i, t in enumerate(tables))


def _level(reader: FieldReader, t: Any, where: str, levels: Mapping[str, float]) -> PoissonLevel:
    # kills have their own p and period; link shapes name a bed's host, not a stage
    drawable = tuple(k for k in KINDS if k not in ("kill", "link_shape"))
    t = reader.mapping(t, where)
    kinds = get_list(t, "kinds", source=reader.source, prefix=f"{where}.")
    if not kinds or len(set(map(repr, kinds))) < len(kinds) or not set(kinds) <= set(drawable):
        allowed = f"must list distinct kinds from {', '.join(drawable)} (got {kinds!r})"
        raise reader.fail(f"{where}.kinds", allowed)
    t = reader.table(t, where, (*_FIELDS, *kinds), "[[poisson]]")
    level = get_str(
        t, "level", source=reader.source, prefix=f"{where}.", choices=tuple(levels), default="light"
    )
    if "stages" in t:
        raw = get_list(t, "stages", source=reader.source, prefix=f"{where}.")
        for s in raw:
            if isinstance(s, bool) or not isinstance(s, int):
                raise reader.fail(f"{where}.stages", f"must list stage indices (got {s!r})")
        stages = tuple(reader.stage(s, f"{where}.stages") for s in raw)
    else:
        stages = tuple(range(reader.num_stages or 0))
    specs = []
    for kind in kinds:
        # a drawn memory load is a process's: its in-worker fields are not drawn
        own = tuple(f.name for f in fields(SPECS[kind]) if f.name not in ("stage", "grow_mb"))
        template = dict(reader.table(t.get(kind, {}), f"{where}.{kind}", own, kind))
        if any(f.name == "stage" and f.default is MISSING for f in fields(SPECS[kind])):
            # a stage kind: the stage is drawn
            if not stages:
                needed = f"is needed to draw {kind} injections when the stage count is unknown"
                raise reader.fail(f"{where}.stages", f"{needed} (e.g. stages = [0, 1])")
            template["stage"] = stages[0]
        specs.append(reader.spec(kind, template, f"{where}.{kind}"))
    values = {f.name: reader.value(f, t, where) for f in _READ if f.name in t}
    for name in ("rate_per_min", "mean_duration_s"):
        if name not in t:
            raise reader.fail(f"{where}.{name}", "is missing")
    out = PoissonLevel(
        origin=where,
        level=level,
        multiplier=levels[level],
        specs=tuple(specs),
        stages=stages,
        **values,
    )
    if out.end_s is not None and out.end_s <= out.start_s:
        raise reader.fail(
            f"{where}.end_s", f"must be > start_s = {out.start_s:g} (got {out.end_s:g})"
        )
    return out


def arrival_times(
    rate_per_s: float, *, start_s: float, end_s: float, rng: random.Random
) -> list[float]:
    """Times of a Poisson process of rate `rate_per_s` in [start_s, end_s)."""
    times: list[float] = []
    t = start_s
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= end_s:
            return times
        times.append(t)


def expand(scenario: Scenario, *, horizon_s: float | None, seed: int) -> Scenario:
    """Replace the scenario's Poisson levels by concrete injections, sorted by start.

    Args:
        horizon_s: no arrival starts or lasts past this (None: each level's ``end_s``).
        seed: the same seed gives the same injections; each level has its own stream,
            so adding a level does not change the others.
    """
    drawn: list[Injection] = []
    for index, level in enumerate(scenario.poisson):
        end = min(level.end_s or math.inf, horizon_s if horizon_s is not None else math.inf)
        if math.isinf(end):
            raise PlanError(
                f"{scenario.source}: {level.origin} has no end_s; give a horizon (--horizon-s)"
            )
        rng = random.Random(seed * 1_000_003 + index)
        rate = level.arrivals_per_min / 60.0
        for at in arrival_times(rate, start_s=level.start_s, end_s=end, rng=rng):
            spec = level.specs[rng.randrange(len(level.specs))]
            if isinstance(spec, LinkThrottle | Slowdown):
                spec = replace(spec, stage=rng.choice(level.stages))
            duration = max(rng.expovariate(1.0 / level.mean_duration_s), level.min_duration_s)
            duration = max(round(min(duration, end - at), 3), 0.001)
            drawn.append(
                Injection(spec=spec, origin=level.origin, at_s=round(at, 3), duration_s=duration)
            )
    timed = sorted(
        [i for i in scenario.injections if not i.by_iteration] + drawn,
        key=lambda i: i.at_s or 0.0,
    )
    counted = [i for i in scenario.injections if i.by_iteration]
    return replace(scenario, injections=(*timed, *counted), poisson=())
