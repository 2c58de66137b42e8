"""How the manager's loop waits between its passes (`adaptipe.runtime.launch._follow`).

Each pass reads the stages' metrics files, the decision loop's control files and the
telemetry that came in: its CPU is most of what monitoring and control cost the manager
(`bench/bench_overhead.py`, docs/benchmarks.md), so the loop waits as long as it can and
wakes on the event it waits for rather than on a fast timer.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

from adaptipe.monitor.collector import Collector
from adaptipe.runtime.adapt_loop import AdaptLoop

__all__ = ["ADAPT_POLL_S", "Pace"]

_PERIODS = 6  # a stage's recent iteration-to-iteration times the period is the median of

ADAPT_POLL_S = 0.01
"""How long the manager waits for a controller call's answer at a time: in the poll
that started the call (`AdaptLoop.poll`'s ``answer_wait_s``), then each pass while it
runs (`bench/bench_overhead.py --adapt-poll-s` patches it here)."""


@dataclass(slots=True)
class Pace:
    """How the manager waits between passes of its loop (each pass costs CPU,
    `bench/bench_overhead.py`).

    Mostly it sleeps ``poll_s``, then takes in the telemetry that came meanwhile in one
    batch. While a controller check waits for the next merged iteration (`AdaptLoop.due`)
    it sleeps until that iteration should have ended (each stage's last StageStats plus
    its recent period) and an eighth of a period more, then takes in what came in one
    batch, looking again every eighth of a period until every stage's StageStats of
    that iteration is in (at most ``poll_s``): a stage publishes them right after it
    logs the iteration, so no decision is an iteration late. Until a stage's period is
    known it blocks on the collector's socket instead, waking for each frame: on the
    bed that cost stage 0, whose core the manager shares, 1.5-4 ms an iteration
    (session 26). While a controller call runs (`AdaptLoop.deciding`), it sleeps until
    the answer comes, at most `ADAPT_POLL_S`; the telemetry that comes meanwhile waits
    for the next pass (until session 26 it woke for every frame then, which cost CPU at
    every check).

    Until session 22 "a call runs" was "a call started since the loop was last not
    due", which never ended where a check is due every iteration (``check_every = 1``):
    the manager then polled every 10 ms all along, and a pass that merged an iteration
    from the stages' files before their telemetry of it came started the check on the
    iteration before (bench_adaptive: nearly every decision one iteration late).
    """

    poll_s: float
    stages: int
    next_iteration: int  # the iteration the next merge brings

    def wait(self, adapt: AdaptLoop | None, collector: Collector | None) -> None:
        if adapt is None or collector is None or not adapt.due:
            time.sleep(self.poll_s)
        elif adapt.deciding:
            adapt.await_answer(min(self.poll_s, ADAPT_POLL_S))
        elif (expected := self._expected(collector)) is None:
            deadline = time.monotonic() + self.poll_s
            while (left := deadline - time.monotonic()) > 0:
                if not collector.pump(max(1, int(left * 1000))) or self._reported(collector):
                    return
        else:
            self._await_expected(collector, *expected)

    def _expected(self, collector: Collector) -> tuple[float, float] | None:
        """(when the awaited iteration's StageStats should all be in, as a wall-clock
        time; the period): each stage's last one plus the median of its recent
        iteration-to-iteration times. None while a stage has not sent the iteration
        before the awaited one or too few (half of `_PERIODS`) to time, or when every
        stage has sent the awaited one."""
        ends, periods = [], []
        for stage in range(self.stages):
            got = collector.history(stage, last=_PERIODS + 1)
            if not got or got[-1].iteration < self.next_iteration - 1:
                return None
            if got[-1].iteration >= self.next_iteration:  # in already
                continue
            gaps = [
                b.time_s - a.time_s
                for a, b in itertools.pairwise(got)
                if b.iteration == a.iteration + 1
            ]
            if len(gaps) < _PERIODS // 2:
                return None
            periods.append(statistics.median(gaps))
            ends.append(got[-1].time_s + periods[-1])
        return (max(ends), max(periods)) if ends else None

    def _await_expected(self, collector: Collector, expected: float, period: float) -> None:
        """Sleep until an eighth of a period after the awaited iteration should be in,
        then take in what came in one batch; until it is, look again every eighth of a
        period (at most ``poll_s`` in all). A stage's frames come at its iteration
        boundary, from the core it runs on: waking for each of them there cost stage 0
        1.5-4 ms an iteration on the bed (docs/benchmarks.md, session 26). The stages'
        clocks are the manager's on one machine; off it, their offset moves the first
        look, not what is taken in."""
        deadline = time.monotonic() + self.poll_s
        step = max(period / 8, 0.001)
        wake = min(time.monotonic() + expected + step - time.time(), deadline)
        while True:
            if (ahead := wake - time.monotonic()) > 0:
                time.sleep(ahead)
            collector.pump()
            if self._reported(collector) or time.monotonic() >= deadline:
                return
            wake = min(time.monotonic() + step, deadline)

    def _reported(self, collector: Collector) -> bool:
        """Every stage has sent its StageStats of the iteration the next merge brings."""
        for stage in range(self.stages):
            got = collector.latest(stage)
            if got is None or got.iteration < self.next_iteration:
                return False
        return True
