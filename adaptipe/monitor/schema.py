"""Versioned telemetry records and their wire format.

Stage workers publish these records over ZeroMQ and the manager stores them, so every
frame that arrives is untrusted input: :func:`decode` checks size, encoding, version,
record type and every field (type, range, required, unknown), and turns any problem into
a :class:`TelemetryError` whose ``reason`` the collector counts. Nothing here can run
code from a frame (msgpack or JSON, never pickle).

A frame is one msgpack map (JSON object bytes are accepted too, for hand-written tools)
``{"v": SCHEMA_VERSION, "type": "stage_stats", ...fields}``. Records validate their
fields when constructed, so a worker learns about a bad value where it makes it, and the
schema limits (list lengths, string lengths, map sizes) keep every valid record under
:data:`MAX_FRAME_BYTES`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal, Self

import msgpack

from adaptipe.errors import AdaptipeError

__all__ = [
    "MAX_FRAME_BYTES",
    "REASONS",
    "SCHEMA_VERSION",
    "DeviceSample",
    "Event",
    "LinkSample",
    "MonitorError",
    "Record",
    "Source",
    "StageStats",
    "TelemetryError",
    "decode",
]

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024
#: Every ``TelemetryError.reason``; the collector counts rejections under these keys.
REASONS = (
    "oversized",
    "malformed",
    "wrong-version",
    "unknown-type",
    "missing-field",
    "unknown-field",
    "bad-field",
)
Source = Literal["nvml", "cpu"]

_MAX_STAGE = 65_535
_MAX_LAYERS = 2048  # 2 lists x 2048 x 9 bytes stays well under MAX_FRAME_BYTES
_MAX_SECONDS = 1e7  # ~115 days: anything longer is garbage, not a measurement
_MAX_TIME = 1e11  # a Unix wall time (year ~5000)
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_KIND = re.compile(r"[a-z][a-z0-9-]{0,63}")


class MonitorError(AdaptipeError, ValueError):
    """The monitor was set up wrongly (address, keys, interval): the message says how."""


class TelemetryError(MonitorError):
    """A telemetry frame or record is invalid; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


Checker = Callable[[str, Any], Any]


def _bad(name: str, allowed: str, value: Any) -> TelemetryError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return TelemetryError("bad-field", f"{name} must be {allowed} (got {shown})")


def _num(lo: float, hi: float, *, integer: bool = False) -> Checker:
    """A number (an integer if ``integer``) in [lo, hi]; bools and NaN are refused."""
    allowed = f"{'an integer' if integer else 'a number'} in [{lo:g}, {hi:g}]"
    types = int if integer else (int, float)

    def check(name: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, types):
            raise _bad(name, allowed, value)
        try:
            ok = lo <= value <= hi if integer else lo <= float(value) <= hi
        except OverflowError:  # a JSON integer too large for a float
            ok = False
        if not ok:
            raise _bad(name, allowed, value)
        return value if integer else float(value)

    return check


def _optional(inner: Checker) -> Checker:
    return lambda name, value: None if value is None else inner(name, value)


def _text(max_len: int, pattern: re.Pattern[str] | None = None) -> Checker:
    def check(name: str, value: Any) -> str:
        ok = isinstance(value, str) and 0 < len(value) <= max_len and value.isprintable()
        if not ok or (pattern is not None and not pattern.fullmatch(value)):
            what = f"matching {pattern.pattern}" if pattern else "printable"
            raise _bad(name, f"a {what} string of 1-{max_len} characters", value)
        return str(value)

    return check


def _seconds_list(name: str, value: Any) -> tuple[float, ...]:
    if not isinstance(value, list | tuple) or len(value) > _MAX_LAYERS:
        raise _bad(name, f"a list of at most {_MAX_LAYERS} seconds", value)
    for i, x in enumerate(value):  # hot path: format a message only on failure
        if isinstance(x, bool) or not isinstance(x, int | float) or not 0.0 <= x <= _MAX_SECONDS:
            raise _bad(f"{name}[{i}]", f"a number in [0, {_MAX_SECONDS:g}]", x)
    return tuple(float(x) for x in value)


def _map(max_items: int, key: re.Pattern[str], item: Checker) -> Checker:
    def check(name: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping) or len(value) > max_items:
            raise _bad(name, f"a map of at most {max_items} entries", value)
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str) or not key.fullmatch(k):
                raise _bad(f"{name} key", f"a string matching {key.pattern}", k)
            out[k] = item(f"{name}[{k!r}]", v)
        return out

    return check


