"""Link bandwidth from the transport's own transfers, plus an optional active probe.

AutoPipe and DynPipe both plan with per-link bandwidth, and on a shared cluster it
drifts. Measuring the activations and gradients the pipeline sends anyway costs
nothing extra; the probe is for start-up, before any transfer has happened.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from adaptipe.monitor.schema import LinkSample, MonitorError

__all__ = ["LinkMeter", "ProbeResult", "probe"]


class LinkMeter:
    """Smoothed bandwidth of one link (``src`` -> ``dst``) from recorded transfers.

    Bytes and seconds are smoothed separately and divided, rather than smoothing each
    transfer's rate: a tiny message's rate is mostly latency and would drag an average
    of rates far below what large activations see. ``alpha`` weighs the newest transfer.
    """

    def __init__(self, src: int, dst: int, *, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise MonitorError(f"LinkMeter alpha must be in (0, 1] (got {alpha})")
        self.src, self.dst, self.alpha = src, dst, alpha
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.transfers = 0
        self._bytes = 0.0
        self._seconds = 0.0

    def record(self, nbytes: int, seconds: float) -> float:
        """Add one transfer; returns the smoothed bandwidth in bytes/s."""
        if nbytes < 0 or not (math.isfinite(seconds) and seconds >= 0):
            raise MonitorError(
                f"LinkMeter.record needs bytes >= 0 and finite seconds >= 0 "
                f"(got {nbytes}, {seconds})"
            )
        self.total_bytes += nbytes
        self.total_seconds += seconds
        self.transfers += 1
        if seconds > 0:  # a zero duration is below clock resolution: count, do not smooth
            if self._seconds == 0.0:
                self._bytes, self._seconds = float(nbytes), seconds
            else:
                a = self.alpha
                self._bytes = a * nbytes + (1 - a) * self._bytes
                self._seconds = a * seconds + (1 - a) * self._seconds
        return self.bandwidth_Bps

    @property
    def bandwidth_Bps(self) -> float:
        """Smoothed bytes/s (0 before the first timed transfer)."""
        return self._bytes / self._seconds if self._seconds > 0 else 0.0

    @property
    def mean_Bps(self) -> float:
        """All bytes over all seconds since the meter started."""
        return self.total_bytes / self.total_seconds if self.total_seconds > 0 else 0.0

    def sample(self, nbytes: int, seconds: float) -> LinkSample:
        """A telemetry record for the last transfer, carrying the smoothed bandwidth."""
        return LinkSample(
            src=self.src,
            dst=self.dst,
            time_s=time.time(),
            nbytes=nbytes,
            seconds=seconds,
            bandwidth_Bps=self.bandwidth_Bps,
        )


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Round trips per size and the one-way ``latency + size / bandwidth`` fit."""

    sizes: tuple[int, ...]
    rtt_s: tuple[float, ...]  # the fastest of the repeats, per size
    latency_s: float
    bandwidth_Bps: float


def probe(
    send_fn: Callable[[bytes], None],
    recv_fn: Callable[[], object],
    sizes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20),
    *,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> ProbeResult:
    """Time echo round trips of each size and fit latency and bandwidth.

    ``send_fn(payload)`` sends the payload to the peer, which echoes it back;
    ``recv_fn()`` returns when the echo has arrived. Each round trip moves the payload
    twice, so one-way time is half the round trip; the fastest repeat per size is used
    because interference only ever adds time. With one size the latency is taken as 0.
    """
    if not sizes or min(sizes) < 1 or repeats < 1:
        raise MonitorError(f"probe needs sizes >= 1 and repeats >= 1 (got {sizes}, {repeats})")
    rtts: list[float] = []
    for size in sizes:
        payload = bytes(size)
        best = math.inf
        for _ in range(repeats):
            t0 = clock()
            send_fn(payload)
            recv_fn()
            best = min(best, clock() - t0)
        rtts.append(best)
    one_way = [r / 2 for r in rtts]
    if len(set(sizes)) > 1:
        slope, latency = statistics.linear_regression([float(s) for s in sizes], one_way)
    else:
        slope, latency = one_way[0] / sizes[0], 0.0
    if slope <= 0:  # noise swamped the size dependence: report the best observed rate
        slope = min(t / s for s, t in zip(sizes, one_way, strict=True))
    return ProbeResult(
        tuple(sizes), tuple(rtts), max(latency, 0.0), 1.0 / slope if slope > 0 else math.inf
    )
