"""Link bandwidth from the transport's own transfers, plus an optional active probe.

AutoPipe and DynPipe both plan with per-link bandwidth, and on a shared cluster it
drifts. Measuring the activations and gradients the pipeline sends anyway costs
nothing extra; the probe is for start-up, before any transfer has happened. Its fit is
the profiler's (`adaptipe.profile.link.probe`, which the layer profile's link
measurement needs too); :func:`probe` here only reports bad arguments as telemetry
errors.

A send is timed from the moment the stage posts it to the moment it completes. The
stage computes for tens of milliseconds between transport calls, so completion is not
observed at the next call but by a :class:`LinkWatcher` thread per peer: it blocks in
``work.wait()`` (gloo; the GIL is released) or polls ``work.is_completed()`` (NCCL, whose
``wait()`` only orders CUDA streams) and reads the clock when the send is done. Sends to
one peer complete in order, so a link's busy time is the *union* of its sends'
``[start, end]`` intervals (:class:`BusyTally`): back-to-back sends are not counted twice.

The bandwidth a link reports depends on how busy it was. A send's interval also holds
whatever delayed it besides the link: the receiver's late posting of its receive (gloo
sends rendezvous), and the I/O and watcher threads waiting for a core that the stages
fill. Those delays add time that does not scale with the bytes, so bytes over busy time
reads a fast link low (60-90 MB/s for 128 KB sends over loopback on the 2-core machine).
A link busy for at least half of the iteration (:data:`SATURATED`) two iterations in
a row is the bottleneck, and its bytes over busy time is what it carries; any other
reports the larger of that and the fast end of its recent sends (:class:`FastEnd`: the
few sends that escaped the delays; 230-600 MB/s on the same link). The fast end alone
would read a throttled link high: a send that fits in the socket's buffer completes at
once.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from adaptipe.monitor.schema import LinkSample, MonitorError
from adaptipe.monitor.threadname import name_os_thread
from adaptipe.profile import link as _link
from adaptipe.profile.link import ProbeResult

__all__ = [
    "SATURATED",
    "BusyTally",
    "FastEnd",
    "LinkMeter",
    "LinkWatcher",
    "ProbeResult",
    "Ready",
    "SendWork",
    "link_bandwidth",
    "probe",
    "saturated",
]


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


class BusyTally:
    """Bytes and busy time of one link; busy time is the union of its transfers' intervals.

    Transfers are added in the order they started (sends to one peer are FIFO), so the
    union needs only the latest end: a transfer adds the part of ``[start, end]`` after
    it. :meth:`take` resets the totals but not that end, so a transfer overlapping one
    taken earlier still adds only its new part.
    """

    __slots__ = ("_end", "_start", "busy_s", "nbytes", "transfers")

    def __init__(self) -> None:
        self.nbytes = 0
        self.busy_s = 0.0
        self.transfers = 0
        self._start = -math.inf
        self._end = -math.inf

    def add(self, start_s: float, end_s: float, nbytes: int) -> None:
        """Count one transfer that ran from ``start_s`` to ``end_s`` (one clock)."""
        if not start_s <= end_s or start_s < self._start or nbytes < 0:
            raise MonitorError(
                f"BusyTally.add needs start <= end, starts in order and bytes >= 0 (got "
                f"start {start_s}, end {end_s}, previous start {self._start}, bytes {nbytes})"
            )
        self._start = start_s
        if end_s > self._end:
            self.busy_s += end_s - max(start_s, self._end)
            self._end = end_s
        self.nbytes += nbytes
        self.transfers += 1

    def take(self) -> tuple[int, float]:
        """``(bytes, busy seconds)`` since the last call."""
        out = (self.nbytes, self.busy_s)
        self.nbytes, self.busy_s = 0, 0.0
        return out


SATURATED = 0.5  # a link busy this share of an iteration or more reports bytes / busy


class FastEnd:
    """A link's bandwidth from its last ``window`` sends: the rate (bytes over the send's
    own post-to-completion time) that a ``1 - quantile`` share of them beat, by nearest
    rank (the second fastest of 16 by default): a delay that hits most sends but not all
    of them (a busy core) does not lower it. Alone it would follow a link that slows
    down only once most of the window is slow (`link_bandwidth` does not wait for it)."""

    __slots__ = ("_rates", "quantile")

    def __init__(self, *, window: int = 16, quantile: float = 0.9) -> None:
        if window < 1 or not 0.0 < quantile <= 1.0:
            raise MonitorError(
                f"FastEnd needs window >= 1 and quantile in (0, 1] (got {window}, {quantile})"
            )
        self._rates: deque[float] = deque(maxlen=window)
        self.quantile = quantile

    def add(self, nbytes: int, seconds: float) -> None:
        """Count one send (sends too short for the clock, or empty, are left out)."""
        if nbytes > 0 and seconds > 0:
            self._rates.append(nbytes / seconds)

    @property
    def bandwidth_Bps(self) -> float:
        """Bytes a second (0 before a send was counted)."""
        if not self._rates:
            return 0.0
        ranked = sorted(self._rates)
        return ranked[math.ceil(self.quantile * len(ranked)) - 1]


def saturated(busy_s: float, span_s: float) -> bool:
    """Whether a link busy ``busy_s`` of an iteration of ``span_s`` was its bottleneck."""
    return span_s > 0 and busy_s >= SATURATED * span_s


def link_bandwidth(
    nbytes: int, busy_s: float, span_s: float, fast_Bps: float, *, before: bool = True
) -> float:
    """A link's bandwidth over an iteration of ``span_s`` in which it carried ``nbytes``
    in ``busy_s``: bytes over busy time where it was `saturated` in this iteration and
    (``before``) the one before, else the larger of that and ``fast_Bps`` (module doc).
    One saturated iteration alone is not believed: a stalled core makes one now and then
    on a fast link."""
    busy_Bps = nbytes / busy_s if busy_s > 0 else 0.0
    if before and saturated(busy_s, span_s):
        return busy_Bps
    return max(busy_Bps, fast_Bps)


class SendWork(Protocol):
    """What ``torch.distributed.isend`` returns, as far as timing it goes."""

    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


class Ready(Protocol):
    """A ``torch.cuda.Event``, as far as timing goes."""

    def query(self) -> bool: ...


_Item = tuple[SendWork, float, int, object, Ready | None]  # work, start, bytes, keep, ready


def _stay_out_of_the_way() -> None:
    """Let the calling thread run on any core and never preempt on waking (Linux only).

    A watcher wakes for every send. At normal priority on the stage's pinned core, each
    wake-up preempts the compute thread, which on a loaded machine then waits for a time
    slice to get its core back: on a shared 2-core machine that put ~15 ms a 100 ms
    iteration into ``send()``. A SCHED_BATCH thread never preempts on waking; unpinned,
    it runs at once on a core that is idle, and on a saturated machine by the next
    scheduler tick, so a completion may then be read a few milliseconds late.
    """
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: this thread
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps the cpuset's


class LinkWatcher:
    """Times one link's sends, from when they were posted to when they complete.

    A daemon thread takes the sends in the order they were posted and waits for each.
    With ``poll_s=None`` it blocks in ``work.wait()``: on gloo that releases the GIL and
    returns at completion, and it must then be the *only* caller of ``wait`` (gloo lets
    a send be waited for once), so the sender calls :meth:`drain` instead. Otherwise it
    polls ``work.is_completed()``, sleeping ``poll_s / 8`` doubling up to ``poll_s``
    between looks (NCCL, whose ``wait()`` only makes a CUDA stream wait).

    Args:
        src: the sending rank.
        dst: the receiving rank.
        poll_s: ``None`` to block in ``wait()``; else the longest sleep between polls.
        clock: the clock the sender read each send's start from.
    """

    def __init__(
        self,
        src: int,
        dst: int,
        *,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if poll_s is not None and not 0.0 < poll_s <= 0.1:
            raise MonitorError(f"LinkWatcher poll_s must be in (0, 0.1] or None (got {poll_s})")
        self.src, self.dst, self.poll_s = src, dst, poll_s
        self._clock = clock
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._tally = BusyTally()
        self._fast = FastEnd()
        self._submitted = 0  # written by the sender only
        self._done = 0  # written by the watcher only, under _cond
        self._error: BaseException | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"adaptipe-link-{src}-{dst}", daemon=True
        )
        self._thread.start()

    def submit(
        self,
        work: SendWork,
        start_s: float,
        nbytes: int,
        keep: object = None,
        ready: Ready | None = None,
    ) -> None:
        """Time ``work``, posted at ``start_s``; ``keep`` (its tensor) lives until it is done.

        ``ready`` (polling only): a CUDA event recorded when the send was posted. The
        device may still be computing what was queued before it, so the send starts no
        earlier than the event completes.
        """
        if self._closing.is_set():
            raise MonitorError(f"LinkWatcher {self.src}->{self.dst} is closed")
        self._submitted += 1
        self._queue.put((work, start_s, nbytes, keep, ready))

    def _run(self) -> None:
        name_os_thread(f"adaptipe-l{self.src}-{self.dst}")
        _stay_out_of_the_way()
        while (item := self._queue.get()) is not None:
            work, start_s, nbytes, ready = item[0], item[1], item[2], item[4]
            error: BaseException | None = None
            try:
                if not self._closing.is_set():  # after close, pending sends are let go
                    start_s = self._complete(work, start_s, ready)
                    end_s = self._clock()
                    with self._cond:
                        self._tally.add(start_s, end_s, nbytes)
                        self._fast.add(nbytes, end_s - start_s)
            except BaseException as exc:  # the sender re-raises it from drain()
                error = exc
            del item, work, ready  # release the tensor before waiting for the next send
            with self._cond:
                if error is not None and self._error is None:
                    self._error = error
                self._done += 1
                self._cond.notify_all()

    def _complete(self, work: SendWork, start_s: float, ready: Ready | None) -> float:
        """Return once ``work`` is done; the send's start, moved to ``ready``'s if later."""
        if self.poll_s is None:
            work.wait()
            return start_s
        if ready is not None and self._poll(ready.query):
            start_s = max(start_s, self._clock())
        self._poll(work.is_completed)
        return start_s

    def _poll(self, done: Callable[[], bool]) -> bool:
        """Poll ``done`` until it is true (True) or the watcher closes (False)."""
        sleep = (self.poll_s or 0.0) / 8
        while not done():
            if self._closing.is_set():
                return False
            time.sleep(sleep)
            sleep = min(2 * sleep, self.poll_s or 0.0)
        return True

    @property
    def pending(self) -> int:
        """Sends submitted but not yet timed."""
        with self._cond:
            return self._submitted - self._done

    def drain(self) -> None:
        """Block until every submitted send is timed; raise the first send's error."""
        with self._cond:
            while self._done < self._submitted and self._error is None:
                if not self._thread.is_alive():
                    raise MonitorError(f"LinkWatcher {self.src}->{self.dst} stopped unexpectedly")
                self._cond.wait(1.0)
            if self._error is not None:
                raise self._error

    def take(self) -> tuple[int, float]:
        """``(bytes, busy seconds)`` of the sends timed since the last call."""
        with self._cond:
            return self._tally.take()

    @property
    def bandwidth_Bps(self) -> float:
        """The fast end of the recent sends (:class:`FastEnd`; 0 before the first)."""
        with self._cond:
            return self._fast.bandwidth_Bps

    def close(self, timeout_s: float = 1.0) -> bool:
        """Stop the thread; False if it is still inside a ``wait()`` after ``timeout_s``.

        A thread still waiting is a daemon: it cannot keep the process alive.
        """
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def probe(
    send_fn: Callable[[bytes], None],
    recv_fn: Callable[[], object],
    sizes: Sequence[int] = _link.PROBE_SIZES,
    *,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    reduce: Callable[[list[float]], float] = min,
) -> ProbeResult:
    """Time echo round trips of each size and fit latency and bandwidth
    (`adaptipe.profile.link.probe`); bad arguments raise :class:`MonitorError`."""
    if not sizes or min(sizes) < 1 or repeats < 1:
        raise MonitorError(f"probe needs sizes >= 1 and repeats >= 1 (got {sizes}, {repeats})")
    return _link.probe(send_fn, recv_fn, sizes, repeats=repeats, clock=clock, reduce=reduce)
