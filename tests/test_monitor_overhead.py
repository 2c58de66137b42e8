"""The cheaper telemetry paths keep what they replace: the collector driven from the
manager's loop takes in every frame (the last ones at shutdown too), writes the same
JSON lines, hands a decision what `observe` would pick anyway; the manager's wait wakes
when a check's iteration is in, not on a timer; a kept-open /proc file reads afresh.

Sockets bind 127.0.0.1 on kernel-chosen ports; waits are bounded.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import pytest

from adaptipe.controllers import observe
from adaptipe.monitor import Collector, DeviceSample, LinkSample, Publisher, StageStats
from adaptipe.monitor.collector import _line
from adaptipe.monitor.device import CpuProbe, _Kept
from adaptipe.monitor.schema import Event, Record
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import LayerProfile, Profile
from adaptipe.runtime import pace
from adaptipe.runtime.adapt_loop import AdaptLoop
from adaptipe.serial import json_line

LAYERS = 4


def _stats(stage: int, iteration: int, *, first: int = 0, count: int = 2) -> StageStats:
    return StageStats(
        run_id="t", stage=stage, iteration=iteration, time_s=100.0 + iteration,
        first_layer=first, forward_s=(0.001 * (iteration + 1),) * count,
        backward_s=(0.002,) * count, compute_s=0.012, wait_s=0.001, comm_s=0.0005,
        iteration_s=0.014 + 0.001 * stage,
    )  # fmt: skip


def _device(stage: int, time_s: float, util: float) -> DeviceSample:
    return DeviceSample(stage=stage, time_s=time_s, source="cpu", fields={"util_pct": util})


def _link(src: int, dst: int, time_s: float, rate: float) -> LinkSample:
    return LinkSample(src=src, dst=dst, time_s=time_s, nbytes=1, seconds=1.0, bandwidth_Bps=rate)


def _take(collector: Collector, count: int, timeout_s: float = 10.0) -> None:
    """Drive the collector from this thread, as the manager's loop does."""
    deadline = time.monotonic() + timeout_s
    while collector.accepted < count and time.monotonic() < deadline:
        collector.pump(50)
    assert collector.accepted == count, (collector.accepted, collector.rejected)


def _profile() -> Profile:
    layer = LayerProfile(
        name="l", kind="Linear", forward_s=0.001, backward_s=0.002, activation_bytes=100,
        gradient_bytes=10, saved_bytes=0, param_bytes=1000, optimizer_bytes=2000, num_params=250,
    )  # fmt: skip
    return Profile(model="m", microbatch=4, device="cpu", layers=(layer,) * LAYERS)


def test_a_decision_reads_what_observe_takes_from_all_records(tmp_path: Path) -> None:
    records: list[Record] = []
    for it in range(10):
        records += [_stats(0, it), _stats(1, it, first=2)]
        records.append(LinkSample(src=0, dst=1, time_s=100.0 + it, nbytes=1, seconds=1.0,
                                  bandwidth_Bps=1e6 * (it + 1)))  # fmt: skip
    # stage 0's newest sample is not its last to arrive; stage 1 has two of equal time
    records += [_device(0, 105.0, 10.0), _device(0, 109.0, 90.0), _device(0, 107.0, 50.0)]
    records += [_device(1, 108.0, 20.0), _device(1, 108.0, 30.0), _device(1, 101.0, 70.0)]
    # the link back: its newest sample came first; two of equal time: the faster
    records += [_link(1, 0, 120.0, 5e6), _link(1, 0, 110.0, 7e6), _link(1, 0, 120.0, 6e6)]
    records.append(Event(kind="checkpoint", time_s=101.0, stage=0, detail={"iteration": 4}))
    with Collector() as collector, Publisher(collector.address, stage=0) as publisher:
        for rec in records:
            assert publisher.publish(rec)
        _take(collector, len(records))
        every, chosen = collector.records(), collector.for_decision()
        recent = collector.for_decision(6)  # a check reads the iterations it needs
    devices = [r for r in chosen if isinstance(r, DeviceSample)]
    assert [(d.stage, d.fields["util_pct"]) for d in devices] == [(0, 90.0), (1, 30.0)]
    links = [(r.src, r.dst, r.bandwidth_Bps) for r in chosen if isinstance(r, LinkSample)]
    assert links == [(0, 1, 10e6), (1, 0, 6e6)]
    stats = [r for r in every if isinstance(r, StageStats)]
    assert [r for r in chosen if isinstance(r, StageStats)] == stats
    assert [r for r in recent if isinstance(r, StageStats)] == [
        r for r in stats if r.iteration >= 6
    ]
    assert [r for r in recent if not isinstance(r, StageStats)] == [
        r for r in chosen if not isinstance(r, StageStats)
    ]
    assert not any(isinstance(r, Event) for r in chosen)  # no decision reads them
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 2, 4))
    assert observe(chosen, _profile(), partition, window=4) == observe(
        every, _profile(), partition, window=4
    )


