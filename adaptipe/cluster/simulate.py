"""Replay a job trace on a simulated cluster under a policy and the round-based mechanism.

Time advances in rounds of ``round_s`` seconds. At each round's start the jobs that
have arrived and not finished are the active set; when it changes (an arrival, a
completion) the policy computes a new allocation for it (with the steps each job has
left and, for SLOs, the seconds left). The mechanism places jobs for the round; a placed
job runs ``T[m, j] * round_s`` steps, finishing part-way through when fewer are left
(its workers are then idle for the rest of the round, as in Gavel's simulator). Cost is
the price of the workers a job holds for the time it runs.

Reported: every job's completion time (from arrival), their mean, the makespan (last
completion), the total cost, the SLO violations and the share of rounds each job got on
each type against its allocation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adaptipe.cluster.mechanism import RoundRobinState, place_round
from adaptipe.cluster.policies import Policy, allocate
from adaptipe.cluster.spec import Cluster, ClusterJob, throughput_matrix
from adaptipe.errors import PlanError

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    policy: str
    aware: bool
    completion_s: dict[str, float]
    makespan_s: float
    cost: float
    slo_violations: int
    rounds: int
    allocations: int
    solve_s: float
    unfinished: list[str] = field(default_factory=list)

    @property
    def mean_jct_s(self) -> float:
        values = list(self.completion_s.values())
        return float(np.mean(values)) if values else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "aware": self.aware,
            "mean_jct_s": self.mean_jct_s,
            "makespan_s": self.makespan_s,
            "cost": self.cost,
            "slo_violations": self.slo_violations,
            "rounds": self.rounds,
            "allocations": self.allocations,
            "solve_s": self.solve_s,
            "unfinished": list(self.unfinished),
            "completion_s": dict(self.completion_s),
        }


def simulate(
    jobs: Sequence[ClusterJob],
    cluster: Cluster,
    *,
    policy: Policy,
    aware: bool = True,
    round_s: float = 360.0,
    max_rounds: int = 100_000,
) -> SimResult:
    """Run ``jobs`` (sorted by arrival) to completion; see the module doc."""
    import time

    if round_s <= 0:
        raise PlanError(f"round_s must be > 0 (got {round_s})")
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise PlanError("job names must be distinct")
    order = sorted(jobs, key=lambda job: (job.arrival_s, job.name))
    tput = {job.name: throughput_matrix([job], cluster)[0] for job in order}
    left = {job.name: float(job.steps) for job in order}
    done: dict[str, float] = {}
    prices = np.array(cluster.prices or [0.0] * len(cluster.types), dtype=np.float64)
    state = RoundRobinState()
    now, cost, rounds, allocations, solve_s = 0.0, 0.0, 0, 0, 0.0
    active_names: tuple[str, ...] = ()
    x = np.zeros((0, len(cluster.types)))
    while len(done) < len(order) and rounds < max_rounds:
        active = [j for j in order if j.arrival_s <= now and j.name not in done]
        if not active:
            now = max(now, min(j.arrival_s for j in order if j.name not in done))
            continue
        if tuple(j.name for j in active) != active_names:
            active_names = tuple(j.name for j in active)
            start = time.perf_counter()
            x = allocate(
                active, cluster, policy=policy, aware=aware,
                remaining=[left[j.name] for j in active],
                slo_left_s=[None if j.slo_s is None else j.arrival_s + j.slo_s - now for j in active],
            ).x  # fmt: skip
            solve_s += time.perf_counter() - start
            allocations += 1
        placed = place_round(
            x,
            state.row(active_names, len(cluster.types)),
            [j.scale for j in active],
            list(cluster.workers),
        )
        for job, k in zip(active, placed, strict=True):
            if k is None:
                continue
            state.add(job.name, k)
            rate = tput[job.name][k]
            ran = min(round_s, left[job.name] / rate)
            left[job.name] -= rate * ran
            cost += prices[k] * job.scale * ran / 3600.0
            if left[job.name] <= 1e-9 * job.steps:
                done[job.name] = now + ran
                state.forget(job.name)
        now += round_s
        rounds += 1
    completion = {j.name: done[j.name] - j.arrival_s for j in order if j.name in done}
    violations = sum(
        1 for j in order if j.slo_s is not None and completion.get(j.name, np.inf) > j.slo_s
    )
    return SimResult(
        policy=policy,
        aware=aware,
        completion_s=completion,
        makespan_s=max(done.values(), default=0.0),
        cost=cost,
        slo_violations=violations,
        rounds=rounds,
        allocations=allocations,
        solve_s=solve_s,
        unfinished=[j.name for j in order if j.name not in done],
    )
