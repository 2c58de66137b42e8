"""Telemetry over ZeroMQ on loopback: delivery, rejection counting, no stalls, CURVE.

Every socket binds to 127.0.0.1 with a kernel-chosen port; waits are bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from adaptipe.monitor import (
    Collector,
    CurveKeys,
    DeviceSample,
    LinkMeter,
    LinkSample,
    MonitorError,
    Publisher,
    StageStats,
    probe,
)
from adaptipe.monitor.publisher import DeviceSampler, check_address
from adaptipe.monitor.schema import MAX_FRAME_BYTES, SCHEMA_VERSION, Record, Source

ROOT = Path(__file__).resolve().parent.parent


def _stats(stage: int, iteration: int) -> StageStats:
    return StageStats(
        run_id="t", stage=stage, iteration=iteration, time_s=time.time(),
        forward_s=(0.001,) * 4, backward_s=(0.002,) * 4,
        compute_s=0.012, wait_s=0.001, comm_s=0.0005, iteration_s=0.014,
    )  # fmt: skip


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    with Collector(history=4, jsonl=tmp_path / "telemetry.jsonl").start() as c:
        yield c


def test_stats_from_publishers_are_stored_per_stage(collector: Collector, tmp_path: Path) -> None:
    assert collector.address.startswith("tcp://127.0.0.1:")
    assert not collector.address.endswith(":*")
    with Publisher(collector.address, stage=0) as p0, Publisher(collector.address, stage=1) as p1:
        for i in range(6):
            assert p0.publish(_stats(0, i))
            assert p1.publish(_stats(1, i))
        p1.event("checkpoint", iteration=5)
        assert _until(lambda: collector.accepted == 13)
    assert collector.stages() == [0, 1]
    latest = collector.latest(1)
    assert latest is not None and latest.iteration == 5 and latest.forward_s == (0.001,) * 4
    assert [s.iteration for s in collector.history(0)] == [2, 3, 4, 5]  # ring of 4
    assert [s.iteration for s in collector.history(0, last=2)] == [4, 5]
    assert [s.iteration for s in collector.history(0, last=9)] == [2, 3, 4, 5]
    assert collector.latest(7) is None and collector.history(7) == []
    assert [e.kind for e in collector.events()] == ["checkpoint"]
    lines = (tmp_path / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) == 13
    assert all(json.loads(line)["v"] == SCHEMA_VERSION for line in lines)


def test_a_taken_port_is_a_clear_error(collector: Collector) -> None:
    with pytest.raises(MonitorError, match="cannot bind"):
        Collector(collector.address)


def test_bad_frames_are_counted_while_valid_ones_keep_flowing(collector: Collector) -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(collector.address)
    bad_version = msgpack.packb({**_stats(0, 0).to_dict(), "v": SCHEMA_VERSION + 1})
    try:
        for i in range(5):
            raw.send(b"\x00garbage")
            raw.send(b"\x80" * (MAX_FRAME_BYTES + 1))
            raw.send(bad_version)
            raw.send_multipart([_stats(0, i).to_wire(), b"second part"])
            raw.send(_stats(0, i).to_wire())
        assert _until(lambda: collector.accepted == 5 and sum(collector.rejected.values()) == 20)
    finally:
        raw.close()
        ctx.term()
    rejected = collector.rejected
    assert rejected["malformed"] == 10  # garbage and multipart
    assert rejected["oversized"] == 5
    assert rejected["wrong-version"] == 5
    assert [s.iteration for s in collector.history(0)] == [1, 2, 3, 4]


def test_a_dead_collector_never_stalls_the_publisher() -> None:
    collector = Collector()
    publisher = Publisher(collector.address, stage=0, hwm=100)
    try:
        collector.close()  # the manager goes away; its port now has nobody listening
        frame = _stats(0, 0).to_wire()
        t0 = time.perf_counter()
        for _ in range(10_000):
            publisher.publish_frame(frame)
        elapsed = time.perf_counter() - t0
        assert elapsed < 1.0
        assert publisher.dropped >= 10_000 - 200  # at most about one queue's worth went out
        assert publisher.sent + publisher.dropped == 10_000
    finally:
        publisher.close()
    assert not publisher.publish(_stats(0, 1))  # after close: dropped, not raised
    assert publisher.dropped == 10_001 - publisher.sent


def test_a_publisher_in_another_process_reaches_the_collector(collector: Collector) -> None:
    script = (
        "import sys, time\n"
        "from adaptipe.monitor import Publisher, StageStats\n"
        "with Publisher(sys.argv[1], stage=3) as p:\n"
        "    for i in range(1000):\n"
        "        p.publish(StageStats(run_id='sub', stage=3, iteration=i, time_s=time.time(),\n"
        "                             compute_s=0.01, wait_s=0, comm_s=0, iteration_s=0.01))\n"
        "        time.sleep(0.01)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script, collector.address], env=env)
    try:
        assert _until(lambda: len(collector.history(3)) >= 3, timeout_s=30)
        latest = collector.latest(3)
        assert latest is not None and latest.run_id == "sub"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_device_sampler_publishes_samples(collector: Collector) -> None:
    with Publisher(collector.address, stage=2) as publisher:
        sampler = publisher.start_sampler(interval_s=0.1)
        assert _until(lambda: len(collector.device_history(2)) >= 2)
        assert sampler.samples >= 2 and sampler.cpu_s >= 0.0
    sample = collector.latest_device(2)
    assert sample is not None and sample.source == "cpu" and "rss_bytes" in sample.fields
    with pytest.raises(MonitorError, match=r"interval_s must be in \[0.1, 0.5\]"):
        DeviceSampler(publisher.publish, stage=0, interval_s=0.01)


def test_a_sampler_stopped_before_its_first_tick_still_publishes_one_sample() -> None:
    got: list[Record] = []

    def publish(record: Record) -> bool:
        got.append(record)
        return True

    sampler = DeviceSampler(publish, stage=3, interval_s=0.5).start()
    time.sleep(0.05)
    sampler.stop()
    assert len(got) == 1 and sampler.samples == 1  # a run shorter than the interval
    assert isinstance(got[0], DeviceSample) and got[0].stage == 3


def test_link_samples_are_kept_per_link_in_a_ring(collector: Collector) -> None:
    meter = LinkMeter(0, 1)
    with Publisher(collector.address, stage=0) as publisher:
        for i in range(6):
            meter.record(1000 * (i + 1), 0.001)
            assert publisher.publish(meter.sample(1000 * (i + 1), 0.001))
        assert publisher.publish(LinkMeter(1, 0).sample(10, 0.0))
        assert _until(lambda: collector.accepted == 7)
    assert [s.nbytes for s in collector.link_history(0, 1)] == [3000, 4000, 5000, 6000]
    assert collector.links()[(0, 1)].nbytes == 6000 and collector.links()[(1, 0)].nbytes == 10
    assert collector.link_history(5, 6) == []
    assert sum(isinstance(r, LinkSample) for r in collector.records()) == 5  # 4 + 1


def test_sampler_survives_a_failing_probe() -> None:
    class Flaky:
        source: Source = "cpu"
        calls = 0

        def read(self) -> dict[str, float]:
            Flaky.calls += 1
            if Flaky.calls % 2:
                raise OSError("transient")
            return {"util_pct": 1.0}

        def close(self) -> None:
            pass

    got: list[Record] = []

    def publish(record: Record) -> bool:
        got.append(record)
        return True

    sampler = DeviceSampler(publish, stage=0, interval_s=0.1, probe=Flaky())
    sampler.start()
    try:
        assert _until(lambda: len(got) >= 2)
    finally:
        sampler.stop()
    assert all(isinstance(r, DeviceSample) for r in got)


@pytest.mark.parametrize(
    "address", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://node7:5555"]
)
def test_off_loopback_without_curve_keys_is_refused(address: str) -> None:
    with pytest.raises(MonitorError, match="CURVE keys are required off loopback"):
        Collector(address)
    with pytest.raises(MonitorError, match="CURVE keys are required off loopback"):
        Publisher(address, stage=0)


def test_loopback_and_local_transports_need_no_keys() -> None:
    for address in ("tcp://127.0.0.1:1", "tcp://localhost:1", "tcp://[::1]:1", "ipc:///tmp/x"):
        check_address(address, None)
    with pytest.raises(MonitorError, match="must be tcp://"):
        check_address("udp://127.0.0.1:1", None)


def test_curve_pair_works_and_strangers_are_not_accepted() -> None:
    keys = CurveKeys.generate()
    with Collector(curve=keys.for_server()).start() as collector:
        address = collector.address
        with (
            Publisher(address, stage=0, curve=keys.for_client()) as good,
            Publisher(address, stage=1) as plain,  # no CURVE at all
            Publisher(address, stage=2, curve=_stranger(keys)) as stranger,
        ):
            for i in range(20):
                good.publish(_stats(0, i))
                plain.publish(_stats(1, i))
                stranger.publish(_stats(2, i))
            assert _until(lambda: collector.accepted == 20)
            time.sleep(0.3)  # give the refused ones every chance to arrive
        assert collector.stages() == [0]
    with pytest.raises(MonitorError, match="server_secret"):
        Collector(curve=keys.for_client())
    with pytest.raises(MonitorError, match="client_secret"):
        Publisher("tcp://127.0.0.1:1", stage=0, curve=keys.for_server())


def _stranger(keys: CurveKeys) -> CurveKeys:
    """Knows the server's public key but has its own, unlisted client key pair."""
    public, secret = zmq.curve_keypair()
    return CurveKeys(keys.server_public, None, public, secret)