def test_a_decisions_newest_sample_is_found_again_when_it_leaves_the_ring() -> None:
    # history 3: the newest-stamped sample arrives first, then three older ones push it
    # out; the newest of what the ring still holds is taken, as observe would take it
    samples = [_device(0, 50.0, 1.0), _device(0, 10.0, 2.0), _device(0, 30.0, 3.0)]
    samples += [_device(0, 20.0, 4.0), _device(0, 5.0, 5.0)]
    links = [_link(0, 1, 50.0, 1e6), _link(0, 1, 10.0, 2e6), _link(0, 1, 30.0, 3e6)]
    links += [_link(0, 1, 20.0, 4e6)]
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 2, 4))
    stats: list[Record] = [_stats(0, 0), _stats(1, 0, first=2)]
    with Collector(history=3) as collector, Publisher(collector.address, stage=0) as publisher:
        seen = []
        for rec in [*stats, *samples, *links]:
            assert publisher.publish(rec)
            _take(collector, collector.accepted + 1)
            if isinstance(rec, StageStats):
                continue
            chosen = collector.for_decision()
            dev = [r.fields["util_pct"] for r in chosen if isinstance(r, DeviceSample)]
            bw = [r.bandwidth_Bps for r in chosen if isinstance(r, LinkSample)]
            seen.append((dev, bw))
            every = collector.records()
            assert observe(chosen, _profile(), partition) == observe(every, _profile(), partition)
    assert [d for d, _ in seen[:5]] == [[1.0], [1.0], [1.0], [3.0], [3.0]]
    assert [b for _, b in seen[5:]] == [[1e6], [1e6], [1e6], [3e6]]


def test_telemetry_lines_are_json_lines_and_an_infinity_is_null(tmp_path: Path) -> None:
    link = LinkSample(src=0, dst=1, time_s=1.0, nbytes=8, seconds=0.0, bandwidth_Bps=float("inf"))
    for rec in (_stats(0, 3), _device(1, 2.0, 5.5), link):
        assert _line(rec) == json_line(rec.to_dict(), separators=(",", ":"))
    assert json.loads(_line(link))["bandwidth_Bps"] is None


def test_drain_takes_in_the_frames_a_closing_stage_sent_last(tmp_path: Path) -> None:
    log = tmp_path / "telemetry.jsonl"
    with Collector(jsonl=log) as collector:
        publisher = Publisher(collector.address, stage=0)
        for it in range(200):
            assert publisher.publish(_stats(0, it))
        publisher.close(linger_s=2.0)  # a stage's last iteration, then its exit
        assert collector.drain() == 200
        assert collector.drain(quiet_ms=10) == 0  # nothing is left: it returns at once
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["iteration"] for r in lines] == list(range(200))


@dataclass
class _Loop:
    """What the manager's wait asks of the decision loop."""

    due: bool = False
    deciding: bool = False
    answered: threading.Event = field(default_factory=threading.Event)

    def await_answer(self, timeout_s: float) -> None:
        self.answered.wait(timeout_s)


def _waited(wait: pace.Pace, loop: _Loop, collector: Collector) -> float:
    t0 = time.monotonic()
    wait.wait(cast(AdaptLoop, loop), collector)
    return time.monotonic() - t0


def test_the_manager_waits_for_a_checks_iteration_not_for_a_timer() -> None:
    with Collector() as collector, Publisher(collector.address, stage=0) as publisher:
        wait = pace.Pace(poll_s=2.0, stages=2, next_iteration=5)
        loop = _Loop(due=True)
        publisher.publish(_device(0, 1.0, 1.0))
        publisher.publish(_stats(0, 5))  # stage 1 has not reported iteration 5 yet
        publisher.publish(_stats(1, 4))
        assert _waited(pace.Pace(poll_s=0.3, stages=2, next_iteration=5), loop, collector) >= 0.25
        assert collector.accepted == 3  # taken in while it waited on: not woken by them
        publisher.publish(_stats(1, 5))
        assert _waited(wait, loop, collector) < 1.0  # woken by the last stage's frame
        assert collector.accepted == 4
        loop.deciding = True  # a controller call started: its answer is polled for
        assert _waited(wait, loop, collector) < 1.0
        loop.due = False  # nothing near: a plain sleep, frames wait for the next pass
        publisher.publish(_stats(0, 6))
        t = _waited(pace.Pace(poll_s=0.2, stages=2, next_iteration=6), loop, collector)
        assert t >= 0.19 and collector.accepted == 4


