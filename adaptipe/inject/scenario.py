"""Interference scenarios: a timeline of injections read from TOML, checked before anything runs.

An injection is keyed by seconds after the runner starts (``at_s``, ``duration_s``) or by
training iterations (``at_iteration``, ``iterations``), never both; without a duration it
lasts until the runner stops. ``[[poisson]]`` levels draw injections at random
(`adaptipe.inject.arrivals`). A scenario file::

    [[inject]]
    kind = "cpu_hog"        # cpu_hog | gpu_hog | memory | link_throttle | slowdown | kill | link_shape
    at_s = 5
    duration_s = 10
    cores = [1]             # also threads, intensity (busy fraction), method (spin | matmul)

    [[inject]]
    kind = "slowdown"       # the stage's compute takes `factor` times as long
    at_iteration = 20
    iterations = 50
    stage = 1
    factor = 2.5

    [[inject]]
    kind = "kill"           # spot preemption: a 10% chance every 5 minutes (DynPipe, AWS)
    at_s = 0
    stage = 0
    p = 0.1
    period_s = 300

    [[inject]]
    kind = "link_shape"     # host 1's link on the namespace-host bed "t1", with tc
    at_iteration = 40
    bed = "t1"              # or once at the top of the file; state_dir too
    host = 1
    rate = "20mbit"         # also delay, jitter, loss; a number is Mbit/s, ms, %
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from adaptipe.errors import PlanError
from adaptipe.netbed.bed import check_prefix
from adaptipe.netbed.parse import parse_shape
from adaptipe.netbed.shape import LinkShape
from adaptipe.serial import get_bool, get_float, get_int, get_list, get_str
from adaptipe.units import parse_bandwidth

if TYPE_CHECKING:
    from adaptipe.inject.arrivals import PoissonLevel

__all__ = [
    "KINDS",
    "CpuHog",
    "GpuHog",
    "Injection",
    "InjectorSpec",
    "Kill",
    "LinkReshape",
    "LinkThrottle",
    "MemoryPressure",
    "Scenario",
    "Slowdown",
    "load_scenario",
    "parse_scenario",
]


def _rule(kind: str, **rule: Any) -> dict[str, Any]:
    """Field metadata: how `FieldReader.value` reads and checks the field."""
    return {"kind": kind, **rule}


_POSITIVE = _rule("float", low=0.0)
_FRACTION = _rule("float", low=0.0, high=1.0)
_STAGE = _rule("stage")


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuHog:
    """Busy processes (one per thread, because of the GIL) pinned to `cores`.

    `cores=None` means every core the runner may use; `intensity` is the busy
    fraction of every 100 ms; `method="matmul"` runs a one-thread numpy matmul loop.
    """

    kind: ClassVar[str] = "cpu_hog"
    threads: int = field(default=1, metadata=_rule("int", minimum=1))
    cores: tuple[int, ...] | None = field(default=None, metadata=_rule("cores"))
    intensity: float = field(default=1.0, metadata=_FRACTION)
    method: str = field(default="spin", metadata=_rule("str", choices=("spin", "matmul")))


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuHog:
    kind: ClassVar[str] = "gpu_hog"
    device: int = field(default=0, metadata=_rule("int", minimum=0))
    size: int = field(default=4096, metadata=_rule("int", minimum=1))  # square matmul side
    intensity: float = field(default=1.0, metadata=_FRACTION)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPressure:
    """Hold `gib` GiB; `touch` writes every page so it is resident (false: only reserve).

    Without `stage` a child process holds it; with `stage` that stage's worker allocates
    it inside itself (`adaptipe.inject.inworker`), `grow_mb` MB more at each of its
    window boundaries (all at once without it): memory its own guard sees.
    """

    kind: ClassVar[str] = "memory"
    gib: float = field(default=1.0, metadata=_POSITIVE)
    touch: bool = field(default=True, metadata=_rule("bool"))
    stage: int | None = field(default=None, metadata=_STAGE)
    grow_mb: float | None = field(default=None, metadata=_POSITIVE)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkThrottle:
    """Every message the stage sends gets `extra_latency_s` and at most `bandwidth`."""

    kind: ClassVar[str] = "link_throttle"
    stage: int = field(metadata=_STAGE)
    bandwidth: str = field(default="inf", metadata=_rule("bandwidth"))
    extra_latency_s: float = field(default=0.0, metadata=_rule("float", minimum=0.0))

    @property
    def bandwidth_Bps(self) -> float:
        return parse_bandwidth(self.bandwidth)


@dataclass(frozen=True, slots=True, kw_only=True)
class Slowdown:
    """The stage's compute takes `factor` times as long (the runtime sleeps the difference)."""

    kind: ClassVar[str] = "slowdown"
    stage: int = field(metadata=_STAGE)
    factor: float = field(default=2.0, metadata=_rule("float", minimum=1.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class Kill:
    """Preempt a stage: once with probability `p`, or with probability `p` every period."""

    kind: ClassVar[str] = "kill"
    stage: int = field(metadata=_STAGE)
    p: float = field(default=1.0, metadata=_FRACTION)
    period_s: float | None = field(default=None, metadata=_POSITIVE)
    period_iterations: int | None = field(default=None, metadata=_rule("int", minimum=1))


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkReshape:
    """Host `host`'s link on the namespace-host bed `bed` takes this shape, through ``tc``
    (`adaptipe.netbed.shape`); when the injection ends the link gets back the shape it
    would have without it. A rate is text with a unit (``"100mbit"``) or Mbit/s, a delay
    or jitter ``"5ms"`` or ms, a loss ``"0.1%"`` or percent (`adaptipe.netbed.parse`).
    """

    kind: ClassVar[str] = "link_shape"
    host: int = field(metadata=_rule("int", minimum=0))
    bed: str = field(metadata=_rule("bed"))
    state_dir: str | None = field(default=None, metadata=_rule("str"))
    rate: str | float | None = field(default=None, metadata=_rule("shape"))
    delay: str | float | None = field(default=None, metadata=_rule("shape"))
    jitter: str | float | None = field(default=None, metadata=_rule("shape"))
    loss: str | float | None = field(default=None, metadata=_rule("shape"))

    @property
    def shape(self) -> LinkShape:
        return parse_shape(rate=self.rate, delay=self.delay, jitter=self.jitter, loss=self.loss)


InjectorSpec = CpuHog | GpuHog | MemoryPressure | LinkThrottle | Slowdown | Kill | LinkReshape
SPECS: dict[str, type[InjectorSpec]] = {
    c.kind: c for c in (CpuHog, GpuHog, MemoryPressure, LinkThrottle, Slowdown, Kill, LinkReshape)
}
KINDS = tuple(SPECS)
_TOP = ("inject", "levels", "poisson", "bed", "state_dir")  # bed, state_dir: for link_shape
_SHAPE_FIELDS = ("rate", "delay", "jitter", "loss")
_SECONDS = ("at_s", "duration_s", "period_s")
_ITERATIONS = ("at_iteration", "iterations", "period_iterations")


@dataclass(frozen=True, slots=True, kw_only=True)
class Injection:
    """One injector over one window; `origin` says where it came from (``inject[2]``)."""

    spec: InjectorSpec
    origin: str
    at_s: float | None = field(default=None, metadata=_rule("float", minimum=0.0))
    duration_s: float | None = field(default=None, metadata=_POSITIVE)  # None: until stop
    at_iteration: int | None = field(default=None, metadata=_rule("int", minimum=0))
    iterations: int | None = field(default=None, metadata=_rule("int", minimum=1))

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def stage(self) -> int | None:
        return getattr(self.spec, "stage", None)

    @property
    def by_iteration(self) -> bool:
        return self.at_iteration is not None

    def fields(self) -> dict[str, Any]:
        """The injector's own fields, JSON-ready."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.spec).items()}

    def describe(self) -> str:
        # a link shape without a duration also ends when a later one on its link starts
        forever = "until replaced or stop" if isinstance(self.spec, LinkReshape) else "until stop"
        if self.by_iteration:
            end = forever if self.iterations is None else f"for {self.iterations} iterations"
            when = f"iteration {self.at_iteration} {end}"
        else:
            end = forever if self.duration_s is None else f"for {round(self.duration_s, 1):g} s"
            when = f"{round(self.at_s or 0.0, 1):g} s {end}"
        what = " ".join(f"{k}={v}" for k, v in self.fields().items() if v is not None)
        return f"{when}: {self.kind} {what} ({self.origin})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    source: str
    injections: tuple[Injection, ...] = ()
    poisson: tuple[PoissonLevel, ...] = ()  # expand() turns these into injections
    num_stages: int | None = None


def load_scenario(
    path: str | os.PathLike[str], *, num_stages: int | None = None, num_cores: int | None = None
) -> Scenario:
    """Read and check a scenario file; stages are checked when `num_stages` is given."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise PlanError(f"{p}: no such file") from None
    except OSError as exc:
        raise PlanError(f"{p}: cannot read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        m = re.match(r"^(.*) \(at line (\d+), column (\d+)\)$", str(exc))
        where = f"line {m.group(2)}, column {m.group(3)}: {m.group(1)}" if m else str(exc)
        raise PlanError(f"{p}: not valid TOML ({where})") from None
    return parse_scenario(data, source=str(p), num_stages=num_stages, num_cores=num_cores)


def parse_scenario(
    data: Mapping[str, Any],
    *,
    source: str,
    num_stages: int | None = None,
    num_cores: int | None = None,
) -> Scenario:
    """Check a scenario given as TOML-shaped data; `num_cores` defaults to os.cpu_count()."""
    from adaptipe.inject.arrivals import parse_poisson  # arrivals builds on this module

    reader = FieldReader(source, num_stages, num_cores or os.cpu_count() or 1)
    for key in data:
        if key not in _TOP:
            raise PlanError(f"{source}: {key} is not a section or key (allowed: {', '.join(_TOP)})")
    reader.bed_defaults = {k: data[k] for k in ("bed", "state_dir") if k in data}
    bed_fields = {f.name: f for f in fields(LinkReshape)}
    for key, value in reader.bed_defaults.items():  # checked even if no entry needs them
        reader.value(bed_fields[key], {key: value}, "")
    tables = get_list(data, "inject", source=source, default=[])
    return Scenario(
        source=source,
        injections=tuple(reader.injection(t, f"inject[{i}]") for i, t in enumerate(tables)),
        poisson=parse_poisson(data, reader),
        num_stages=num_stages,
    )


class FieldReader:
    """Reads fields as their metadata says; every error names file, table and field."""

    def __init__(self, source: str, num_stages: int | None, num_cores: int) -> None:
        self.source, self.num_stages, self.num_cores = source, num_stages, num_cores
        self.bed_defaults: dict[str, Any] = {}  # the scenario's own bed and state_dir

    def fail(self, where: str, message: str) -> PlanError:
        return PlanError(f"{self.source}: {where} {message}")

    def mapping(self, t: object, where: str) -> Mapping[str, Any]:
        if not isinstance(t, Mapping):
            raise self.fail(where, f"must be a table (got {type(t).__name__})")
        return t

    def table(self, t: Any, where: str, allowed: tuple[str, ...], what: str) -> Mapping[str, Any]:
        """`t` as a table whose every key is one of `allowed` (the fields of `what`)."""
        table = self.mapping(t, where)
        for key in table:
            if key not in allowed:
                message = f"is not a field of {what} (allowed: {', '.join(allowed)})"
                raise self.fail(f"{where}.{key}", message)
        return table

    def value(self, f: Field[Any], t: Mapping[str, Any], where: str) -> Any:
        rule, key, src, pre = f.metadata, f.name, self.source, f"{where}." if where else ""
        kind = rule["kind"]
        if kind in ("int", "stage"):
            value: Any = get_int(t, key, source=src, prefix=pre, minimum=rule.get("minimum"))
            return self.stage(value, pre + key) if kind == "stage" else value
        if kind == "float":
            value = get_float(t, key, source=src, prefix=pre, minimum=rule.get("minimum"))
            low, high = rule.get("low", -math.inf), rule.get("high", math.inf)
            if not low < value <= high:
                allowed = f"> {low:g}" if high == math.inf else f"in ({low:g}, {high:g}]"
                raise self.fail(pre + key, f"must be a number {allowed} (got {value:g})")
            return value
        if kind == "bool":
            return get_bool(t, key, source=src, prefix=pre)
        if kind == "str":
            return get_str(t, key, source=src, prefix=pre, choices=rule.get("choices"))
        if kind == "bed":
            text = get_str(t, key, source=src, prefix=pre)
            try:
                return check_prefix(text)
            except PlanError:
                raise self.fail(
                    pre + key, f"must be a bed's prefix: 1 to 8 of a-z, 0-9 (got {text!r})"
                ) from None
        if kind == "shape":
            value = t[key]
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise self.fail(pre + key, f"must be text with a unit or a number (got {value!r})")
            return value
        if kind == "bandwidth":
            text = get_str(t, key, source=src, prefix=pre)
            parse_bandwidth(text, what=f"{src}: {pre}{key}")
            return text
        assert kind == "cores", kind
        cores = get_list(t, key, source=src, prefix=pre)
        n = self.num_cores
        if not cores or len(set(map(repr, cores))) < len(cores):
            raise self.fail(pre + key, f"must list distinct core ids (got {cores})")
        for c in cores:
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < n:
                raise self.fail(pre + key, f"must list core ids in 0..{n - 1} (got {c!r})")
        return tuple(cores)

    def stage(self, value: int, where: str) -> int:
        n = self.num_stages
        if value < 0 or (n is not None and value >= n):
            exists = "" if n is None else f" (the run has {n} stages: 0..{n - 1})"
            raise self.fail(where, f"must name a stage: stage {value} does not exist{exists}")
        return value

    def spec(self, kind: str, t: Mapping[str, Any], where: str) -> InjectorSpec:
        """Build injector `kind` from the fields of `t` it names (checked by the caller)."""
        cls = SPECS[kind]
        if cls is LinkReshape:
            t = self._bed_of(t, where)
        for f in fields(cls):
            if f.default is MISSING and f.name not in t:
                raise self.fail(f"{where}.{f.name}", f"is missing (a {kind} needs it)")
        spec = cls(**{f.name: self.value(f, t, where) for f in fields(cls) if f.name in t})
        if isinstance(spec, GpuHog):
            _check_cuda(spec.device, self.source, where)
        if (
            isinstance(spec, LinkThrottle)
            and not spec.extra_latency_s
            and math.isinf(spec.bandwidth_Bps)
        ):
            nothing = 'throttles nothing: give bandwidth (e.g. "100MB/s") or extra_latency_s'
            raise self.fail(where, nothing)
        if isinstance(spec, MemoryPressure) and spec.stage is None and spec.grow_mb is not None:
            raise self.fail(
                f"{where}.grow_mb", "applies to memory inside a stage's worker: give stage too"
            )
        if isinstance(spec, LinkReshape):
            if all(getattr(spec, name) is None for name in _SHAPE_FIELDS):
                nothing = 'sets no shape: give rate, delay, jitter or loss (rate = "inf": no limit)'
                raise self.fail(where, nothing)
            parse_shape(
                **{n: getattr(spec, n) for n in _SHAPE_FIELDS}, where=f"{self.source}: {where}."
            )
        return spec

    def _bed_of(self, t: Mapping[str, Any], where: str) -> Mapping[str, Any]:
        """`t` with the scenario's bed and state_dir where it gives none; a link_shape
        without a bed is refused here, before anything runs."""
        t = {**self.bed_defaults, **t}
        if "bed" not in t:
            raise self.fail(
                where,
                "(link_shape) needs a bed: link_shape reshapes a link of a namespace-host bed "
                '(`adaptipe hosts up --prefix PREFIX`) with tc; give bed = "PREFIX" in the '
                "entry or at the top of the scenario (and state_dir if the bed's state file "
                "is not in the default folder)",
            )
        return t

    def injection(self, t: Any, where: str) -> Injection:
        t = self.mapping(t, where)
        kind = get_str(t, "kind", source=self.source, prefix=f"{where}.", choices=KINDS)
        own = [f.name for f in fields(SPECS[kind])]
        timing = [f for f in fields(Injection) if "kind" in f.metadata and f.name not in own]
        t = self.table(t, where, ("kind", *(f.name for f in timing), *own), kind)
        secs, its = [k for k in _SECONDS if k in t], [k for k in _ITERATIONS if k in t]
        if secs and its:
            mixed = f"mixes seconds ({', '.join(secs)}) and iterations ({', '.join(its)})"
            raise self.fail(where, f"{mixed}: key it by at_s/duration_s or at_iteration/iterations")
        start = "at_iteration" if its else "at_s"
        if start not in t:
            raise self.fail(where, "needs a start: at_s (seconds) or at_iteration (iterations)")
        spec = self.spec(kind, t, where)
        length = "iterations" if its else "duration_s"
        if isinstance(spec, Kill) and length in t and not (spec.period_s or spec.period_iterations):
            raise self.fail(f"{where}.{length}", "applies only to a kill with a period")
        when = {f.name: self.value(f, t, where) for f in timing if f.name in t}
        return Injection(spec=spec, origin=where, **when)


def _check_cuda(device: int, source: str, where: str) -> None:
    import torch  # only scenarios with a GPU hog pay for importing torch

    if not torch.cuda.is_available():
        raise PlanError(f"{source}: {where}: gpu_hog needs a CUDA device; none is available")
    count = torch.cuda.device_count()
    if device >= count:
        raise PlanError(
            f"{source}: {where}.device must be < {count} (this machine has {count} CUDA devices) (got {device})"
        )
