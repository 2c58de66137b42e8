"""Measuring processes: the link probe (fit and a real gloo link), the child runner and
the co-running profiler."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import statistics
from collections.abc import Callable
from typing import Any

import pytest

from adaptipe.errors import PlanError
from adaptipe.profile.children import run_children
from adaptipe.profile.corun import profile_co_running
from adaptipe.profile.link import probe, probe_link


class _FakeLink:
    """A link with a known one-way ``latency + n / bandwidth``, on a fake clock; every
    ``slow_every``-th round trip is delayed by ``extra`` seconds (interference)."""

    def __init__(
        self, latency: float, bandwidth: float, *, slow_every: int = 0, extra: float = 0.0
    ) -> None:
        self.now = 0.0
        self.latency, self.bandwidth = latency, bandwidth
        self.slow_every, self.extra = slow_every, extra
        self.trips = 0

    def clock(self) -> float:
        return self.now

    def send(self, payload: bytes) -> None:
        self.trips += 1
        self.now += 2 * (self.latency + len(payload) / self.bandwidth)
        if self.slow_every and self.trips % self.slow_every == 0:
            self.now += self.extra

    def recv(self) -> None:
        pass


@pytest.mark.parametrize("reduce", [min, statistics.median])
def test_probe_recovers_latency_and_bandwidth_despite_outliers(
    reduce: Callable[[list[float]], float],
) -> None:
    link = _FakeLink(200e-6, 2e9, slow_every=5, extra=0.01)  # 1 in 5 trips 10 ms late
    result = probe(
        link.send,
        link.recv,
        (1 << 10, 1 << 16, 1 << 20),
        repeats=5,
        clock=link.clock,
        reduce=reduce,
    )
    assert result.latency_s == pytest.approx(200e-6, rel=1e-6)
    assert result.bandwidth_Bps == pytest.approx(2e9, rel=1e-6)
    assert result.rtt_s[0] == pytest.approx(2 * (200e-6 + 1024 / 2e9))


def test_median_reports_a_typical_trip_where_min_reports_the_fastest() -> None:
    sizes = (1 << 10, 1 << 20)
    clean = _FakeLink(100e-6, 1e9)
    fastest = probe(clean.send, clean.recv, sizes, repeats=3, clock=clean.clock)
    # Two of three trips 1 ms late: the median sees them, the minimum does not.
    mixed = _FakeLink(100e-6, 1e9, slow_every=0)
    calls = {"n": 0}

    def send(payload: bytes) -> None:
        calls["n"] += 1
        mixed.send(payload)
        if calls["n"] % 3:
            mixed.now += 1e-3

    typical = probe(send, mixed.recv, sizes, repeats=3, clock=mixed.clock, reduce=statistics.median)
    assert typical.latency_s == pytest.approx(fastest.latency_s + 0.5e-3, rel=1e-6)


def test_probe_link_measures_a_real_gloo_link_and_leaves_no_process() -> None:
    result = probe_link(sizes=(4096, 262144), repeats=5, warmup=1, timeout_s=60.0)
    assert result.sizes == (4096, 262144)
    assert all(0 < t < 1.0 for t in result.rtt_s)
    assert result.latency_s >= 0.0
    assert result.bandwidth_Bps > 0 and math.isfinite(result.bandwidth_Bps)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "mpi"}, "backend must be gloo or nccl"),
        ({"sizes": (4096, 4096)}, "distinct multiples of 4"),
        ({"sizes": (6,)}, "distinct multiples of 4"),
        ({"repeats": 0}, "repeats >= 1"),
    ],
)
def test_probe_link_refuses_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        probe_link(**kwargs)  # type: ignore[arg-type]


def test_link_command_prints_the_fit(capsys: pytest.CaptureFixture[str]) -> None:
    from adaptipe.cli import main

    assert main(["link", "--repeats", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "gloo" and len(out["rtt_s"]) == len(out["sizes"]) == 3
    assert out["latency_s"] >= 0 and out["bandwidth_Bps"] > 0


def _fails(rank: int, start: Any, out: Any) -> None:
    start.wait()
    out.put((rank, "RuntimeError: no device") if rank == 1 else (rank, 42))


def _dies(rank: int, start: Any, out: Any) -> None:
    if rank == 0:
        os._exit(3)
    start.wait()  # never released: its sibling is dead


def test_children_report_a_failure_or_a_death_and_leave_no_process() -> None:
    with pytest.raises(PlanError, match="demo: process 1 failed: RuntimeError: no device"):
        run_children(_fails, [(), ()], timeout_s=60, what="demo")
    with pytest.raises(PlanError, match=r"demo: process 0 died \(exit code 3\)"):
        run_children(_dies, [(), ()], timeout_s=60, what="demo")
    assert not multiprocessing.active_children()


def test_co_running_profile_is_the_mean_of_its_profilers() -> None:
    prof = profile_co_running(
        "mlp",
        {"in_features": 8, "hidden": 16, "depth": 3, "out_features": 4, "num_samples": 64},
        processes=2,
        microbatch=4,
        repeats=2,
        warmup=0,
    )
    assert prof.num_layers == 3 and prof.meta["co_running_processes"] == 2
    assert prof.threads == 1 and all(lp.forward_s > 0 and lp.backward_s > 0 for lp in prof.layers)
    assert not multiprocessing.active_children()
    with pytest.raises(PlanError, match="microbatch is required"):
        profile_co_running("mlp", processes=2)
