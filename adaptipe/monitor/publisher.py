"""The stage side of telemetry: a non-blocking ZeroMQ publisher and a device sampler.

Training must never wait for monitoring. Every send is ``NOBLOCK`` on a PUSH socket with
a send high-water mark: when the queue is full or the manager is gone, the message is
dropped and counted (``dropped``), and closing discards what is queued (linger 0).
Telemetry stays on loopback unless CURVE keys are given: off the machine it would
otherwise be readable and forgeable by anyone on the network.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import zmq

from adaptipe.monitor.device import DeviceProbe, open_probe
from adaptipe.monitor.schema import DeviceSample, Event, MonitorError, Record
from adaptipe.monitor.threadname import name_os_thread

__all__ = ["CurveKeys", "DeviceSampler", "Publisher", "check_address"]

log = logging.getLogger(__name__)
_LOOPBACK_NAMES = ("localhost", "lo")


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Z85-encoded CURVE key pairs: the manager's (server) and the stages' (client).

    Give stages ``for_client()`` (no server secret) and the collector ``for_server()``
    (no client secret); the collector accepts only ``client_public``.
    """

    server_public: bytes
    server_secret: bytes | None
    client_public: bytes
    client_secret: bytes | None

    def __post_init__(self) -> None:
        for name in ("server_public", "server_secret", "client_public", "client_secret"):
            key = getattr(self, name)
            if key is not None and (not isinstance(key, bytes) or len(key) != 40):
                raise MonitorError(f"CurveKeys.{name} must be 40 Z85 bytes (got {key!r:.50})")

    @classmethod
    def generate(cls) -> CurveKeys:
        """Fresh server and client key pairs (needs libzmq built with CURVE)."""
        if not zmq.has("curve"):
            raise MonitorError("this libzmq has no CURVE support; telemetry must stay on loopback")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def for_client(self) -> CurveKeys:
        return CurveKeys(self.server_public, None, self.client_public, self.client_secret)

    def for_server(self) -> CurveKeys:
        return CurveKeys(self.server_public, self.server_secret, self.client_public, None)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', an interface name or a host name: may leave the machine
        return False


