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
link that has never been the bottleneck reports as before. The price: while a cut
carries less than the remembered rate, the end of a throttle does not show (nothing
that passes tells it), so a controller stays on the cut it moved to.
"""

from __future__ import annotations

__all__ = ["RAISE", "LinkCapacity"]

RAISE = 1.2


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
