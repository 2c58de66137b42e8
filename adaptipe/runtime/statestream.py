"""Layer state streamed in chunks at low priority: the channel migration sends state on
while training goes on (migration part 2).

Activations and gradients are the pipeline's critical path; layer state on its way to
a new stage is not. So state travels on a channel of its own, a ZeroMQ PUSH/PULL pair
beside the process group, and yields three ways:

- **on the wire**: the sending socket marks its packets IP TOS 0x08 (``zmq.TOS``), the
  lowest band of Linux's default priority map and of the namespace test bed's bands
  (`adaptipe.netbed`), so a shaped link sends activations and gradients first;
- **at the stage**: a chunk goes out only while ``busy()`` is false (the stage has no
  activation or gradient send pending, `adaptipe.runtime.transport.P2PTransport.sending`),
  one chunk at a time, checked every ``poll_s``;
- **on the CPU**: the socket's I/O thread runs at idle scheduling priority
  (``SCHED_IDLE`` through ``zmq.THREAD_SCHED_POLICY``; a Python thread at idle priority
  could be descheduled holding the GIL and stall the stage, the I/O thread holds none).
  Only where the CPU has idle time to give: ``idle_cpu=False`` keeps it at normal
  priority for stages that compute on the CPU, whose core is never idle while they
  train (there an idle-priority thread starved and a 100 MB move never finished).

Each chunk carries the stream id, its index, the chunk count and the CRC-32 of its
bytes: a checksum against corruption at 0.19 ms a MB where SHA-256 took 0.55 on both
ends, which took the channel from about 2.0 to 1.4 CPU ms a MB on loopback here (off
loopback CURVE authenticates and encrypts). The receiver checks every chunk and, where
the caller gives one, the whole payload's SHA-256 digest, and a stream that is
incomplete by its deadline fails (`StreamError`) without touching anything.
Off loopback the pair needs CURVE keys, like telemetry. ``prioritise=False`` turns the
three off (for the benchmark's comparison).
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from adaptipe.errors import AdaptipeError
from adaptipe.monitor.publisher import CurveKeys, check_address

__all__ = [
    "LOW_PRIORITY_TOS",
    "Pace",
    "StateReceiver",
    "StateSender",
    "StreamError",
    "StreamReport",
    "StreamTimeout",
]

LOW_PRIORITY_TOS = 0x08
_HEADER = struct.Struct("!QIIQI")  # stream, index, count, total bytes, the chunk's CRC-32


class StreamError(AdaptipeError, RuntimeError):
    """A state stream failed (a chunk's digest, a missing chunk, the deadline)."""


class StreamTimeout(StreamError):
    """A stream was not complete by its deadline (the chunks that came are kept: a later
    `StateReceiver.receive` of the same stream goes on from them)."""


@dataclass(frozen=True, slots=True)
class StreamReport:
    """What sending one payload took: chunks, bytes, seconds, the seconds spent
    waiting for the stage's own sends to clear (yielding) and held back by the pace."""

    chunks: int
    bytes: int
    seconds: float
    yielded_s: float
    paced_s: float = 0.0


@dataclass(slots=True)
class Pace:
    """One pace over a sequence of payloads (a base copy's, one payload a layer): at
    most ``rate_Bps`` bytes a second from when the first of them began; `StateSender.send`
    starts it and counts what it sent, so small payloads keep the pace a large one would."""

    rate_Bps: float
    began: float | None = None  # time.monotonic() of the first chunk
    sent: int = 0  # bytes of the sequence sent so far
    ended: float | None = None  # time.monotonic() when the latest payload's chunks were queued

    @property
    def span_s(self) -> float:
        """Seconds from the first chunk to the latest payload's last (0 before any)."""
        return 0.0 if self.began is None or self.ended is None else self.ended - self.began


def _context(prioritise: bool) -> zmq.Context[Any]:
    ctx: zmq.Context[Any] = zmq.Context()
    if prioritise and hasattr(os, "SCHED_IDLE"):
        # must be set before the first socket starts the I/O thread
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_IDLE)
        ctx.set(zmq.THREAD_PRIORITY, 0)
    return ctx


