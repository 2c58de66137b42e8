"""Link bandwidth from the transport's own sends: the busy-time accounting, the watcher
thread that times each send from post to completion, and real two-stage runs whose
telemetry carries what each link moved, how long it was busy, and how a throttle on a
link shows up as lower bandwidth. With telemetry off, a run has no records and no cost."""

from __future__ import annotations

import gc
import json
import math
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptipe.models import get_model
from adaptipe.monitor.bandwidth import (
    SATURATED,
    BusyTally,
    FastEnd,
    LinkWatcher,
    link_bandwidth,
)
from adaptipe.monitor.capacity import RAISE, LinkCapacity
from adaptipe.monitor.linktimer import LinkTimer
from adaptipe.monitor.schema import MonitorError
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.transport import P2PTransport


class _Clock:
    """A fake clock that a fake send moves to its end time when it completes."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Work:
    """A fake ``isend`` work that completes at ``end`` on the clock once released."""

    def __init__(self, clock: _Clock, end: float, *, error: Exception | None = None) -> None:
        self.clock, self.end, self.error = clock, end, error
        self.released = threading.Event()
        self.entered = threading.Event()
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        self.entered.set()
        assert self.released.wait(10), "the test never released this send"
        if self.error is not None:
            raise self.error
        self.clock.now = self.end
        return True

    def is_completed(self) -> bool:
        if self.released.is_set():
            self.clock.now = self.end
        return self.released.is_set()


class _PollOnly(_Work):
    def wait(self) -> bool:
        raise AssertionError("a polling watcher must not call wait()")


class _Ready:
    """A fake CUDA event: the device reaches it at ``at`` on the clock once released."""

    def __init__(self, clock: _Clock, at: float) -> None:
        self.clock, self.at = clock, at
        self.released = threading.Event()

    def query(self) -> bool:
        if self.released.is_set():
            self.clock.now = self.at
        return self.released.is_set()


class _Payload:
    """Stands in for the sent tensor, which the watcher keeps alive until completion."""


def _release_later(items: Sequence[_Work | _Ready], delay_s: float = 0.05) -> threading.Thread:
    def release() -> None:
        time.sleep(delay_s)
        for item in items:
            item.released.set()

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------------------- accounting
def test_busy_time_is_the_union_of_a_links_sends_not_their_sum() -> None:
    tally = BusyTally()
    for start, end in ((0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (6.0, 7.0)):
        tally.add(start, end, 100)
    # durations sum to 6 s, but [0, 4] and [6, 7] are 5 s of busy link
    assert tally.take() == pytest.approx((400, 5.0))
    assert tally.take() == (0, 0.0)
    tally.add(6.5, 8.0, 50)  # overlaps a send taken before: only [7, 8] is new
    assert tally.take() == pytest.approx((50, 1.0))
    assert tally.transfers == 5


@pytest.mark.parametrize(("start", "end"), [(9.0, 8.5), (5.0, 9.0)])
def test_busy_tally_refuses_reversed_or_out_of_order_sends(start: float, end: float) -> None:
    tally = BusyTally()
    tally.add(6.0, 7.0, 1)
    with pytest.raises(MonitorError, match="start <= end, starts in order"):
        tally.add(start, end, 1)


def test_watcher_times_sends_from_post_to_completion_and_drain_waits_for_them() -> None:
    clock = _Clock()
    watcher = LinkWatcher(0, 1, clock=clock)
    try:
        # posted at 0, 1 and 5; complete at 2, 3 and 6 (the first two overlap)
        works = [_Work(clock, end) for end in (2.0, 3.0, 6.0)]
        payload = _Payload()
        kept = weakref.ref(payload)
        for work, start in zip(works, (0.0, 1.0, 5.0), strict=True):
            watcher.submit(work, start, 256, payload)
        del payload
        assert watcher.pending == 3
        releaser = _release_later(works)
        watcher.drain()  # returns only once every send completed
        releaser.join()
        assert watcher.pending == 0
        assert watcher.take() == pytest.approx((768, 4.0))
        assert [w.waits for w in works] == [1, 1, 1]  # gloo lets a send be waited for once
        gc.collect()
        assert kept() is None, "the watcher kept a completed send's tensor alive"
    finally:
        assert watcher.close()


def test_polling_watcher_never_calls_wait() -> None:
    clock = _Clock()
    watcher = LinkWatcher(2, 3, poll_s=0.001, clock=clock)
    try:
        works = [_PollOnly(clock, end) for end in (1.5, 2.5)]
        watcher.submit(works[0], 1.0, 10)
        watcher.submit(works[1], 1.2, 20)  # overlaps the first: [1, 2.5] in all
        _release_later(works).join()
        watcher.drain()
        assert watcher.take() == pytest.approx((30, 1.5))
    finally:
        assert watcher.close()


def test_a_polled_send_starts_when_the_device_reaches_it_if_that_is_later() -> None:
    clock = _Clock()
    watcher = LinkWatcher(0, 1, poll_s=0.001, clock=clock)
    try:
        late, early = _Ready(clock, 3.0), _Ready(clock, 4.5)
        first, second = _PollOnly(clock, 4.0), _PollOnly(clock, 6.0)
        watcher.submit(first, 1.0, 10, ready=late)  # device busy until 3: sends 3 -> 4
        watcher.submit(second, 5.0, 10, ready=early)  # device was done at 4.5: 5 -> 6
        _release_later([late, first, early, second]).join()
        watcher.drain()
        assert watcher.take() == pytest.approx((20, 2.0))
    finally:
        assert watcher.close()


def test_a_failed_send_is_raised_from_drain() -> None:
    clock = _Clock()
    watcher = LinkWatcher(0, 1, clock=clock)
    try:
        work = _Work(clock, 1.0, error=RuntimeError("peer 1 is gone"))
        work.released.set()
        watcher.submit(work, 0.0, 8)
        with pytest.raises(RuntimeError, match="peer 1 is gone"):
            watcher.drain()
    finally:
        assert watcher.close()


def test_close_returns_promptly_while_a_send_never_completes() -> None:
    watcher = LinkWatcher(0, 1, clock=_Clock())
    stuck = _Work(_Clock(), 1.0)
    watcher.submit(stuck, 0.0, 8)
    queued = _Work(_Clock(), 2.0)
    watcher.submit(queued, 0.5, 8)  # behind it: let go at close, never waited for
    assert stuck.entered.wait(5)
    t0 = time.monotonic()
    assert watcher.close(timeout_s=0.2) is False  # still inside wait(): a daemon thread
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(MonitorError, match="closed"):
        watcher.submit(_Work(_Clock(), 3.0), 1.0, 8)
    stuck.released.set()  # the thread then ends without waiting for the queued send
    assert watcher.close(timeout_s=5.0)
    assert queued.waits == 0


def test_link_timer_gives_one_sample_per_link_that_moved_bytes() -> None:
    clock = _Clock()
    timer = LinkTimer(1, clock=clock)
    try:
        first = {0: _Work(clock, 1.0), 2: _Work(clock, 2.0)}
        timer.submit(0, first[0], 0.0, 1000)
        timer.submit(2, first[2], 1.0, 3000)
        _release_later(list(first.values())).join()
        timer.drain()
        samples = timer.samples()
        assert [(s.src, s.dst, s.nbytes, s.seconds) for s in samples] == [
            (1, 0, 1000, 1.0),
            (1, 2, 3000, 1.0),
        ]
        assert [s.bandwidth_Bps for s in samples] == [1000.0, 3000.0]
        assert timer.samples() == []  # nothing sent since
        slow = _Work(clock, 6.0)
        timer.submit(0, slow, 2.0, 1000)
        slow.released.set()
        timer.drain()
        (again,) = timer.samples()
        # busy for the whole of the 4 s since the last samples, and the iteration before:
        # the bottleneck, read at bytes over busy time (the fast end, 1000 B/s, aside)
        assert again.seconds == 4.0 and again.bandwidth_Bps == 250.0
        assert timer.bandwidth_Bps(0) == 250.0 and timer.bandwidth_Bps(5) == 0.0
    finally:
        assert timer.close()


def test_a_link_bounded_by_its_remembered_rate_asks_for_a_probe_that_can_lift_it() -> None:
    clock = _Clock()
    timer = LinkTimer(0, clock=clock)
    try:
        for end in (2.0, 4.0):  # busy the whole iteration twice: the bottleneck, 500 B/s
            work = _Work(clock, end)
            timer.submit(1, work, end - 2.0, 1000)
            work.released.set()
            timer.drain()
            timer.samples()
        assert timer.probe_bytes(1) == 0  # saturated: what it carries shows its rate
        light = _Work(clock, 4.01)
        timer.submit(1, light, 4.0, 100)  # a light send that the token bucket passes
        light.released.set()
        timer.drain()
        clock.now = 6.0
        (sample,) = timer.samples()
        assert sample.bandwidth_Bps == 500.0  # bounded by the remembered rate
        assert timer.probe_bytes(1) == 16 << 10  # light, bounded: a probe is worth it
        assert timer.probe_bytes(2) == 0  # a link never seen bounded needs none
        assert timer.probed(1, 16 << 10, 0.5) == (500.0, None)  # 33 kB/s: the limit is gone
        assert timer.probe_bytes(1) == 0
    finally:
        assert timer.close()


def test_the_fast_end_ignores_a_delay_that_spares_some_sends_and_follows_a_slow_link() -> None:
    link = FastEnd(window=16, quantile=0.9)
    assert link.bandwidth_Bps == 0.0
    fast = (128 << 10) / 0.00015
    for k in range(16):  # 128 KB sends: two of 16 at the link's speed, the rest late
        link.add(128 << 10, 0.00015 if k >= 14 else 0.002)
    assert link.bandwidth_Bps == pytest.approx(fast)
    for _ in range(14):  # a throttle: every send slow; the window still holds the 2 fast
        link.add(128 << 10, 0.05)
        assert link.bandwidth_Bps == pytest.approx(fast)
    link.add(128 << 10, 0.05)  # 15 of 16 slow
    assert link.bandwidth_Bps == pytest.approx((128 << 10) / 0.05)
    link.add(0, 1.0)  # an empty send and one below the clock's resolution count for nothing
    link.add(10, 0.0)
    assert link.bandwidth_Bps == pytest.approx((128 << 10) / 0.05)
    with pytest.raises(MonitorError, match="window >= 1 and quantile"):
        FastEnd(window=0)


def test_a_link_busy_half_the_iteration_reads_at_its_busy_rate_and_a_lighter_one_at_its_fast_end() -> (
    None
):
    # 512 KB in 7 ms of a 27 ms iteration (a fast link, its sends delayed): the fast end
    assert link_bandwidth(512 << 10, 0.007, 0.027, 500e6) == 500e6
    # the same bytes in 200 ms of a 300 ms iteration (throttled): bytes over busy time,
    # though a send that fitted in the socket's buffer made the fast end read 57 MB/s
    assert link_bandwidth(512 << 10, 0.2, 0.3, 57e6) == pytest.approx((512 << 10) / 0.2)
    assert SATURATED == 0.5
    # one saturated iteration after a light one is not believed (a stalled core)
    assert link_bandwidth(512 << 10, 0.2, 0.3, 57e6, before=False) == 57e6
    # never below what the link carried while busy
    assert link_bandwidth(1000, 0.001, 1.0, 10.0) == 1e6
    assert link_bandwidth(1000, 0.0, 1.0, 0.0) == 0.0


def test_a_link_reports_no_more_than_its_rate_as_a_bottleneck_until_it_carries_more() -> None:
    """bench_adaptive's CNN on a 20 Mbit/s link: at cut 3 the link is the bottleneck at
    2.5 MB/s; moved to cut 5 it carries 64 KB an iteration, which the token bucket
    passes at once (the fast end read 90-160 MB/s): it still reports 2.5 MB/s."""
    link = LinkCapacity()
    assert link.bound(150e6, nbytes=65536, span_s=0.05, bottleneck=False) == 150e6  # never one
    assert link.bound(2.5e6, nbytes=524288, span_s=0.3, bottleneck=True) == 2.5e6
    assert link.bound(150e6, nbytes=65536, span_s=0.05, bottleneck=False) == 2.5e6
    assert link.bound(1e6, nbytes=65536, span_s=0.05, bottleneck=False) == 1e6  # lower: as read
    # carrying more than RAISE times the rate over an iteration shows it rose
    carried = int(RAISE * 2.5e6 * 0.05) + 1000
    assert link.bound(150e6, nbytes=carried, span_s=0.05, bottleneck=False) == 150e6
    assert link.rate_Bps is None
    assert link.bound(150e6, nbytes=65536, span_s=0.05, bottleneck=False) == 150e6


def test_transport_without_link_measurement_starts_no_thread() -> None:
    before = threading.active_count()
    kwargs: dict[str, Any] = {
        "rank": 0,
        "device": torch.device("cpu"),
        "num_boundaries": 2,
        "num_microbatches": 4,
    }
    plain = P2PTransport(**kwargs)
    measured = P2PTransport(**kwargs, measure_links=True)  # watchers start on a first send
    assert plain.link_samples() == [] and measured.link_samples() == []
    assert threading.active_count() == before
    plain.close()
    measured.close()


# ------------------------------------------------------------------------ real runs
def _telemetry(run_dir: str | Path) -> list[dict[str, Any]]:
    path = RunDir(run_dir).telemetry
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _boundary_bytes(cfg: RunConfig, run_dir: str) -> int:
    """Bytes of one micro-batch's activation at the stage 0 | stage 1 boundary."""
    spec = get_model(cfg.model.name, **cfg.model.config)
    bounds = RunDir(run_dir).read_partition().bounds
    x = spec.dataset(split="train").sample_input(cfg.data.batch_size // cfg.data.microbatches)
    with torch.no_grad():
        for layer in range(bounds[1]):
            x = spec.build_layer(layer, seed=0)(x)
    return x.numel() * x.element_size()


def test_two_stage_run_reports_what_each_link_carried(
    make_config: Callable[..., RunConfig],
) -> None:
    iterations = 12
    cfg = make_config(train={"iterations": iterations, "link_telemetry": True})
    summary = train(cfg)
    records = _telemetry(summary.run_dir)
    links = [r for r in records if r["type"] == "link_sample"]
    assert {(r["src"], r["dst"]) for r in links} == {(0, 1), (1, 0)}
    # activations forward and their gradients back: one of each per micro-batch
    expected = _boundary_bytes(cfg, summary.run_dir) * cfg.data.microbatches
    assert expected == 4 * 4 * 16 * 4  # 4 micro-batches of 4 x 16 float32
    for src in (0, 1):
        mine = [r for r in links if r["src"] == src]
        stats = [r for r in records if r["type"] == "stage_stats" and r["stage"] == src]
        assert len(mine) == len(stats) == iterations
        assert all(r["nbytes"] == expected for r in mine)
        assert all(r["seconds"] > 0 and r["bandwidth_Bps"] > 0 for r in mine)
        # one sample per iteration, taken once the iteration ended (a link is busy only
        # while it runs) and sent just before its stats, so that the manager has it when
        # it merges the iteration and decides
        order = [
            r["type"]
            for r in records
            if r["type"] in ("link_sample", "stage_stats") and r.get("stage", r.get("src")) == src
        ]
        assert order == ["link_sample", "stage_stats"] * iterations
        for link, stat in zip(mine, stats, strict=True):
            assert link["seconds"] <= stat["iteration_s"] + 1e-6
            assert link["time_s"] >= stat["time_s"]


THROTTLE = """
[[inject]]
kind = "link_throttle"
stage = 0
bandwidth = "10KB/s"
at_iteration = 12
iterations = 22
"""


def _by_iteration(records: list[dict[str, Any]], src: int) -> dict[int, tuple[Any, Any]]:
    """Per iteration of stage ``src``: (its stage_stats, its link_sample).

    A stage publishes one of each per iteration, in iteration order, so they pair up."""
    stats = [r for r in records if r["type"] == "stage_stats" and r["stage"] == src]
    links = [r for r in records if r["type"] == "link_sample" and r["src"] == src]
    assert len(stats) == len(links)
    return {s["iteration"]: (s, link) for s, link in zip(stats, links, strict=True)}


def test_a_throttled_link_measures_lower_bandwidth_than_unthrottled(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    scenario = tmp_path / "throttle.toml"
    scenario.write_text(THROTTLE)
    summary = train(make_config(train={"iterations": 44, "link_telemetry": True}), inject=scenario)
    records = _telemetry(summary.run_dir)
    start = next(r["time_s"] for r in records if r.get("kind") == "injection-start")

    # Which iterations ran throttled, without trusting timing margins on a loaded machine:
    # a worker reads the control files when an iteration begins, after publishing the
    # one before. The runner writes the throttle only once it has seen iteration 11 end,
    # and removes it only once it has seen iteration 33 end. If the manager falls behind
    # the workers it starts the throttle late (never before iteration 12); 22 iterations
    # leave room for that on a loaded machine.
    def rates(src: int, throttled: bool) -> list[float]:
        out = []
        pairs = _by_iteration(records, src)
        for it, (_, link) in sorted(pairs.items()):
            after_start = it - 1 in pairs and pairs[it - 1][0]["time_s"] > start
            if (after_start and it <= 33) if throttled else 2 <= it <= 11:
                out.append(link["nbytes"] / link["seconds"])
        return out

    before, during, back = rates(0, False), rates(0, True), rates(1, True)
    assert len(before) == 10 and len(during) >= 5 and len(back) >= 5, (before, during, back)
    cap = 10e3
    low = statistics.median(during)
    print(
        f"0 -> 1 median: unthrottled {statistics.median(before) / 1e3:.1f} kB/s, "
        f"throttled {low / 1e3:.2f} kB/s; 1 -> 0 meanwhile {statistics.median(back) / 1e3:.1f} kB/s"
    )
    # the throttle's delay falls inside each send's timed interval: it cannot be beaten
    assert max(during) <= cap * 1.001, (cap, during)
    assert statistics.median(before) >= 4 * low
    assert statistics.median(back) >= 4 * low  # the other direction is not throttled
    _, last = _by_iteration(records, 0)[33]
    assert last["bandwidth_Bps"] <= 2 * cap  # the estimate followed it down


def test_telemetry_off_writes_no_records_and_trains(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = make_config(train={"iterations": 6, "telemetry": False})
    summary = train(cfg)
    assert summary.iterations == 6
    assert summary.final_loss is not None and math.isfinite(summary.final_loss)
    assert _telemetry(summary.run_dir) == []
    metrics = RunDir(summary.run_dir).read_metrics()
    assert [m["iteration"] for m in metrics] == list(range(6))


def test_link_timing_is_off_unless_asked_for(make_config: Callable[..., RunConfig]) -> None:
    summary = train(make_config(train={"iterations": 4}))
    records = _telemetry(summary.run_dir)
    assert {r["stage"] for r in records if r["type"] == "stage_stats"} == {0, 1}
    assert not [r for r in records if r["type"] == "link_sample"]
