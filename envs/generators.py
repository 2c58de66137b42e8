"""Trace generators: seeded, deterministic `Trace` families for the controllers' proving
ground, each after a paper's setting.

``generate(family, stages=, iterations=, seed=, **params)`` builds one; `FAMILIES` lists
them with their parameters (`Family.defaults`). The same arguments give the same trace,
byte for byte (numpy's ``default_rng`` seeded by ``seed``).

- ``bandwidth-steps`` (AutoPipe, seed 003, Sec. VI, Fig. 9): every link steps 10 -> 25
  -> 40 -> 100 Gbit/s every ``period`` = 20 iterations, cycling; slowdowns stay 1.
- ``colocated``: co-located jobs arrive on each stage as a Poisson process
  (``rate_per_min`` per stage) and stay an exponential time (``mean_duration_s``, at
  least ``min_duration_s``); each adds a uniform draw from [``extra_min``, ``extra_max``]
  to its stage's slowdown (DynPipe Table I: one to three co-located trainings made an
  iteration 1.1-3.2x as long). ``arrive``/``leave`` events name the stage.
- ``poisson-light`` / ``poisson-heavy`` (DynPipe, seed 004, Sec. VII-A5): external tasks
  arrive as one Poisson process over the pipeline, on a stage drawn uniformly; heavy is
  the light rate tripled. The paper gives no rate or duration: the runtime's levels
  (`adaptipe.inject.arrivals`, ``examples/interference-heavy.toml``) do, 1 arrival a
  minute at multiplier 1 (``light = 1.0``, ``heavy = 3.0``), lasting 30 s on average and
  at least 5 s. A task's time ratio is one of Table I's (1.1, 1.8, 3.2), drawn uniformly;
  tasks overlapping on a stage add their excess (``1 + sum(ratio - 1)``).
- ``preemption`` (DynPipe Sec. VII-A5, after AWS spot instances): each stage has a
  ``p`` = 10% chance of being preempted every ``period_s`` = 5 minutes, as a constant
  hazard per iteration of ``iteration_s`` seconds (``1 - (1 - p)^(iteration_s /
  period_s)``), so preemptions are not tied to 5-minute marks; a ``preempt`` event
  carries ``stall_s`` (4.5 s: the restart stall ``bench/bench_migration.py`` measured,
  3.9-5.2 s, docs/benchmarks.md).
- ``mixture``: the families in ``of`` (default poisson-light, bandwidth-steps,
  preemption) at once: slowdowns multiply, a link's bandwidth is the lowest, events are
  united. A component's own parameter is given as ``"FAMILY.NAME"`` (``preemption.p``);
  ``iteration_s`` and the device parameters are the mixture's. Each event says its
  ``family``; ``bandwidth`` events follow the joined links.

Time-based families turn seconds into iterations with a nominal ``iteration_s`` (1 s).
Families that do not vary the link take ``link_Bps`` (bytes/s, or text such as
``"10Gbit/s"``; None: unlimited). Every family fills each row's ``device`` readings from
its interference (`adaptipe.envs.readings`: ``num_cpus``, ``mem_total_gib``, ``noise``;
``readings = false`` leaves them out, which long traces generate faster without).
A string value (the CLI's ``--set NAME=VALUE``) is read as the parameter's type; a
list may be given comma-separated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptipe.envs.params import read_params, rule, to_json
from adaptipe.envs.readings import synthesize
from adaptipe.envs.trace import Trace, TraceRow
from adaptipe.errors import PlanError
from adaptipe.inject.arrivals import DEFAULT_LEVELS

__all__ = ["FAMILIES", "Family", "generate"]

Array = npt.NDArray[np.float64]
Event = dict[str, Any]


_COMPONENTS = ("bandwidth-steps", "colocated", "poisson-light", "poisson-heavy", "preemption")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Params:
    """What every family takes: the device readings' model (`adaptipe.envs.readings`)."""

    num_cpus: int = field(default=8, metadata=rule("int", minimum=1))
    mem_total_gib: float = field(default=32.0, metadata=rule("float", above=0.0))
    noise: float = field(default=0.05, metadata=rule("float", minimum=0.0))
    readings: bool = field(default=True, metadata=rule("bool"))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Steps(_Params):
    steps_gbit: tuple[float, ...] = field(
        default=(10.0, 25.0, 40.0, 100.0), metadata=rule("floats", above=0.0)
    )
    period: int = field(default=20, metadata=rule("int", minimum=1))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Timed(_Params):
    iteration_s: float = field(default=1.0, metadata=rule("float", above=0.0))
    link_Bps: float | None = field(default=None, metadata=rule("bandwidth"))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Jobs(_Timed):
    mean_duration_s: float = field(default=30.0, metadata=rule("float", above=0.0))
    min_duration_s: float = field(default=5.0, metadata=rule("float", minimum=0.0))
    job_gib: float = field(default=1.0, metadata=rule("float", minimum=0.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Colocated(_Jobs):
    rate_per_min: float = field(default=0.5, metadata=rule("float", above=0.0))  # per stage
    mean_duration_s: float = field(default=120.0, metadata=rule("float", above=0.0))
    extra_min: float = field(default=0.1, metadata=rule("float", minimum=0.0))
    extra_max: float = field(default=0.8, metadata=rule("float", minimum=0.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Poisson(_Jobs):
    rate_per_min: float = field(default=1.0, metadata=rule("float", above=0.0))  # at x1
    ratios: tuple[float, ...] = field(default=(1.1, 1.8, 3.2), metadata=rule("floats", minimum=1.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Preemption(_Timed):
    p: float = field(default=0.1, metadata=rule("float", above=0.0, maximum=1.0))
    period_s: float = field(default=300.0, metadata=rule("float", above=0.0))
    stall_s: float = field(default=4.5, metadata=rule("float", minimum=0.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Mixture(_Params):
    of: tuple[str, ...] = field(
        default=("poisson-light", "bandwidth-steps", "preemption"),
        metadata=rule("names", choices=_COMPONENTS),
    )
    iteration_s: float = field(default=1.0, metadata=rule("float", above=0.0))
    # each component's checked parameters, from the "FAMILY.NAME" ones (`_components`)
    components: Mapping[str, _Params] = field(default_factory=dict, metadata=rule("internal"))


@dataclass(slots=True)
class _Parts:
    """A family's conditions before the readings: ``(iterations, stages)`` slowdowns, busy
    cores and memory of co-located jobs; ``(iterations, links)`` bandwidths; events."""

    slowdown: Array
    bandwidth: Array
    cores: Array
    memory: Array
    events: list[list[Event]]

    @classmethod
    def quiet(cls, iterations: int, stages: int, link_Bps: float | None = None) -> _Parts:
        link = math.inf if link_Bps is None else link_Bps
        return cls(
            slowdown=np.ones((iterations, stages)),
            bandwidth=np.full((iterations, stages - 1), link),
            cores=np.zeros((iterations, stages)),
            memory=np.zeros((iterations, stages)),
            events=[[] for _ in range(iterations)],
        )

    def join(self, other: _Parts) -> _Parts:
        return _Parts(
            slowdown=self.slowdown * other.slowdown,
            bandwidth=np.minimum(self.bandwidth, other.bandwidth),
            cores=self.cores + other.cores,
            memory=self.memory + other.memory,
            events=[a + b for a, b in zip(self.events, other.events, strict=True)],
        )


Build = Callable[[Any, int, int, np.random.Generator], _Parts]


@dataclass(frozen=True, slots=True)
class Family:
    """A generator: its parameters' type (defaults: `defaults`), builder and source."""

    name: str
    params: type[_Params]
    build: Build
    source: str

    def defaults(self) -> dict[str, Any]:
        return to_json(self.params())


def _steps(p: _Steps, stages: int, iterations: int, rng: np.random.Generator) -> _Parts:
    parts = _Parts.quiet(iterations, stages)
    step = (np.arange(iterations) // p.period) % len(p.steps_gbit)
    parts.bandwidth[:] = (np.asarray(p.steps_gbit) * 1e9 / 8)[step][:, None]
    return parts


def _arrivals(rng: np.random.Generator, rate_per_s: float, horizon_s: float) -> Array:
    """Arrival times of a Poisson process of ``rate_per_s`` in [0, horizon_s)."""
    times: list[Array] = []
    t = 0.0
    while t < horizon_s:
        expected = rate_per_s * (horizon_s - t)
        gaps = rng.exponential(1.0 / rate_per_s, int(expected + 5 * math.sqrt(expected) + 16))
        batch = t + np.cumsum(gaps)
        t = float(batch[-1])
        times.append(batch[batch < horizon_s])
    return np.concatenate(times) if times else np.zeros(0)


def _add_jobs(
    parts: _Parts,
    p: _Jobs,
    at_s: Array,
    stage: npt.NDArray[np.int64],
    extra: Array,
    rng: np.random.Generator,
) -> None:
    """Co-located jobs arriving at ``at_s`` on ``stage``, each adding ``extra`` to the
    stage's slowdown, keeping ``2 extra`` cores busy and holding ``job_gib``."""
    iterations = parts.slowdown.shape[0]
    durations = np.maximum(rng.exponential(p.mean_duration_s, len(at_s)), p.min_duration_s)
    for job, (t, s, x, d) in enumerate(zip(at_s, stage, extra, durations, strict=True)):
        start = int(t // p.iteration_s)
        end = min(start + max(1, math.ceil(d / p.iteration_s)), iterations)
        s = int(s)
        parts.slowdown[start:end, s] += x
        parts.cores[start:end, s] += 2 * x
        parts.memory[start:end, s] += p.job_gib * 2**30
        parts.events[start].append({"kind": "arrive", "stage": s, "job": job, "adds": round(x, 4)})
        if end < iterations:
            parts.events[end].append({"kind": "leave", "stage": s, "job": job})


def _colocated(p: _Colocated, stages: int, iterations: int, rng: np.random.Generator) -> _Parts:
    if p.extra_max < p.extra_min:
        raise PlanError(
            f"family colocated: extra_max must be >= extra_min = {p.extra_min:g} "
            f"(got {p.extra_max:g})"
        )
    parts = _Parts.quiet(iterations, stages, p.link_Bps)
    horizon = iterations * p.iteration_s
    at = [_arrivals(rng, p.rate_per_min / 60, horizon) for _ in range(stages)]
    at_s = np.concatenate(at)
    stage = np.concatenate([np.full(len(a), s, dtype=np.int64) for s, a in enumerate(at)])
    order = np.argsort(at_s, kind="stable")
    extra = rng.uniform(p.extra_min, p.extra_max, len(at_s))
    _add_jobs(parts, p, at_s[order], stage[order], extra, rng)
    return parts


def _poisson(level: str) -> Build:
    def build(p: _Poisson, stages: int, iterations: int, rng: np.random.Generator) -> _Parts:
        parts = _Parts.quiet(iterations, stages, p.link_Bps)
        rate = p.rate_per_min * DEFAULT_LEVELS[level] / 60
        at_s = _arrivals(rng, rate, iterations * p.iteration_s)
        stage = rng.integers(0, stages, len(at_s))
        extra = rng.choice(np.asarray(p.ratios), len(at_s)) - 1.0
        _add_jobs(parts, p, at_s, stage, extra, rng)
        return parts

    return build


def _preemption(p: _Preemption, stages: int, iterations: int, rng: np.random.Generator) -> _Parts:
    parts = _Parts.quiet(iterations, stages, p.link_Bps)
    hazard = 1.0 - (1.0 - p.p) ** (p.iteration_s / p.period_s)
    for i, s in zip(*np.nonzero(rng.random((iterations, stages)) < hazard), strict=True):
        parts.events[int(i)].append({"kind": "preempt", "stage": int(s), "stall_s": p.stall_s})
    return parts


def _mixture(p: _Mixture, stages: int, iterations: int, rng: np.random.Generator) -> _Parts:
    parts = _Parts.quiet(iterations, stages)
    for name, child in zip(p.of, rng.spawn(len(p.of)), strict=True):  # a stream each
        part = FAMILIES[name].build(p.components[name], stages, iterations, child)
        for events in part.events:
            for e in events:
                e["family"] = name  # whose job or preemption it is
        parts = parts.join(part)
    return parts


_DYNPIPE = "DynPipe (seed 004) Sec. VII-A5 and Table I; rates of adaptipe.inject.arrivals"
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("bandwidth-steps", _Steps, _steps, "AutoPipe (seed 003) Sec. VI, Fig. 9"),
        Family("colocated", _Colocated, _colocated, "co-located jobs; DynPipe Table I ratios"),
        Family("poisson-light", _Poisson, _poisson("light"), _DYNPIPE),
        Family("poisson-heavy", _Poisson, _poisson("heavy"), _DYNPIPE),
        Family("preemption", _Preemption, _preemption, "DynPipe Sec. VII-A5 (AWS spot)"),
        Family("mixture", _Mixture, _mixture, "the families in `of`, at once"),
    )
}
_OWN = tuple(f.name for f in fields(_Mixture))  # a mixture's, never a component's


def generate(family: str, *, stages: int, iterations: int, seed: int, **params: Any) -> Trace:
    """A ``family`` trace (see the module doc) of ``iterations`` rows on ``stages`` stages.

    Raises:
        PlanError: an unknown family or parameter, or a bad value; the message says what
            is allowed.
    """
    if family not in FAMILIES:
        raise PlanError(f"unknown trace family {family!r} (allowed: {', '.join(FAMILIES)})")
    for name, value, low in (
        ("stages", stages, 1),
        ("iterations", iterations, 1),
        ("seed", seed, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PlanError(f"family {family}: {name} must be an integer >= {low} (got {value!r})")
    spec = FAMILIES[family]
    own = _params(spec, {k: v for k, v in params.items() if "." not in k}, f"family {family}: ")
    if isinstance(own, _Mixture):
        own = replace(own, components=_components(own, params))
    elif any("." in k for k in params):
        dotted = next(k for k in params if "." in k)
        raise PlanError(f"family {family}: {dotted} is not a parameter (FAMILY.NAME: mixture only)")
    parts = spec.build(own, stages, iterations, np.random.default_rng(seed))
    meta: dict[str, Any] = {"generator": "adaptipe.envs.generators", "source": spec.source}
    meta["params"] = to_json(own, leave_out=_OWN)
    return _finish(parts, own, family=family, seed=seed, meta=meta)


def _components(p: _Mixture, params: Mapping[str, Any]) -> dict[str, _Params]:
    """The mixture's components' parameters, from ``"FAMILY.NAME"`` keys of ``params``."""
    given: dict[str, dict[str, Any]] = {name: {} for name in p.of}
    for key, value in params.items():
        if "." not in key:
            continue
        name, _, param = key.partition(".")
        if name not in given:
            raise PlanError(
                f"family mixture: {key} names {name!r}, which is not in of (allowed: "
                f"{', '.join(f'{n}.NAME' for n in p.of)})"
            )
        if param in _OWN:
            raise PlanError(f"family mixture: set {param} on the mixture, not as {key}")
        given[name][param] = value
    out = {}
    for name in p.of:
        spec = FAMILIES[name]
        if any(f.name == "iteration_s" for f in fields(spec.params)):
            given[name]["iteration_s"] = p.iteration_s
        out[name] = _params(spec, given[name], f"family mixture: {name}.")
    return out


def _finish(parts: _Parts, p: _Params, *, family: str, seed: int, meta: dict[str, Any]) -> Trace:
    iterations, stages = parts.slowdown.shape
    slowdown = np.round(parts.slowdown, 4).tolist()
    bandwidth = parts.bandwidth.tolist()
    device: list[tuple[Mapping[str, float], ...]] = [()] * iterations
    if p.readings:
        rng = np.random.default_rng([seed, 1 << 20])  # apart from the conditions' streams
        device = synthesize(
            parts.slowdown,
            parts.cores,
            parts.memory,
            rng=rng,
            num_cpus=p.num_cpus,
            mem_total_gib=p.mem_total_gib,
            noise=p.noise,
        )
    rows = []
    for i in range(iterations):
        changed = [
            {"kind": "bandwidth", "link": j, "bandwidth_Bps": b if math.isfinite(b) else None}
            for j, b in enumerate(bandwidth[i])
            if i > 0 and b != bandwidth[i - 1][j]
        ]
        rows.append(
            TraceRow(
                slowdown=tuple(slowdown[i]),
                bandwidth_Bps=tuple(bandwidth[i]),
                device=device[i],
                events=tuple(changed + parts.events[i]),
            )
        )
    return Trace(stages=stages, family=family, rows=tuple(rows), seed=seed, meta=meta)


def _params(spec: Family, raw: Mapping[str, Any], where: str) -> _Params:
    return read_params(spec.params, raw, where=where, what=spec.name)
