"""The live link probe (`adaptipe.runtime.link_probe`): a link whose remembered throttle
bounds what it reports is probed until a probe shows the throttle gone (a slower reading
leaves the limit as it was); the exchanges of three workers on two links never
deadlock, and links without a remembered rate are left alone."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from adaptipe.monitor.capacity import FORGET, PROBE_S, LinkCapacity
from adaptipe.profile.children import free_port, run_children
from adaptipe.runtime.config_sections import TrainSection
from adaptipe.runtime.link_probe import LinkProbe, probe_hook, probe_links
from adaptipe.schedule.build import build_schedule

LIMIT = 1e6  # B/s: the rate each probed link was remembered at


def test_a_remembered_rate_asks_for_a_probe_sized_to_it_and_a_probe_moves_it() -> None:
    link = LinkCapacity()
    assert link.probe_bytes(saturated=False) == 0  # nothing remembered: no probe
    link.rate_Bps = 10e6
    assert link.probe_bytes(saturated=False) == int(10e6 * PROBE_S)
    assert link.probe_bytes(saturated=True) == 0  # what it carries shows its rate
    link.rate_Bps = 1e3
    assert link.probe_bytes(saturated=False) == 16 << 10  # never below a burst and RTTs
    link.rate_Bps = 10e6
    link.probed(10e6 / 3)  # low: it may have waited behind queued sends
    assert link.rate_Bps == 10e6  # unchanged
    link.probed(12.1e6)  # the rate, read above a limit remembered low (2.58 vs 2.14)
    assert link.rate_Bps == 12.1e6  # raised to the reading, not forgotten
    link.probed(12.1e6 * FORGET * 0.99)
    assert link.rate_Bps == pytest.approx(12.1e6 * FORGET * 0.99)
    link.probed(link.rate_Bps * FORGET * 1.01)
    assert link.rate_Bps is None  # more than FORGET times it: the limit is gone


def test_the_links_to_probe_are_the_worker_pairs_the_schedule_sends_between() -> None:
    assert probe_links(build_schedule("1f1b", stages=3, microbatches=4)) == [(0, 1), (1, 2)]
    looped = build_schedule("interleaved", stages=3, microbatches=6, chunks=2)
    assert probe_links(looped) == [(0, 1), (0, 2), (1, 2)]  # chunk 0 of 2 feeds chunk 1 of 0


class _Transport:
    """A worker's side of the transport as the probe sees it: a remembered rate per
    destination and an injected throttle on this worker's sends."""

    wire = torch.device("cpu")
    measures_links = True

    def __init__(self, limits: dict[int, float], throttle_Bps: float | None) -> None:
        self.capacity = {dst: LinkCapacity() for dst in limits}
        for dst, rate in limits.items():
            self.capacity[dst].rate_Bps = rate
        self.throttle_Bps = throttle_Bps

    def throttled(self, nbytes: int) -> None:
        if self.throttle_Bps is not None:
            time.sleep(nbytes / self.throttle_Bps)

    def probe_bytes(self, dst: int) -> int:
        link = self.capacity.get(dst)
        return link.probe_bytes(saturated=False) if link is not None else 0

    def probed(self, dst: int, nbytes: int, seconds: float) -> tuple[float | None, float | None]:
        link = self.capacity[dst]
        before = link.rate_Bps
        link.probed(nbytes / seconds)
        return before, link.rate_Bps


# worker -> (its remembered limits by destination, its sends' throttle now)
SETUP: dict[int, tuple[dict[int, float], float | None]] = {
    0: ({1: LIMIT}, None),  # throttle over: the first probe forgets the limit
    1: ({}, None),  # nothing remembered: answers, never asks
    2: ({1: LIMIT}, LIMIT / 3),  # tighter now: kept, and probed again
}


def _worker(rank: int, port: int, start: Any, out: Any) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=3,
            timeout=datetime.timedelta(seconds=30),
        )
        limits, throttle = SETUP[rank]
        transport = _Transport(limits, throttle)
        events: list[dict[str, Any]] = []
        probe = LinkProbe(rank, [(0, 1), (1, 2)], transport, every=2, log=events.append)
        start.wait()
        for iteration in range(7):  # the first boundary is 0: probes at 2, 4 and 6
            probe.before_boundary(iteration)
        dist.barrier()
        left = {dst: link.rate_Bps for dst, link in transport.capacity.items()}
        out.put((rank, {"events": events, "left": left}))
    except BaseException as exc:  # report, never hang the parent
        out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_three_workers_probe_their_remembered_links_until_the_probe_settles_them() -> None:
    port = free_port()
    got = run_children(_worker, [(port,)] * 3, timeout_s=120, what="link probe")
    over, quiet, tight = (got[r]["events"] for r in range(3))
    # the throttle is over: one probe reads far above the limit, which is forgotten,
    # and nothing is probed after it
    assert [(e["iteration"], e["dst"]) for e in over] == [(2, 1)]
    assert over[0]["rate_Bps"] > FORGET * LIMIT and over[0]["limit_after_Bps"] is None
    assert got[0]["left"] == {1: None}
    assert quiet == []  # it only answered
    # tighter: each probe reads it (below the limit, which stays) and the next one comes
    assert [(e["iteration"], e["dst"]) for e in tight] == [(2, 1), (4, 1), (6, 1)]
    for e in tight:  # timed from the receiver's word: the throttle's hold is all in it
        assert e["seconds"] >= e["bytes"] / (LIMIT / 3) and e["rate_Bps"] <= LIMIT / 3
        assert e["limit_before_Bps"] == e["limit_after_Bps"] == LIMIT
    assert got[2]["left"] == {1: LIMIT}


def test_no_probe_without_link_telemetry_or_with_it_switched_off() -> None:
    schedule = build_schedule("1f1b", stages=2, microbatches=2)
    quiet = _Transport({}, None)
    quiet.measures_links = False
    on = TrainSection(iterations=10, link_probe_every=10)
    assert probe_hook(on, schedule, quiet, print) == []  # the links are not measured
    off = TrainSection(iterations=10, link_probe_every=0)
    assert probe_hook(off, schedule, _Transport({}, None), print) == []
