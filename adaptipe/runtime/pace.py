"""How the manager's loop waits between its passes (`adaptipe.runtime.launch._follow`).

Each pass reads the stages' metrics files, the decision loop's control files and the
telemetry that came in: its CPU is most of what monitoring and control cost the manager
(`bench/bench_overhead.py`, docs/benchmarks.md), so the loop waits as long as it can and
wakes on the event it waits for rather than on a fast timer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from adaptipe.monitor.collector import Collector
from adaptipe.runtime.adapt_loop import AdaptLoop

__all__ = ["ADAPT_POLL_S", "Pace"]

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
    it blocks on the collector's socket instead, up to ``poll_s``, until every stage's
    StageStats of that iteration is in: a stage publishes them right after it logs the
    iteration, so the last of those frames comes with the line the check waits for, and
    no decision is an iteration late. While a controller call runs
    (`AdaptLoop.deciding`), it sleeps until the answer comes, at most `ADAPT_POLL_S`;
    the telemetry that comes meanwhile waits for the next pass (until session 26 it
    woke for every frame then, which cost CPU at every check).

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
        else:
            deadline = time.monotonic() + self.poll_s
            while (left := deadline - time.monotonic()) > 0:
                if not collector.pump(max(1, int(left * 1000))) or self._reported(collector):
                    return

    def _reported(self, collector: Collector) -> bool:
        """Every stage has sent its StageStats of the iteration the next merge brings."""
        for stage in range(self.stages):
            got = collector.latest(stage)
            if got is None or got.iteration < self.next_iteration:
                return False
        return True