_finite = _num(-math.inf, math.inf)
_int64 = _num(-(2**63), 2**63 - 1, integer=True)


def _scalar(name: str, value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return _int64(name, value)
    if isinstance(value, float):
        return _finite(name, value)
    if isinstance(value, str) and len(value) <= 512:
        return value
    raise _bad(name, "null, a bool, a finite number or a string of <= 512 characters", value)


class _Record:
    """Shared validation and encoding; subclasses declare ``TYPE`` and ``SPEC``."""

    __slots__ = ()
    TYPE: ClassVar[str]
    SPEC: ClassVar[dict[str, Checker]]

    def __post_init__(self) -> None:
        for name, check in self.SPEC.items():
            object.__setattr__(self, name, check(name, getattr(self, name)))
        self._check()

    def _check(self) -> None:
        """Cross-field rules, after each field passed its own check."""

    def to_dict(self) -> dict[str, Any]:
        """The wire form as plain JSON/msgpack types, with version and type tags."""
        out: dict[str, Any] = {"v": SCHEMA_VERSION, "type": self.TYPE}
        for name in self.SPEC:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_wire(self) -> bytes:
        """One msgpack frame."""
        frame: bytes = msgpack.packb(self.to_dict(), use_bin_type=True)
        return frame

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Build from a wire dict (with or without ``v``/``type``), checking every field."""
        given = {k: v for k, v in data.items() if k not in ("v", "type")}
        unknown = sorted(set(given) - set(cls.SPEC), key=str)
        if unknown:
            raise TelemetryError("unknown-field", f"{cls.TYPE} has no field {unknown[0]!r}")
        kwargs: dict[str, Any] = {}
        for name in cls.SPEC:
            if name in given:
                kwargs[name] = given[name]
            elif name in _REQUIRED[cls.TYPE]:
                raise TelemetryError("missing-field", f"{cls.TYPE}.{name} is missing")
        return cls(**kwargs)

    @classmethod
    def from_wire(cls, frame: bytes) -> Self:
        """Decode one frame and require it to hold this record type."""
        record = decode(frame)
        if not isinstance(record, cls):
            raise TelemetryError("unknown-type", f"expected {cls.TYPE}, got {record.TYPE}")
        return record


@dataclass(frozen=True, slots=True, kw_only=True)
class StageStats(_Record):
    """One stage's timings for one iteration (the controllers' main input).

    ``forward_s[i]``/``backward_s[i]`` are for global layer ``first_layer + i``, so the
    record stays meaningful while layers migrate. Memory is the allocator's allocated
    and reserved bytes on a GPU and the process RSS (both fields) on CPU. In a job-array,
    ``resident_jobs`` is the most job states the stage held on its device at once (all
    of them without a memory budget; 0 outside job-arrays) and ``state_wait_s`` the time
    the host waited for offloaded states before their blocks (on CUDA a late copy also
    stalls the GPU, which only the iteration time shows). ``plan_version`` is the plan
    version the stage ran (`adaptipe.runtime.planversion`; 0 in records written before
    plans could change, which read as version 0).
    """

    TYPE: ClassVar[str] = "stage_stats"
    run_id: str
    stage: int
    iteration: int
    time_s: float
    first_layer: int = 0
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()
    compute_s: float
    wait_s: float
    comm_s: float
    iteration_s: float
    in_flight: int = 0
    memory_allocated_bytes: int = 0
    memory_reserved_bytes: int = 0
    loss: float | None = None
    resident_jobs: int = 0
    state_wait_s: float = 0.0
    plan_version: int = 0

    def _check(self) -> None:
        if len(self.forward_s) != len(self.backward_s):
            raise TelemetryError(
                "bad-field",
                f"stage_stats.backward_s has {len(self.backward_s)} layers but forward_s "
                f"has {len(self.forward_s)}",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSample(_Record):
    """Named device readings; ``source`` says whether they came from NVML or /proc."""

    TYPE: ClassVar[str] = "device_sample"
    stage: int
    time_s: float
    source: Source
    fields: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSample(_Record):
    """One link's bytes and busy seconds over an iteration, and its bandwidth (see
    `adaptipe.monitor.bandwidth.FastEnd`)."""

    TYPE: ClassVar[str] = "link_sample"
    src: int
    dst: int
    time_s: float
    nbytes: int
    seconds: float
    bandwidth_Bps: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Event(_Record):
    """Something that happened once: ``injection-start``, ``checkpoint``, ``migration``...

    ``detail`` is a flat map of scalars so events stay small and JSON-friendly.
    """

    TYPE: ClassVar[str] = "event"
    kind: str
    time_s: float
    stage: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


Record = StageStats | DeviceSample | LinkSample | Event

_STAGE = _num(0, _MAX_STAGE, integer=True)
_TIME = _num(0.0, _MAX_TIME)
_SECONDS = _num(0.0, _MAX_SECONDS)
_BYTES = _num(0, 2**62, integer=True)
StageStats.SPEC = {
    "run_id": _text(128),
    "stage": _STAGE,
    "iteration": _num(0, 2**53, integer=True),
    "time_s": _TIME,
    "first_layer": _num(0, 1_000_000, integer=True),
    "forward_s": _seconds_list,
    "backward_s": _seconds_list,
    "compute_s": _SECONDS,
    "wait_s": _SECONDS,
    "comm_s": _SECONDS,
    "iteration_s": _SECONDS,
    "in_flight": _num(0, 1_000_000, integer=True),
    "memory_allocated_bytes": _BYTES,
    "memory_reserved_bytes": _BYTES,
    "loss": _optional(_finite),
    "resident_jobs": _num(0, 1_000_000, integer=True),
    "state_wait_s": _SECONDS,
    "plan_version": _num(0, 2**31, integer=True),
}
DeviceSample.SPEC = {
    "stage": _STAGE,
    "time_s": _TIME,
    "source": _text(4, re.compile("nvml|cpu")),
    "fields": _map(128, _NAME, _finite),
}
LinkSample.SPEC = {
    "src": _STAGE,
    "dst": _STAGE,
    "time_s": _TIME,
    "nbytes": _BYTES,
    "seconds": _SECONDS,
    "bandwidth_Bps": _num(0.0, math.inf),
}
Event.SPEC = {
    "kind": _text(64, _KIND),
    "time_s": _TIME,
    "stage": _optional(_STAGE),
    "detail": _map(64, _KEY, _scalar),
}
_TYPES: dict[str, type[StageStats | DeviceSample | LinkSample | Event]] = {
    cls.TYPE: cls for cls in (StageStats, DeviceSample, LinkSample, Event)
}
# A sender may leave out fields that have defaults; the others are required.
_REQUIRED: dict[str, frozenset[str]] = {
    name: frozenset(
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    )
    for name, cls in _TYPES.items()
}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _parse(frame: bytes) -> Any:
    if frame[:1] == b"{":  # a msgpack frame never starts with 0x7b (that is a bare int)
        return json.loads(frame, parse_constant=_reject_constant)
    return msgpack.unpackb(
        frame,
        raw=False,
        strict_map_key=True,
        use_list=True,
        ext_hook=lambda code, data: _reject_constant(f"msgpack ext type {code}"),
    )


def decode(frame: bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> Record:
    """Check one frame completely and return its record, or raise TelemetryError."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise TelemetryError("malformed", f"a frame must be bytes (got {type(frame).__name__})")
    frame = bytes(frame)
    if len(frame) > max_bytes:
        raise TelemetryError("oversized", f"frame of {len(frame)} bytes exceeds {max_bytes}")
    try:
        data = _parse(frame)
    except Exception as exc:  # any parser failure (incl. deep nesting) is bad input
        raise TelemetryError(
            "malformed", f"not msgpack or JSON ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(data, dict):
        raise TelemetryError("malformed", f"top level must be a map (got {type(data).__name__})")
    if "v" not in data:
        raise TelemetryError("missing-field", "top-level 'v' (schema version) is missing")
    version = data["v"]
    if isinstance(version, bool) or version != SCHEMA_VERSION or not isinstance(version, int):
        raise TelemetryError("wrong-version", f"v must be {SCHEMA_VERSION} (got {version!r})")
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in _TYPES:
        raise TelemetryError("unknown-type", f"type must be one of {sorted(_TYPES)} (got {kind!r})")
    return _TYPES[kind].from_dict(data)
