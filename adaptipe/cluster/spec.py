"""What Gavel schedules: a cluster of device types and jobs with a throughput per type.

A `Cluster` names its device types, how many workers of each it has and, optionally, a
price per worker-hour. A `ClusterJob` (a single job or a whole job-array: it holds its
workers as one) has a throughput per device type in steps per second (0 where it cannot
run there), the steps it needs, the workers it takes at once (``scale``), a weight for
fairness, its arrival time and, optionally, a completion-time SLO in seconds from its
arrival. Both read from plain JSON (`Cluster.from_json`, `ClusterJob.from_json`);
errors name the file, the field and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError

__all__ = ["Cluster", "ClusterJob", "throughput_matrix"]


def _number(
    where: str, name: str, value: Any, *, minimum: float = 0.0, strict: bool = False
) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value <= minimum):
        rule = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise PlanError(f"{where}: {name} must be a finite number {rule} (got {value!r})")
    return float(value)


def _int(where: str, name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{where}: {name} must be an int >= {minimum} (got {value!r})")
    return value


def _unknown(where: str, data: Mapping[str, Any], allowed: Sequence[str]) -> None:
    extra = sorted(set(data) - set(allowed))
    if extra:
        raise PlanError(f"{where}: unknown field {extra[0]!r} (allowed: {', '.join(allowed)})")


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """Device types, in a fixed order, with worker counts and prices per worker-hour."""

    types: tuple[str, ...]
    workers: tuple[int, ...]
    prices: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.types or len(set(self.types)) != len(self.types):
            raise PlanError(f"cluster: device types must be distinct and given ({self.types})")
        if len(self.workers) != len(self.types) or any(n < 0 for n in self.workers):
            raise PlanError("cluster: one worker count >= 0 per device type")
        if self.prices is not None and len(self.prices) != len(self.types):
            raise PlanError("cluster: one price per device type")

    @property
    def total(self) -> int:
        return sum(self.workers)

    def to_json(self) -> dict[str, Any]:
        devices = []
        for i, name in enumerate(self.types):
            entry: dict[str, Any] = {"type": name, "count": self.workers[i]}
            if self.prices is not None:
                entry["price_per_hour"] = self.prices[i]
            devices.append(entry)
        return {"devices": devices}

    @classmethod
    def from_json(cls, data: Any, *, source: str = "cluster") -> Cluster:
        if not isinstance(data, Mapping) or not isinstance(data.get("devices"), list):
            raise PlanError(f"{source}: needs 'devices', a list of {{type, count}} tables")
        _unknown(source, data, ("devices",))
        types, counts, prices = [], [], []
        for i, entry in enumerate(data["devices"]):
            where = f"{source}: devices[{i}]"
            if not isinstance(entry, Mapping):
                raise PlanError(f"{where}: must be a table with type and count")
            _unknown(where, entry, ("type", "count", "price_per_hour"))
            name = entry.get("type")
            if not isinstance(name, str) or not name:
                raise PlanError(f"{where}: type must be a non-empty string (got {name!r})")
            if name in types:
                raise PlanError(f"{where}: type {name!r} is given twice")
            types.append(name)
            counts.append(_int(where, "count", entry.get("count"), minimum=0))
            if "price_per_hour" in entry:
                prices.append(_number(where, "price_per_hour", entry["price_per_hour"]))
        if prices and len(prices) != len(types):
            raise PlanError(f"{source}: give price_per_hour for every device type or none")
        if not types:
            raise PlanError(f"{source}: devices is empty")
        return cls(types=tuple(types), workers=tuple(counts), prices=tuple(prices) or None)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterJob:
    """One job (or job-array) to place: steps per second per device type."""

    name: str
    throughputs: Mapping[str, float] = field(hash=False)
    steps: float
    scale: int = 1
    weight: float = 1.0
    arrival_s: float = 0.0
    slo_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "throughputs": dict(self.throughputs),
            "steps": self.steps,
            "scale": self.scale,
            "weight": self.weight,
            "arrival_s": self.arrival_s,
        }
        if self.slo_s is not None:
            out["slo_s"] = self.slo_s
        return out

    @classmethod
    def from_json(cls, data: Any, *, source: str, types: Sequence[str]) -> ClusterJob:
        if not isinstance(data, Mapping):
            raise PlanError(f"{source}: a job must be a table")
        allowed = ("name", "throughputs", "steps", "scale", "weight", "arrival_s", "slo_s")
        _unknown(source, data, allowed)
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise PlanError(f"{source}: name must be a non-empty string (got {name!r})")
        where = f"{source} ({name})"
        tput = data.get("throughputs")
        if not isinstance(tput, Mapping):
            raise PlanError(f"{where}: throughputs must be a table of device type -> steps/s")
        for key in tput:
            if key not in types:
                raise PlanError(
                    f"{where}: throughputs: unknown device type {key!r} "
                    f"(allowed: {', '.join(types)})"
                )
        values = {t: _number(where, f"throughputs.{t}", tput.get(t, 0.0)) for t in types}
        if not any(values.values()):
            raise PlanError(f"{where}: throughputs are all 0: the job can run nowhere")
        slo = data.get("slo_s")
        return cls(
            name=name,
            throughputs=values,
            steps=_number(where, "steps", data.get("steps"), strict=True),
            scale=_int(where, "scale", data.get("scale", 1), minimum=1),
            weight=_number(where, "weight", data.get("weight", 1.0), strict=True),
            arrival_s=_number(where, "arrival_s", data.get("arrival_s", 0.0)),
            slo_s=None if slo is None else _number(where, "slo_s", slo, strict=True),
        )


def throughput_matrix(jobs: Sequence[ClusterJob], cluster: Cluster) -> npt.NDArray[np.float64]:
    """T[m, j]: job m's steps per second on device type j."""
    return np.array(
        [[job.throughputs.get(t, 0.0) for t in cluster.types] for job in jobs], dtype=np.float64
    ).reshape(len(jobs), len(cluster.types))