class StateReceiver:
    """The receiving end: binds ``bind`` (``tcp://host:*`` picks a free port; see
    ``address``) and reassembles streams."""

    def __init__(self, bind: str = "tcp://127.0.0.1:*", *, curve: CurveKeys | None = None) -> None:
        check_address(bind, curve)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            if curve.server_secret is None:
                raise StreamError("the receiving end needs the server's secret key")
            self._sock.curve_server = True
            self._sock.curve_publickey = curve.server_public
            self._sock.curve_secretkey = curve.server_secret
        self._sock.bind(bind)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._parts: dict[int, dict[int, bytes]] = {}
        self._counts: dict[int, tuple[int, int]] = {}  # stream -> (chunks, total bytes)

    def receive(self, stream: int, *, digest: bytes | None, timeout_s: float) -> bytes:
        """Stream ``stream`` whole, checked against its SHA-256 ``digest`` (sent ahead on
        the control path; None: the caller checks the payload, every chunk is checked
        here); `StreamError` on a bad chunk, `StreamTimeout` by ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self._complete(stream):
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(min(left, 0.1) * 1000) + 1):
                if time.monotonic() >= deadline:
                    got = len(self._parts.get(stream, {}))
                    want = self._counts.get(stream, (0, 0))[0]
                    raise StreamTimeout(
                        f"stream {stream}: {got} of {want or '?'} chunks in {timeout_s} s"
                    )
                continue
            self._take(self._sock.recv_multipart())
        chunks, total = self._counts.pop(stream)
        parts = self._parts.pop(stream)
        payload = b"".join(parts[i] for i in range(chunks))
        if len(payload) != total or (
            digest is not None and hashlib.sha256(payload).digest() != digest
        ):
            raise StreamError(f"stream {stream}: the payload does not match its digest")
        return payload

    def _complete(self, stream: int) -> bool:
        count = self._counts.get(stream)
        return count is not None and len(self._parts.get(stream, {})) == count[0]

    def _take(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or len(frames[0]) != _HEADER.size:
            raise StreamError("a state chunk arrived malformed")
        stream, index, count, total, crc = _HEADER.unpack(frames[0])
        if zlib.crc32(frames[1]) != crc:
            raise StreamError(f"stream {stream}: chunk {index} of {count} fails its checksum")
        self._counts[stream] = (count, total)
        self._parts.setdefault(stream, {})[index] = frames[1]

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class StateSender:
    """The sending end: connects to a `StateReceiver`'s address and sends payloads in
    ``chunk_bytes`` chunks, yielding to the stage's own sends (``busy``)."""

    def __init__(
        self,
        address: str,
        *,
        chunk_bytes: int = 256 << 10,
        busy: Callable[[], bool] = lambda: False,
        poll_s: float = 0.0005,
        prioritise: bool = True,
        idle_cpu: bool = True,
        curve: CurveKeys | None = None,
    ) -> None:
        check_address(address, curve)
        if chunk_bytes < 1:
            raise StreamError(f"chunk_bytes must be >= 1 (got {chunk_bytes})")
        self.chunk_bytes, self.prioritise = chunk_bytes, prioritise
        self._busy, self._poll_s = busy, poll_s
        self._ctx = _context(prioritise and idle_cpu)
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, 4)  # a few chunks queued: pacing stays real
        if prioritise:
            self._sock.setsockopt(zmq.TOS, LOW_PRIORITY_TOS)
        if curve is not None:
            if curve.client_secret is None:
                raise StreamError("the sending end needs the client's secret key")
            self._sock.curve_serverkey = curve.server_public
            self._sock.curve_publickey = curve.client_public
            self._sock.curve_secretkey = curve.client_secret
        self._sock.connect(address)

    def send(
        self,
        stream: int,
        payload: bytes | bytearray | memoryview,
        *,
        timeout_s: float = 60.0,
        corrupt: bool = False,
        pace: Pace | None = None,
        while_ahead: Callable[[], None] | None = None,
    ) -> StreamReport:
        """Send ``payload`` as stream ``stream``; returns when every chunk is queued.
        ``pace``: the pace this payload keeps, with those sent before it (None: as fast
        as the stage lets);
        ``while_ahead``: called between chunks while the payload is ahead of its pace,
        before waiting for it (the caller sends its more urgent payloads there: they use
        the time the pace leaves, and never hold this one behind its pace);
        ``corrupt`` flips a byte of the first chunk after its digest is taken (a drill)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        view = memoryview(payload)
        size = self.chunk_bytes
        count = max(1, -(-len(payload) // size))
        yielded = paced = 0.0
        if pace is not None and pace.began is None:
            pace.began = t0
        for index in range(count):
            chunk = view[index * size : (index + 1) * size]  # sent without a copy
            if pace is not None and pace.began is not None and pace.rate_Bps > 0:
                due = pace.began + (pace.sent + index * size) / pace.rate_Bps
                if while_ahead is not None and due > time.monotonic():
                    while_ahead()
                ahead = due - time.monotonic()
                if ahead > 0:
                    time.sleep(min(ahead, max(deadline - time.monotonic(), 0.0)))
                    paced += ahead
            if self.prioritise:
                waited = time.monotonic()
                while self._busy():
                    if time.monotonic() > deadline:
                        raise StreamError(f"stream {stream}: the stage stayed busy {timeout_s} s")
                    time.sleep(self._poll_s)
                yielded += time.monotonic() - waited
            header = _HEADER.pack(stream, index, count, len(payload), zlib.crc32(chunk))
            left_ms = int(max(deadline - time.monotonic(), 0) * 1000)
            if not self._sock.poll(left_ms, zmq.POLLOUT):
                raise StreamError(f"stream {stream}: chunk {index} not sent in {timeout_s} s")
            if corrupt and index == 0:
                flipped = bytearray(chunk)
                flipped[len(flipped) // 2] ^= 0xFF
                chunk = memoryview(bytes(flipped))
            self._sock.send_multipart([header, chunk], copy=False)
        if pace is not None:
            pace.sent += len(payload)
            pace.ended = time.monotonic()
        return StreamReport(count, len(payload), time.monotonic() - t0, yielded, paced)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
