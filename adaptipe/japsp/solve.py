"""One entry point for every JAPSP solver and its `Result` (``adaptipe japsp`` runs it).

``auto`` follows the paper's practice (§V-B: B&B up to a job-array size threshold, the
GA beyond): branch-and-bound when ``J * S <= auto_threshold``, else the GA; either way
the result carries a lower bound and the remaining gap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.japsp.evaluate import Orders
from adaptipe.japsp.instance import JapspInstance

__all__ = [
    "AUTO_THRESHOLD",
    "SOLVERS",
    "Result",
    "solve",
]

SOLVERS = ("bb", "ga", "auto", "gpipe", "1f1b", "rr", "cpsat")
AUTO_THRESHOLD = 16
"""``J * S`` up to which ``auto`` runs B&B. Measured (bench/bench_japsp.py, generated
instances, 10 seeds each): B&B proves every 4x4, 5x4 and 6x4 instance in under a second
when jobs of one batch size have identical times (the paper's workload), but with 2%
per-job jitter a 6x4 instance can take ~8 s of CPU and 5x4 up to ~3 s under load; beyond
16 the GA, within about 1% of the optimum there in well under a second, is the safer
default (``auto_threshold`` raises it)."""
_DEFAULT_LIMIT = {"bb": 10.0, "cpsat": 10.0}  # the GA's default work grows with J x S


@dataclass(frozen=True, slots=True)
class Result:
    """A solver's answer: per-stage orders and what is known about their quality.

    ``gap`` is ``(makespan - lower_bound) / makespan``; ``optimal`` is True only when the
    solver proved it (B&B finished, CP-SAT proved, or the makespan meets the bound).
    ``nodes`` counts B&B nodes, GA work (blocks visited, `adaptipe.japsp.budget`) or
    CP-SAT branches. ``stopped_by`` says what ended the search, and so whether a rerun
    gives the same schedule: ``"search"`` (B&B searched everything, CP-SAT finished),
    ``"bound"`` (the makespan met the lower bound), ``"work"`` or ``"generations"`` (the
    GA's budget: reproducible for its seed), ``"clock"`` (the time limit: a rerun may
    differ), or ``""`` (a baseline: no search).
    """

    solver: str
    orders: Orders
    makespan: float
    lower_bound: float
    optimal: bool
    seconds: float
    nodes: int = 0
    stopped_by: str = ""

    @property
    def gap(self) -> float:
        if self.makespan <= 0:
            return 0.0
        return max(0.0, (self.makespan - self.lower_bound) / self.makespan)

    def to_json(self) -> dict[str, Any]:
        return {
            "solver": self.solver,
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "optimal": self.optimal,
            "gap": self.gap,
            "seconds": self.seconds,
            "nodes": self.nodes,
            "stopped_by": self.stopped_by,
            "orders": [[f"{k}{j}" for k, j in stage] for stage in self.orders],
        }


def solve(
    inst: JapspInstance,
    *,
    solver: str = "auto",
    time_limit_s: float | None = None,
    seed: int = 0,
    auto_threshold: int = AUTO_THRESHOLD,
) -> Result:
    """Solve ``inst`` with ``solver`` (one of `SOLVERS`).

    ``time_limit_s`` defaults to 10 s for ``bb`` and ``cpsat``; without it ``ga`` runs on
    work that grows with jobs x stages (`adaptipe.japsp.budget.default_work`: 10,000
    units per job x stage, 1 to 10 million, about 1-3 s here), with it on one million
    units a second. The baselines ignore it and report the best lower bound next to
    their makespan.
    ``auto`` runs B&B when ``J * S <= auto_threshold`` and the GA otherwise.
    """
    if solver not in SOLVERS:
        raise PlanError(f"solver must be one of {', '.join(SOLVERS)} (got {solver!r})")
    if time_limit_s is not None and not time_limit_s > 0:
        raise PlanError(f"time limit must be > 0 seconds (got {time_limit_s})")
    if solver == "auto":
        solver = "bb" if inst.num_jobs * inst.num_stages <= auto_threshold else "ga"
    limit = time_limit_s if time_limit_s is not None else _DEFAULT_LIMIT.get(solver, 0.0)
    if solver == "ga":
        from adaptipe.japsp.genetic import solve_ga

        return solve_ga(inst, time_limit_s=time_limit_s, seed=seed)
    if solver == "bb":
        from adaptipe.japsp.bnb import solve_bnb

        return solve_bnb(inst, time_limit_s=limit, seed=seed)
    if solver == "cpsat":
        from adaptipe.japsp.cpsat import solve_cpsat

        return solve_cpsat(inst, time_limit_s=limit, seed=seed)
    from adaptipe.japsp.baselines import BASELINES
    from adaptipe.japsp.bounds import lower_bound

    t0 = time.perf_counter()
    timeline = BASELINES[solver](inst)
    lb = lower_bound(inst)
    return Result(
        solver=solver,
        orders=timeline.orders,
        makespan=timeline.makespan,
        lower_bound=lb,
        optimal=timeline.makespan <= lb + 1e-9,
        seconds=time.perf_counter() - t0,
    )
