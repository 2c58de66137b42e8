"""What a link was last seen to carry at most: a shaped link's rate, which light traffic
does not show.

A link that is not the bottleneck reports the fast end of its recent sends
(`adaptipe.monitor.bandwidth`). On a link shaped by a token bucket that is the line
rate: a send that fits in the bucket crosses at once. After a throttled link moved a
partition to a cut that carries little (bench_adaptive's CNN at cut 5: 64 KB an
iteration over 20 Mbit/s), the link read 90-160 MB/s, and a planner that believed it
moved the big activations back onto the throttled link and off again every cooldown.

`LinkCapacity` keeps the rate a link carried while it was the bottleneck (saturated two
iterations in a row) and reports no more than that for it until the link carries more
than ``RAISE`` times that rate over a whole iteration, which shows the rate rose. A
link that has never been the bottleneck reports as before. While a cut carries less
than the remembered rate, nothing that passes shows the end of a throttle: a probe
does (`adaptipe.runtime.link_probe`: a payload timed to its receiver's reply, sized to
the remembered rate). `probe_bytes` says when one is worth sending and how large;
`probed` takes its rate in: more than ``FORGET`` times the remembered rate forgets it;
more than the remembered rate raises it to the probe's; anything less leaves it (a probe
that waited behind the link's queued sends reads low: 1.84 against 2.47 MB/s once on the
bed, and had that lowered the limit, the next probe's 2.47 would have lifted it while
the throttle was still on). ``FORGET`` is not ``RAISE``: the rate a bottleneck was
remembered at is a reading too, and on the bed's 20 Mbit/s throttle (2.5 MB/s) runs
remembered it at 2.14-3.0 MB/s; a probe reads within a few percent of the rate, so 2.58
against 2.14 (1.21x) once forgot a throttle that was still on, and a controller moved
its layers back onto it (session 24). Its end reads 25-60x; 1.5x leaves room for both.
"""

from __future__ import annotations

__all__ = ["FORGET", "PROBE_S", "RAISE", "LinkCapacity"]

RAISE = 1.2
FORGET = 1.5
# A probe's payload takes about this long at the remembered rate: long enough that its
# overheads (a round trip, thread wake-ups: 0.3-1 ms on the bed) leave the rate read within
# a few percent (2.43 against 2.39 MB/s), short enough to cost little (at 20 ms, probing
# every 10 iterations cost the bed's throttled runs 6-8% of their throughput).
PROBE_S = 0.01
_PROBE_BYTES = (16 << 10, 4 << 20)  # beyond a token bucket's 1 ms burst, and a cap


class LinkCapacity:
    """One link's remembered rate (see the module doc)."""

    def __init__(self) -> None:
        self.rate_Bps: float | None = None

    def bound(self, reported_Bps: float, *, nbytes: int, span_s: float, bottleneck: bool) -> float:
        """What the link reports for an iteration of ``span_s`` that carried ``nbytes``:
        ``reported_Bps`` (`adaptipe.monitor.bandwidth.link_bandwidth`), remembered as the
        rate where the link was the ``bottleneck``, else at most the remembered rate."""
        if bottleneck:
            self.rate_Bps = reported_Bps
            return reported_Bps
        rate = self.rate_Bps
        if rate is not None and span_s > 0 and nbytes / span_s > RAISE * rate:
            self.rate_Bps = rate = None  # it carried more: the rate rose
        return reported_Bps if rate is None else min(reported_Bps, rate)

    def probe_bytes(self, *, saturated: bool) -> int:
        """How large a probe to send now (0: none): only where a remembered rate bounds
        what the link reports and its traffic is too light to show more (not
        ``saturated``); about ``PROBE_S`` of payload at that rate."""
        if self.rate_Bps is None or saturated:
            return 0
        low, high = _PROBE_BYTES
        return int(min(max(self.rate_Bps * PROBE_S, low), high))

    def probed(self, rate_Bps: float) -> None:
        """A probe's rate: above ``FORGET`` times the remembered rate the limit is gone
        (forgotten); above the remembered rate it is the limit now; below, the limit
        stays (see the module doc)."""
        if self.rate_Bps is None:
            return
        if rate_Bps > FORGET * self.rate_Bps:
            self.rate_Bps = None
        elif rate_Bps > self.rate_Bps:
            self.rate_Bps = rate_Bps