def test_the_manager_polls_a_calls_answer_at_adapt_poll_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pace, "ADAPT_POLL_S", 0.05)
    with Collector() as collector:
        wait = pace.Pace(poll_s=0.6, stages=1, next_iteration=0)
        loop = _Loop(due=True, deciding=True)  # a call started
        took = [_waited(wait, loop, collector) for _ in range(3)]
        assert all(0.04 <= t < 0.4 for t in took), took
        loop.due = False  # its answer is in
        loop.deciding = False
        assert _waited(wait, loop, collector) >= 0.55
        loop.due = True  # the next check nears, no call yet: wait for its iteration
        assert _waited(wait, loop, collector) >= 0.55


def test_the_manager_wakes_when_a_calls_answer_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pace, "ADAPT_POLL_S", 5.0)  # not the poll period: the answer
    with Collector() as collector:
        wait = pace.Pace(poll_s=5.0, stages=1, next_iteration=0)
        loop = _Loop(due=True, deciding=True)
        timer = threading.Timer(0.1, loop.answered.set)
        timer.start()
        try:
            assert 0.09 <= _waited(wait, loop, collector) < 2.0
        finally:
            timer.cancel()


def test_a_timed_stage_is_looked_at_when_its_iteration_should_end_not_at_each_frame() -> None:
    # Stage 0 ended iterations 0-7 every 0.3 s, the last just now: iteration 8 should be
    # in 0.3 s from now. Its frame comes at once; the manager still sleeps until then
    # (plus an eighth of the period) and takes it in with what else came, in one batch.
    now = time.time()
    timed = [replace(_stats(0, it), time_s=now - 0.3 * (7 - it)) for it in range(8)]
    with Collector() as collector, Publisher(collector.address, stage=0) as publisher:
        for rec in timed:
            assert publisher.publish(rec)
        _take(collector, len(timed))
        wait = pace.Pace(poll_s=3.0, stages=1, next_iteration=8)
        loop = _Loop(due=True)
        assert publisher.publish(replace(_stats(0, 8), time_s=now + 0.01))
        assert publisher.publish(_link(0, 1, now, 1e6))
        took = _waited(wait, loop, collector)
        assert 0.3 <= took < 2.0, took
        assert collector.accepted == len(timed) + 2  # both frames, in the one look
        # iteration 9 never comes: it looks again every eighth of a period, to poll_s
        wait = pace.Pace(poll_s=0.8, stages=1, next_iteration=9)
        assert 0.75 <= _waited(wait, loop, collector) < 1.5


def test_a_check_due_every_iteration_waits_for_its_iteration_once_its_call_answered() -> None:
    # check_every = 1: a check is due again as soon as a call answers. The manager waits
    # for the next iteration's telemetry then, not on the 10 ms poll of a call in flight
    # (which merged iterations before their telemetry came: every decision a step late)
    with Collector() as collector:
        wait = pace.Pace(poll_s=0.6, stages=1, next_iteration=0)
        loop = _Loop(due=True, deciding=True)
        assert _waited(wait, loop, collector) < 0.4
        loop.deciding = False  # answered; the next check is due at once
        assert _waited(wait, loop, collector) >= 0.55


def test_a_kept_file_reads_afresh_and_a_forked_child_reads_its_own(tmp_path: Path) -> None:
    path = tmp_path / "value"
    path.write_text("one\n")
    kept = _Kept(str(path))
    assert kept.read() == "one\n"
    path.write_text("two, longer\n")  # the same inode, rewritten
    assert kept.read() == "two, longer\n"
    own = _Kept("/proc/self/stat")
    assert (own.read() or "").split()[0] == str(os.getpid())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: /proc/self is now another process
        os.write(w, (own.read() or "").split()[0].encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 64).decode()
    os.waitpid(pid, 0)
    assert got == str(pid)
    missing = _Kept(str(tmp_path / "absent"))
    assert missing.read() is None


def test_the_cpu_probe_keeps_its_files_open_until_closed() -> None:
    probe = CpuProbe()
    first: dict[str, Any] = probe.read()
    assert {"util_pct", "mem_total_bytes", "rss_bytes"} <= set(first)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        probe.read()
    assert len(os.listdir("/proc/self/fd")) == fds  # no file opened per read
    probe.close()
    assert len(os.listdir("/proc/self/fd")) <= fds - 3
