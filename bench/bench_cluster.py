"""Gavel (issue 24): how fast a policy allocates, and how much the heterogeneity-aware
form gains over the agnostic one in simulation.

Part 1: the time to allocate ``--jobs`` (256) jobs on K80, P100 and V100 workers
(``--workers`` per type), per policy and form: the median of ``--repeats`` solves.
Target: under 1 s.

Part 2: ``adaptipe.cluster.simulate`` on generated traces (`adaptipe.cluster.trace`):
a static one (every job at time 0; the makespan policy's case) and a continuous one
(Poisson arrivals), each with SLOs. Per policy, its own objective in both forms and
the ratio agnostic / aware (above 1: aware is better): mean job completion time for
max_min_fairness and fifo, makespan for min_makespan, cost for min_cost. Gavel reports
up to 3.5x better average JCT, 2.5x makespan and 1.4x cost (seed 002, chapter 5).

    python bench/bench_cluster.py [--jobs 256] [--workers 36] [--sim-jobs 60]
        [--rate 4] [--sim-workers 4] [--seeds 3]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from adaptipe.cluster.policies import POLICIES, allocate
from adaptipe.cluster.simulate import simulate
from adaptipe.cluster.trace import generate

OBJECTIVE = {
    "max_min_fairness": "mean_jct_s",
    "fifo": "mean_jct_s",
    "min_makespan": "makespan_s",
    "min_cost": "cost",
}


def _solve_times(jobs: int, workers: int, repeats: int) -> dict[str, dict[str, float]]:
    trace = generate(
        jobs=jobs, rate_per_hour=None, workers_per_type=workers, multi_worker=True, slos=True
    )
    out: dict[str, dict[str, float]] = {}
    for policy in POLICIES:
        for aware in (True, False):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                allocate(trace.jobs, trace.cluster, policy=policy, aware=aware)
                times.append(time.perf_counter() - start)
            out.setdefault(policy, {})["aware_s" if aware else "agnostic_s"] = statistics.median(
                times
            )
    return out


def _simulations(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    for label, rate in (("static", None), ("continuous", args.rate)):
        rows: dict[str, list[float]] = {p: [] for p in POLICIES}
        detail = []
        for seed in range(args.seeds):
            trace = generate(
                jobs=args.sim_jobs, rate_per_hour=rate, workers_per_type=args.sim_workers,
                slos=True, seed=seed,
            )  # fmt: skip
            for policy in POLICIES:
                got = {
                    aware: simulate(trace.jobs, trace.cluster, policy=policy, aware=aware).to_json()
                    for aware in (True, False)
                }
                key = OBJECTIVE[policy]
                ratio = got[False][key] / got[True][key]
                rows[policy].append(ratio)
                detail.append({"seed": seed, "policy": policy, "objective": key,
                               "aware": got[True][key], "agnostic": got[False][key],
                               "ratio": ratio})  # fmt: skip
        out[label] = {
            "ratio_agnostic_over_aware": {p: statistics.median(v) for p, v in rows.items()},
            "runs": detail,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--workers", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sim-jobs", type=int, default=60)
    parser.add_argument("--sim-workers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    solve = _solve_times(args.jobs, args.workers, args.repeats)
    worst = max(max(v.values()) for v in solve.values())
    print(json.dumps({
        "allocation": {"jobs": args.jobs, "types": 3, "workers_per_type": args.workers,
                       "seconds": solve, "worst_s": worst, "target_s": 1.0,
                       "met": worst < 1.0},
        "simulation": _simulations(args),
        "gavel": {"jct": 3.5, "makespan": 2.5, "cost": 1.4, "note": "up to, seed 002 ch. 5"},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
