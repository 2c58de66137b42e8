"""A sending stage's links: a `LinkWatcher` per peer, and what each link reports an
iteration (`adaptipe.monitor.bandwidth` for how a link's bandwidth is read, and
`adaptipe.monitor.capacity` for the rate it remembers and what a probe tells it)."""

from __future__ import annotations

import time
from collections.abc import Callable

from adaptipe.monitor.bandwidth import LinkWatcher, Ready, SendWork, link_bandwidth, saturated
from adaptipe.monitor.capacity import LinkCapacity
from adaptipe.monitor.schema import LinkSample

__all__ = ["LinkTimer"]


class LinkTimer:
    """A sender's links: a :class:`LinkWatcher` per peer.

    Watchers start on a link's first send. The transport calls :meth:`submit` for each
    send (and :meth:`drain` before an iteration ends, when the watchers do the waiting);
    the worker publishes :meth:`samples` once per iteration.

    Args:
        src: the sending rank.
        poll_s: see :class:`LinkWatcher`.
        clock: the clock sends' start times come from.
    """

    def __init__(
        self,
        src: int,
        *,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.src, self.poll_s = src, poll_s
        self._clock = clock
        self._watchers: dict[int, LinkWatcher] = {}
        self._reported: dict[int, float] = {}
        self._saturated: dict[int, bool] = {}  # per link, in the last iteration it sent
        self._capacity: dict[int, LinkCapacity] = {}  # per link: its rate as a bottleneck
        self._taken = clock()  # when samples were last taken: an iteration's span

    def submit(
        self,
        dst: int,
        work: SendWork,
        start_s: float,
        nbytes: int,
        keep: object = None,
        ready: Ready | None = None,
    ) -> None:
        """Time a send to ``dst`` (see :meth:`LinkWatcher.submit`)."""
        watcher = self._watchers.get(dst)
        if watcher is None:
            watcher = LinkWatcher(self.src, dst, poll_s=self.poll_s, clock=self._clock)
            self._watchers[dst] = watcher
        watcher.submit(work, start_s, nbytes, keep, ready)

    def drain(self) -> None:
        """Wait until every send submitted so far is timed (and so complete)."""
        for watcher in self._watchers.values():
            watcher.drain()

    def samples(self) -> list[LinkSample]:
        """One record per link that moved bytes since the last call, by destination.

        Each carries those bytes, the link's busy seconds over them and its bandwidth
        (`link_bandwidth` of the two, the time since the last call and the fast end of
        the link's recent sends; at most its rate as a bottleneck, `LinkCapacity`).
        """
        now = self._clock()
        span_s, self._taken = now - self._taken, now
        out: list[LinkSample] = []
        for dst in sorted(self._watchers):
            watcher = self._watchers[dst]
            nbytes, busy_s = watcher.take()
            if nbytes == 0:
                continue
            before = self._saturated.get(dst, False)
            bandwidth = link_bandwidth(nbytes, busy_s, span_s, watcher.bandwidth_Bps, before=before)
            now_saturated = saturated(busy_s, span_s)
            bandwidth = self._capacity.setdefault(dst, LinkCapacity()).bound(
                bandwidth, nbytes=nbytes, span_s=span_s, bottleneck=before and now_saturated
            )
            self._saturated[dst] = now_saturated
            self._reported[dst] = bandwidth
            out.append(
                LinkSample(
                    src=self.src,
                    dst=dst,
                    time_s=time.time(),
                    nbytes=nbytes,
                    seconds=busy_s,
                    bandwidth_Bps=bandwidth,
                )
            )
        return out

    def bandwidth_Bps(self, dst: int) -> float:
        """The link to ``dst``'s last reported bandwidth (0 before it was measured)."""
        return self._reported.get(dst, 0.0)

    def probe_bytes(self, dst: int) -> int:
        """How large a probe of the link to ``dst`` to send now; 0: none is needed
        (`LinkCapacity.probe_bytes`)."""
        capacity = self._capacity.get(dst)
        if capacity is None:
            return 0
        return capacity.probe_bytes(saturated=self._saturated.get(dst, False))

    def probed(self, dst: int, nbytes: int, seconds: float) -> tuple[float | None, float | None]:
        """A probe of the link to ``dst`` carried ``nbytes`` in ``seconds``: its rate goes
        to the link's remembered rate (`LinkCapacity.probed`). Returns that rate before
        and after (None: none remembered)."""
        capacity = self._capacity.setdefault(dst, LinkCapacity())
        before = capacity.rate_Bps
        if seconds > 0:
            capacity.probed(nbytes / seconds)
        return before, capacity.rate_Bps

    def close(self, timeout_s: float = 1.0) -> bool:
        """Stop every watcher; False if one is still inside a ``wait()``."""
        return all([w.close(timeout_s) for w in self._watchers.values()])
