"""The low-priority state channel: payloads arrive whole in checked chunks, a corrupted or
missing chunk fails the stream, the sender yields while the stage sends, its packets
carry IP TOS 0x08, its I/O thread runs at idle priority, and it refuses to leave
loopback without CURVE keys."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zlib

import pytest
import zmq

from adaptipe.monitor.publisher import CurveKeys
from adaptipe.runtime.statestream import (
    _HEADER,
    LOW_PRIORITY_TOS,
    Pace,
    StateReceiver,
    StateSender,
    StreamError,
)


def _payload(n: int) -> bytes:
    return bytes((i * 7 + 3) % 251 for i in range(n))


@pytest.mark.parametrize(("size", "chunk"), [(1 << 20, 64 << 10), (100_003, 4096), (0, 4096)])
def test_a_payload_arrives_whole_in_checked_chunks(size: int, chunk: int) -> None:
    receiver = StateReceiver()
    sender = StateSender(receiver.address, chunk_bytes=chunk)
    try:
        payload = _payload(size)
        out: dict[str, bytes] = {}
        got = threading.Thread(
            target=lambda: out.setdefault(
                "p", receiver.receive(7, digest=hashlib.sha256(payload).digest(), timeout_s=20)
            )
        )
        got.start()
        report = sender.send(7, payload, timeout_s=20)
        got.join(timeout=30)
        assert out["p"] == payload
        assert report.chunks == max(1, -(-size // chunk)) and report.bytes == size
    finally:
        sender.close()
        receiver.close()


def test_a_corrupted_chunk_or_a_missing_one_fails_the_stream() -> None:
    receiver = StateReceiver()
    ctx: zmq.Context[object] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(receiver.address)
    try:
        good = b"x" * 10
        header = _HEADER.pack(1, 0, 2, 20, zlib.crc32(good))
        push.send_multipart([header, b"y" * 10])  # not the bytes its digest says
        with pytest.raises(StreamError, match="chunk 0 of 2 fails its checksum"):
            receiver.receive(1, digest=b"\0" * 32, timeout_s=5)
        push.send_multipart([_HEADER.pack(2, 0, 2, 20, zlib.crc32(good)), good])
        with pytest.raises(StreamError, match=r"stream 2: 1 of 2 chunks in 0.3 s"):
            receiver.receive(2, digest=b"\0" * 32, timeout_s=0.3)
    finally:
        push.close(linger=0)
        ctx.term()
        receiver.close()


def test_a_whole_payload_that_does_not_match_its_digest_is_refused() -> None:
    receiver = StateReceiver()
    sender = StateSender(receiver.address, chunk_bytes=8)
    try:
        sender.send(3, b"sixteen bytes!!!")
        with pytest.raises(StreamError, match="does not match its digest"):
            receiver.receive(3, digest=hashlib.sha256(b"other").digest(), timeout_s=5)
    finally:
        sender.close()
        receiver.close()


def test_the_sender_waits_while_the_stage_sends_and_not_when_told_not_to() -> None:
    receiver = StateReceiver()
    until = time.monotonic() + 0.3
    busy = lambda: time.monotonic() < until  # noqa: E731  (the stage sends for 0.3 s)
    sender = StateSender(receiver.address, chunk_bytes=1024, busy=busy)
    plain = StateSender(receiver.address, chunk_bytes=1024, busy=lambda: True, prioritise=False)
    try:
        report = sender.send(1, _payload(4096))
        assert report.yielded_s >= 0.25 and report.seconds >= 0.25
        quick = plain.send(2, _payload(4096))  # prioritisation off: never waits
        assert quick.yielded_s == 0.0 and quick.seconds < 0.25
        with pytest.raises(StreamError, match=r"the stage stayed busy 0\.2 s"):
            StateSender(receiver.address, busy=lambda: True).send(3, b"x", timeout_s=0.2)
    finally:
        sender.close()
        plain.close()
        receiver.close()


def test_a_paced_payload_takes_its_bytes_over_the_pace_and_arrives_whole() -> None:
    receiver = StateReceiver()
    sender = StateSender(receiver.address, chunk_bytes=8 << 10)
    try:
        payload = _payload(64 << 10)
        urgent = _payload(1000)
        sent_between: list[int] = []

        def between() -> None:  # a more urgent payload, sent in the time the pace leaves
            if not sent_between:
                sent_between.append(sender.send(9, urgent).chunks)

        report = sender.send(1, payload, pace=Pace(256 << 10), while_ahead=between)  # 8 chunks
        # the last chunk leaves no earlier than 7 chunks' worth of the pace after the first
        assert report.seconds >= 7 * (8 << 10) / (256 << 10) * 0.95
        assert report.paced_s > 0.1 and report.chunks == 8
        assert sent_between == [1]
        assert receiver.receive(9, digest=hashlib.sha256(urgent).digest(), timeout_s=5) == urgent
        assert receiver.receive(1, digest=hashlib.sha256(payload).digest(), timeout_s=5) == payload
        assert sender.send(2, payload).paced_s == 0.0  # unpaced
    finally:
        sender.close()
        receiver.close()


def _idle_io_threads(want: int) -> int:
    """ZeroMQ I/O threads of this process that run at idle scheduling priority, once
    there are ``want`` of them or after a second (a new thread sets its own policy)."""
    deadline = time.monotonic() + 1.0
    while True:
        count = 0
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as fh:
                    name = fh.read().strip()
                policy = os.sched_getscheduler(int(task))
            except OSError:  # the thread ended
                continue
            count += name.startswith("ZMQbg/IO") and policy == os.SCHED_IDLE
        if count == want or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


def test_the_sender_marks_its_packets_low_priority_and_idles_its_io_thread() -> None:
    receiver = StateReceiver()
    try:
        low = StateSender(receiver.address)
        assert low._sock.getsockopt(zmq.TOS) == LOW_PRIORITY_TOS == 0x08
        if hasattr(os, "SCHED_IDLE"):
            assert _idle_io_threads(1) == 1  # the sender's own, not the receiver's
        low.close()
        plain = StateSender(receiver.address, prioritise=False)
        assert plain._sock.getsockopt(zmq.TOS) == 0
        if hasattr(os, "SCHED_IDLE"):
            assert _idle_io_threads(0) == 0
        plain.close()
    finally:
        receiver.close()


def test_off_loopback_the_channel_needs_curve_keys_and_works_with_them() -> None:
    with pytest.raises(Exception, match="CURVE keys are required off loopback"):
        StateReceiver("tcp://192.0.2.1:*")
    keys = CurveKeys.generate()
    receiver = StateReceiver("tcp://127.0.0.1:*", curve=keys.for_server())
    sender = StateSender(receiver.address, curve=keys.for_client(), chunk_bytes=1000)
    try:
        payload = _payload(5000)
        sender.send(9, payload)
        assert receiver.receive(9, digest=hashlib.sha256(payload).digest(), timeout_s=10) == payload
    finally:
        sender.close()
        receiver.close()


def test_the_transport_says_while_a_send_of_the_stage_is_in_flight() -> None:
    """What the stream yields to: `P2PTransport.sending` until every send completes."""
    import torch

    from adaptipe.runtime.transport import P2PTransport

    class Work:
        def __init__(self) -> None:
            self.done = False

        def is_completed(self) -> bool:
            return self.done

        def wait(self) -> None:
            self.done = True

    transport = P2PTransport(
        rank=0, device=torch.device("cpu"), num_boundaries=2, num_microbatches=1
    )
    assert not transport.sending()
    first, second = Work(), Work()
    transport._inflight.extend([first, second])
    assert transport.sending()
    first.done = True
    assert transport.sending()  # the second is still out
    second.done = True
    assert not transport.sending() and not transport._inflight
    transport._inflight.append(Work())
    transport.flush()  # the end of an iteration waits for every send
    assert not transport.sending()
