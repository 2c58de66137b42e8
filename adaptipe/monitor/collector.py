"""The manager side of telemetry: receive, validate, keep recent history, log.

Every frame is untrusted: it is decoded with :func:`~adaptipe.monitor.schema.decode`
and a bad one is counted under its reason in ``rejected`` and dropped, so a buggy or
hostile sender can neither crash the manager nor poison what the controllers read.
Per stage, the last ``history`` StageStats and DeviceSamples are kept in ring buffers,
and per link (sender, receiver) the last ``history`` LinkSamples;
every accepted record can also go to a ``telemetry.jsonl`` file, one JSON line each.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import operator
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Self, TypeVar

import zmq
from zmq.auth.thread import ThreadAuthenticator

from adaptipe.monitor.publisher import CurveKeys, check_address
from adaptipe.monitor.schema import (
    MAX_FRAME_BYTES,
    REASONS,
    DeviceSample,
    Event,
    LinkSample,
    MonitorError,
    Record,
    StageStats,
    TelemetryError,
    decode,
)
from adaptipe.monitor.threadname import name_os_thread
from adaptipe.serial import json_line

__all__ = ["Collector"]

log = logging.getLogger(__name__)
_BATCH = 10_000  # frames per poll, so a flood cannot starve the caller


R = TypeVar("R", StageStats, DeviceSample, LinkSample)
K = TypeVar("K", int, tuple[int, int])


_TIME = operator.attrgetter("time_s")
_NEWEST_RATE = operator.attrgetter("time_s", "bandwidth_Bps")
_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # one, not one a record


def _line(record: Record) -> str:
    """The record as one strict JSON line. Validated records are finite but for the odd
    infinity (a link's bandwidth), which takes `json_line`'s slower path to ``null``."""
    data = record.to_dict()
    try:
        return _JSON.encode(data) + "\n"
    except ValueError:
        return json_line(data, separators=(",", ":"))


def _ring(rings: dict[K, deque[R]], stage: K, length: int) -> deque[R]:
    ring = rings.get(stage)
    if ring is None:
        ring = rings[stage] = deque(maxlen=length)
    return ring


def _keep(
    rings: dict[K, deque[R]],
    newest: dict[K, R],
    key: K,
    record: R,
    length: int,
    order: Callable[[R], object],
) -> None:
    """Append ``record`` to its ring and keep ``newest[key]`` the ring's greatest by
    ``order``, the later to arrive of equals (found again only when it leaves the ring)."""
    ring = _ring(rings, key, length)
    evicted = ring[0] if len(ring) == length else None
    ring.append(record)
    best = newest.get(key)
    if best is None or evicted is best:
        newest[key] = max(reversed(ring), key=order)  # type: ignore[arg-type]
    elif order(record) >= order(best):  # type: ignore[operator]
        newest[key] = record


class _From:
    """Whether a stage's StageStats is of iteration ``since`` or later."""

    def __init__(self, since: int) -> None:
        self.since = since

    def __call__(self, record: StageStats) -> bool:
        return record.iteration >= self.since


class _AllowKeys:
    """ZAP callback: CURVE clients are accepted only with a known public key."""

    def __init__(self, keys: set[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


class Collector:
    """Binds a PULL socket and stores validated telemetry.

    Drive it with :meth:`poll` (or :meth:`pump`) from the caller's loop, or :meth:`start`
    a receiving thread; reads (``latest``, ``history``...) are safe from any thread. The
    manager drives it from its own poll loop: a thread of its own woke for each frame, and
    those wake-ups were most of telemetry's CPU (docs/benchmarks.md, session 15).

    Args:
        bind: endpoint to bind; ``*`` as the port picks a free one (see ``address``).
        curve: server keys (``CurveKeys.for_server()``); required off loopback.
        max_bytes: frames larger than this are rejected as ``oversized``. Frames over
            16x this (at least 1 MiB) never reach us: libzmq drops that connection.
        history: StageStats and DeviceSamples kept per stage, LinkSamples per link.
        jsonl: append every accepted record to this file as one JSON line.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:*",
        *,
        curve: CurveKeys | None = None,
        max_bytes: int = MAX_FRAME_BYTES,
        history: int = 256,
        hwm: int = 10_000,
        jsonl: str | Path | None = None,
    ) -> None:
        check_address(bind, curve)
        if history < 1 or max_bytes < 1:
            raise MonitorError(
                f"Collector history and max_bytes must be >= 1 (got {history}, {max_bytes})"
            )
        if curve is not None and curve.server_secret is None:
            raise MonitorError("Collector needs CurveKeys with server_secret (for_server())")
        self.max_bytes, self.history_len = max_bytes, history
        self.accepted = 0
        self._rejected: Counter[str] = Counter()
        self._stats: dict[int, deque[StageStats]] = {}
        self._devices: dict[int, deque[DeviceSample]] = {}
        self._links: dict[tuple[int, int], deque[LinkSample]] = {}
        # each ring's newest (`for_decision`), kept as records come in
        self._device_newest: dict[int, DeviceSample] = {}
        self._link_newest: dict[tuple[int, int], LinkSample] = {}
        self._events: deque[Event] = deque(maxlen=max(1024, history))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._jsonl: IO[str] | None = open(jsonl, "a") if jsonl is not None else None  # noqa: SIM115
        self._ctx = zmq.Context(io_threads=1)
        self._auth: ThreadAuthenticator | None = None
        self._sock = self._ctx.socket(zmq.PULL)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, hwm)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max(1 << 20, 16 * max_bytes))
            self._sock.setsockopt(zmq.IPV6, int("[" in bind))
            if curve is not None and curve.server_secret is not None:
                self._auth = ThreadAuthenticator(self._ctx)  # must run before the bind
                self._auth.start()
                self._auth.configure_curve_callback("*", _AllowKeys({curve.client_public}))
                self._sock.curve_server = True
                self._sock.curve_publickey = curve.server_public
                self._sock.curve_secretkey = curve.server_secret
            self._sock.bind(bind)
        except zmq.ZMQError as exc:  # e.g. the port is taken: leave nothing running
            self.close()
            raise MonitorError(f"Collector cannot bind {bind!r}: {exc}") from exc
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    @property
    def rejected(self) -> dict[str, int]:
        """Rejected frames per reason (every reason in schema.REASONS is a key)."""
        with self._lock:
            return {reason: self._rejected[reason] for reason in REASONS}

    def poll(self, timeout_ms: int = 0) -> int:
        """Wait up to ``timeout_ms`` for frames, then handle what is queued; returns count."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise MonitorError("Collector.poll is driven by its own thread after start()")
        if self._closed or not self._poller.poll(timeout_ms):
            return 0
        handled = 0
        # One Poller for the socket's life (Socket.poll builds one per call), and EVENTS
        # says when the batch is done (a NOBLOCK receive that raises costs more): about
        # a tenth of this thread's CPU per frame (docs/benchmarks.md, session 14).
        while handled < _BATCH and (handled == 0 or int(self._sock.get(zmq.EVENTS)) & zmq.POLLIN):
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            handled += 1
            self._handle(parts)
        if self._jsonl is not None:
            with contextlib.suppress(OSError):
                self._jsonl.flush()
        return handled

    def pump(self, timeout_ms: int = 0) -> int:
        """`poll` for a caller that must not fail on telemetry (the manager's loop, which
        drives the collector itself): an error is logged, not raised; returns the count."""
        try:
            return self.poll(timeout_ms)
        except Exception as exc:  # the manager keeps its history and its run; say why
            log.warning("telemetry collector: %r", exc)
            return 0

    def drain(self, *, quiet_ms: int = 50, limit_s: float = 2.0) -> int:
        """Take in what is still on its way until none has come for ``quiet_ms`` (at
        most ``limit_s``): at shutdown, the last frames a stage sent before it exited.
        Returns the count."""
        handled, deadline = 0, time.monotonic() + limit_s
        while time.monotonic() < deadline:
            got = self.pump(quiet_ms)
            if not got:
                break
            handled += got
        return handled

    def _handle(self, parts: list[bytes]) -> None:
        try:
            if len(parts) != 1:
                raise TelemetryError("malformed", f"expected 1 frame, got {len(parts)} parts")
            record = decode(parts[0], max_bytes=self.max_bytes)
        except TelemetryError as exc:
            with self._lock:
                self._rejected[exc.reason] += 1
            return
        with self._lock:
            self.accepted += 1
            match record:
                case StageStats():
                    _ring(self._stats, record.stage, self.history_len).append(record)
                case DeviceSample():
                    stage, length = record.stage, self.history_len
                    _keep(self._devices, self._device_newest, stage, record, length, _TIME)
                case LinkSample():
                    link, length = (record.src, record.dst), self.history_len
                    _keep(self._links, self._link_newest, link, record, length, _NEWEST_RATE)
                case Event():
                    self._events.append(record)
        if self._jsonl is not None:
            try:
                self._jsonl.write(_line(record))
            except OSError as exc:  # e.g. disk full: keep collecting in memory
                log.warning(
                    "telemetry log %s failed (%s); no longer writing it", self._jsonl.name, exc
                )
                self._jsonl.close()
                self._jsonl = None

    def start(self) -> Self:
        """Receive on a background thread until :meth:`close`."""
        if self._thread is not None:
            raise MonitorError("Collector already started")
        self._thread = threading.Thread(target=self._run, name="adaptipe-collector", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        name_os_thread("adaptipe-collector")
        while not self._stop.is_set():
            try:
                self.poll(50)
            except Exception as exc:  # the manager keeps its history; say why, slow down
                log.warning("telemetry collector: %r", exc)
                self._stop.wait(0.5)

    def stages(self) -> list[int]:
        """Stages that sent StageStats or DeviceSamples so far."""
        with self._lock:
            return sorted(set(self._stats) | set(self._devices))

    def latest(self, stage: int) -> StageStats | None:
        with self._lock:
            ring = self._stats.get(stage)
            return ring[-1] if ring else None

    def history(self, stage: int, last: int | None = None) -> list[StageStats]:
        """The stage's kept StageStats, oldest first; the ``last`` newest only, if given
        (without copying the rest of the ring)."""
        with self._lock:
            ring = self._stats.get(stage, ())
            if last is None or last >= len(ring):
                return list(ring)
            return list(itertools.islice(ring, len(ring) - max(last, 0), None))

    def latest_device(self, stage: int) -> DeviceSample | None:
        with self._lock:
            ring = self._devices.get(stage)
            return ring[-1] if ring else None

    def device_history(self, stage: int) -> list[DeviceSample]:
        with self._lock:
            return list(self._devices.get(stage, ()))

    def links(self) -> dict[tuple[int, int], LinkSample]:
        """The latest LinkSample per (src, dst)."""
        with self._lock:
            return {link: ring[-1] for link, ring in self._links.items() if ring}

    def link_history(self, src: int, dst: int) -> list[LinkSample]:
        """The link's kept LinkSamples, oldest first."""
        with self._lock:
            return list(self._links.get((src, dst), ()))

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def records(self) -> list[Record]:
        """Everything kept, for snapshots: stats, samples, links, then events."""
        with self._lock:
            out: list[Record] = [r for ring in self._stats.values() for r in ring]
            out += [r for ring in self._devices.values() for r in ring]
            out += [r for ring in self._links.values() for r in ring]
            return out + list(self._events)

    def for_decision(self, since: int = 0) -> list[Record]:
        """What a controller's decision reads (`adaptipe.runtime.adapt_loop`): the
        StageStats from iteration ``since`` on (a stage's ring read from its end back to
        the first older iteration), and of each stage's DeviceSamples and each link's
        LinkSamples only the one `controllers.observation.observe` takes (the newest; of
        equal times, the later to arrive for a device, the higher bandwidth for a link,
        as its ``max`` of ``(time_s, bandwidth_Bps)`` picks). The rest of the rings, and
        the events, would only be read past at every check (docs/benchmarks.md, session
        26)."""
        with self._lock:
            out: list[Record] = []
            for ring in self._stats.values():
                newest = list(itertools.takewhile(_From(since), reversed(ring)))
                out += reversed(newest)
            out += self._device_newest.values()
            out += self._link_newest.values()
            return out

    def close(self) -> None:
        """Stop the thread, close the socket (dropping anything queued) and the file."""
        if self._closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._closed = True
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        if self._jsonl is not None:
            self._jsonl.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
