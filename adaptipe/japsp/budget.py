"""How long a heuristic search may run: counted work first, the clock as a backstop.

A search that stops at a wall-clock deadline returns whatever it had reached when the
clock ran out, so the same seed gives different schedules from run to run and machine
to machine. `SearchBudget` counts *work* instead, in operation visits (a schedule
evaluation visits each of the ``J x 2S`` blocks once, a move estimate only the blocks
it reorders), and stops at a work limit; the deadline still applies and ends the search
early on a machine too slow for the work, which `SearchBudget.clock_hit` records, so a
result says whether it is reproducible.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

__all__ = [
    "DEFAULT_CLOCK_SLACK",
    "WORK_PER_JOB_STAGE",
    "WORK_PER_SECOND",
    "SearchBudget",
    "default_work",
]

WORK_PER_SECOND = 1_000_000
"""Work units one second of time limit buys. On the 2-core development machine the GA
does 1.3-2.5 million units a second (6x4 to 64x8 instances of ``bench/bench_japsp.py``,
another process beside it at times), so it spends its work in 40-80% of the time
limit: a machine a little slower, or busier, still ends on the work and gives the same
schedule; a much slower one ends on the clock and says so."""

WORK_PER_JOB_STAGE = 10_000
"""The GA's default work per job x stage (`default_work`). Each step of its search (a
decoding, a tabu move, a job move) visits a number of blocks that grows with the
``2JS`` blocks, so work in proportion to ``J x S`` buys about the same search on every
instance size. At 10,000, paper-style 30 x 10 and 30 x 16 arrays end within 0.25% of
what ten million units give on 14 of 16 instances (0.64% at most) and within 1% of
CP-SAT after 30 s (docs/benchmarks.md, "The GA's default work")."""

DEFAULT_CLOCK_SLACK = 3.0
"""Without a time limit, the GA's clock backstop is this many times the seconds its
`default_work` stands for (at `WORK_PER_SECOND`): 9 s for 30 x 10, which spends its
3 million units in about 1 s of CPU on the development machine, so a machine several
times slower or busier still ends on the work, with the same schedule."""

_DEFAULT_WORK_MIN = WORK_PER_SECOND
_DEFAULT_WORK_MAX = 10 * WORK_PER_SECOND


def default_work(jobs: int, stages: int) -> int:
    """The GA's work when neither a time limit nor a work budget is given:
    `WORK_PER_JOB_STAGE` per job x stage, at least one million (a second's worth, the
    old default, which small arrays need no more than) and at most ten million (so a
    very large array still solves in seconds: 2.5-3 s on the 2-core development machine).
    """
    return min(_DEFAULT_WORK_MAX, max(_DEFAULT_WORK_MIN, WORK_PER_JOB_STAGE * jobs * stages))


@dataclass(slots=True)
class SearchBudget:
    """Work spent against ``work_limit`` and the ``deadline`` (a `time.perf_counter`)."""

    deadline: float
    work_limit: float = math.inf
    work: int = 0
    clock_hit: bool = False

    @classmethod
    def for_limit(
        cls, time_limit_s: float, *, start: float, reserve_s: float = 0.0, work: int | None = None
    ) -> SearchBudget:
        """``work`` units (``time_limit_s`` worth unless given), and a deadline
        ``reserve_s`` before the time limit."""
        return cls(
            deadline=start + time_limit_s - reserve_s,
            work_limit=time_limit_s * WORK_PER_SECOND if work is None else work,
        )

    def spend(self, units: int) -> None:
        self.work += units

    def exhausted(self) -> bool:
        """True once the work is spent or the deadline has passed (``clock_hit`` then)."""
        if self.work >= self.work_limit:
            return True
        if time.perf_counter() > self.deadline:
            self.clock_hit = True
            return True
        return False