def check_address(address: str, curve: CurveKeys | None) -> None:
    """Refuse a tcp endpoint that is not loopback unless CURVE keys are given."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        raise MonitorError(
            f"monitor address {address!r} must be tcp://host:port, ipc://path or inproc://name"
        )
    if scheme != "tcp" or curve is not None:
        return
    hosts = [part.rpartition(":")[0] for part in rest.split(";")]  # 'source;destination'
    if not all(_is_loopback(h) for h in hosts):
        raise MonitorError(
            f"monitor address {address!r} is not loopback: CURVE keys are required off "
            "loopback (pass curve=CurveKeys.generate(), the client half to stages)"
        )


class Publisher:
    """Sends telemetry records to a :class:`~adaptipe.monitor.collector.Collector`.

    Args:
        address: the collector's endpoint, e.g. ``collector.address``.
        stage: this stage's index, stamped on device samples and events.
        hwm: messages queued before new ones are dropped.
        curve: client keys (``CurveKeys.for_client()``); required off loopback.
    """

    def __init__(
        self, address: str, *, stage: int, hwm: int = 1000, curve: CurveKeys | None = None
    ) -> None:
        check_address(address, curve)
        if hwm < 1:
            raise MonitorError(f"Publisher hwm must be >= 1 (got {hwm})")
        if curve is not None and curve.client_secret is None:
            raise MonitorError("Publisher needs CurveKeys with client_secret (for_client())")
        self.address, self.stage = address, stage
        self.sent = 0
        self._dropped = 0
        self._closed = False
        self._lock = threading.Lock()  # zmq sockets are not thread-safe; the sampler shares it
        self._sampler: DeviceSampler | None = None
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PUSH)
        try:
            self._sock.setsockopt(zmq.SNDHWM, hwm)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.IPV6, int("[" in address))
            if curve is not None and curve.client_secret is not None:
                self._sock.curve_serverkey = curve.server_public
                self._sock.curve_publickey = curve.client_public
                self._sock.curve_secretkey = curve.client_secret
            self._sock.connect(address)
        except zmq.ZMQError as exc:  # e.g. an unresolvable host: leave nothing running
            self.close()
            raise MonitorError(f"Publisher cannot connect to {address!r}: {exc}") from exc

    @property
    def dropped(self) -> int:
        """Messages not sent because the queue was full, the manager gone or us closed."""
        return self._dropped

    def publish_frame(self, frame: bytes) -> bool:
        """Queue one encoded frame without blocking; False (and counted) if dropped."""
        with self._lock:
            if not self._closed:
                try:
                    self._sock.send(frame, zmq.NOBLOCK)
                    self.sent += 1
                    return True
                except zmq.ZMQError:  # EAGAIN at the high-water mark, or a dying context
                    pass
            self._dropped += 1
            return False

    def publish(self, record: Record) -> bool:
        """Encode and queue one record without blocking; False if it was dropped."""
        return self.publish_frame(record.to_wire())

    def event(self, kind: str, **detail: str | int | float | bool | None) -> bool:
        """Publish an :class:`Event` of ``kind`` from this stage, stamped now."""
        return self.publish(Event(kind=kind, time_s=time.time(), stage=self.stage, detail=detail))

    def start_sampler(
        self, *, interval_s: float = 0.2, device_index: int | None = None
    ) -> DeviceSampler:
        """Start publishing a DeviceSample every ``interval_s`` from a background thread."""
        if self._sampler is not None:
            raise MonitorError("this Publisher already runs a DeviceSampler")
        self._sampler = DeviceSampler(
            self.publish, stage=self.stage, interval_s=interval_s, device_index=device_index
        )
        self._sampler.start()
        return self._sampler

    def close(self, *, linger_s: float = 0.0) -> None:
        """Stop the sampler and close; ``linger_s`` > 0 lets queued messages out first."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(linger=int(linger_s * 1000))
        self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class DeviceSampler:
    """A daemon thread that publishes one :class:`DeviceSample` every ``interval_s``.

    It measures its own CPU time (``cpu_s``) so the overhead claim can be checked.
    Errors are logged and the sampler keeps going: monitoring must not stop training.
    """

    def __init__(
        self,
        publish: Callable[[Record], bool],
        *,
        stage: int,
        interval_s: float = 0.2,
        device_index: int | None = None,
        probe: DeviceProbe | None = None,
    ) -> None:
        if not 0.1 <= interval_s <= 0.5:
            raise MonitorError(f"DeviceSampler interval_s must be in [0.1, 0.5] (got {interval_s})")
        self.stage, self.interval_s, self.device_index = stage, interval_s, device_index
        self.samples = 0
        self.cpu_s = 0.0
        self._publish = publish
        self._probe = probe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def start(self) -> Self:
        if self._thread is not None:
            raise MonitorError("DeviceSampler already started")
        self._thread = threading.Thread(target=self._run, name="adaptipe-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        name_os_thread("adaptipe-sampler")
        t0 = time.thread_time()
        probe = self._probe or open_probe(self.device_index)
        self.cpu_s += time.thread_time() - t0
        next_t = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, next_t - time.monotonic())):
            self._sample(probe)
            next_t += self.interval_s
            if next_t < time.monotonic():  # fell behind (e.g. a suspended process): skip ticks
                next_t = time.monotonic() + self.interval_s
        if self.samples == 0:  # stopped before the first tick: a short run still gets one
            self._sample(probe)
        if self._probe is None:
            probe.close()

    def _sample(self, probe: DeviceProbe) -> None:
        t0 = time.thread_time()
        try:
            fields = probe.read()
            self._publish(
                DeviceSample(
                    stage=self.stage, time_s=time.time(), source=probe.source, fields=fields
                )
            )
            self.samples += 1
        except Exception as exc:  # keep sampling; say so once
            if not self._warned:
                log.warning("device sampler on stage %d failed: %r", self.stage, exc)
                self._warned = True
        self.cpu_s += time.thread_time() - t0

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