def test_link_meter_smooths_bytes_and_seconds_separately() -> None:
    meter = LinkMeter(0, 1, alpha=0.5)
    assert meter.bandwidth_Bps == 0.0
    assert meter.record(1000, 1.0) == pytest.approx(1000.0)
    # A tiny, latency-bound transfer barely moves the bandwidth of big ones.
    assert meter.record(10, 0.001) == pytest.approx(505 / 0.5005)
    meter.record(0, 0.0)  # below clock resolution: counted, not smoothed
    assert (meter.total_bytes, meter.transfers) == (1010, 3)
    assert meter.mean_Bps == pytest.approx(1010 / 1.001)
    sample = meter.sample(10, 0.001)
    assert (sample.src, sample.dst, sample.bandwidth_Bps) == (0, 1, meter.bandwidth_Bps)
    with pytest.raises(MonitorError):
        meter.record(-1, 1.0)
    with pytest.raises(MonitorError):
        LinkMeter(0, 1, alpha=0.0)


def test_probe_fits_latency_and_bandwidth_from_round_trips() -> None:
    now = [0.0]
    echoes: deque[int] = deque()

    def send(payload: bytes) -> None:  # 50 us each way plus 1 GB/s, on a fake clock
        now[0] += 2 * (50e-6 + len(payload) / 1e9)
        echoes.append(len(payload))

    result = probe(send, echoes.popleft, sizes=(1 << 10, 1 << 16, 1 << 20), clock=lambda: now[0])
    assert result.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert result.bandwidth_Bps == pytest.approx(1e9, rel=1e-6)
    assert len(result.rtt_s) == 3 and not echoes


def test_probe_over_a_real_loopback_echo() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")

        def send(payload: bytes) -> None:
            a.send(payload)
            b.send(b.recv())

        result = probe(send, a.recv, sizes=(1 << 10, 1 << 18), repeats=3)
        assert result.bandwidth_Bps > 1e6 and all(r > 0 for r in result.rtt_s)
    finally:
        for s in (a, b):
            s.close(linger=0)
        ctx.term()
