"""Benchmark the JAPSP solvers (ArrayPipe §IV-B) on generated job-arrays; prints one JSON object.

``bb``: per size of ``--bb-sizes`` (jobs x stages) and ``--instances`` generated
instances, how many branch-and-bound proves optimal within ``--bb-time`` seconds, how
many in under 1 s (wall clock), its seconds (all runs, and the proved ones), its CPU
seconds, nodes and the gap left where it stopped.

``table``: per size of ``--sizes``, the GA on its default work (`default_work`: it grows
with jobs x stages) against the optimum (when B&B or CP-SAT proved one), the lower bound
and CP-SAT's best after ``--cpsat-time`` seconds (on the first ``--cpsat-instances``
instances, when OR-Tools is installed), its wall and CPU seconds (``--ga-runs`` runs per
instance: their median, and whether every run gave the same schedule), and the
baselines' makespans relative to the GA's.

Instances are generated the paper's way (§V-A): each job's batch size is one of a few
(``--profiles``) values, and jobs of one batch size share one per-stage profile, so they
are identical (``--jitter 0``, the default). ``--jitter 0.02`` perturbs every block time
by up to 2%, so jobs of one profile are only nearly identical and the B&B cannot treat
them as interchangeable; the JSON records the jitter and says which of the two it was.

    python bench/bench_japsp.py [--instances 10] [--cpsat-time 30] [--cpsat-instances 2]
                                [--bb-time 5] [--bb-sizes 4x4,6x4] [--costs] [--sizes 6x4,30x10]
                                [--jitter 0.0] [--profiles 3] [--seed0 0] [--ga-runs 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from typing import Any

from adaptipe.japsp import JapspInstance, Result, generate, lower_bound, solve
from adaptipe.japsp.bnb import solve_bnb
from adaptipe.japsp.budget import default_work
from adaptipe.japsp.cpsat import available as cpsat_available
from adaptipe.japsp.genetic import solve_ga

SIZES = ["4x4", "6x4", "15x4", "20x4", "30x4", "40x4", "30x10", "30x16", "64x8"]
BB_SIZES = ["4x4", "5x4", "6x4", "8x4", "6x6"]
SMALL = {"4x4", "5x4", "6x4"}  # the GA's gap is measured against B&B's optimum here


def _stats(values: list[float], digits: int = 4) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "mean": round(statistics.fmean(values), digits),
        "median": round(statistics.median(values), digits),
        "max": round(max(values), digits),
        "min": round(min(values), digits),
    }


def _seeds(args: argparse.Namespace) -> range:
    return range(args.seed0, args.seed0 + args.instances)


def _instance(name: str, seed: int, args: argparse.Namespace) -> JapspInstance:
    jobs, stages = (int(v) for v in name.split("x"))
    comm, switch, update = (0.1, 0.05, 0.1) if args.costs else (0.0, 0.0, 0.0)
    return generate(
        jobs,
        stages,
        seed=seed,
        profiles=args.profiles,
        jitter=args.jitter,
        comm=comm,
        switch=switch,
        update=update,
    )


def _bnb(name: str, seed: int, args: argparse.Namespace, cache: dict[Any, Any]) -> Result:
    """B&B on one instance, run once per (size, seed) for both tables; its CPU seconds go
    to ``cache["cpu", name, seed]`` (on a busy machine the wall clock runs ahead of it)."""
    if (name, seed) not in cache:
        inst = _instance(name, seed, args)
        cpu = time.process_time()
        cache[name, seed] = solve_bnb(inst, time_limit_s=args.bb_time)
        cache["cpu", name, seed] = time.process_time() - cpu
    result: Result = cache[name, seed]
    return result


def _bb_size(name: str, args: argparse.Namespace, cache: dict[Any, Any]) -> dict[str, Any]:
    runs = [_bnb(name, seed, args, cache) for seed in _seeds(args)]
    proved = [r for r in runs if r.optimal]
    return {
        "size": name,
        "instances": len(runs),
        "time_limit_s": args.bb_time,
        "proved": len(proved),
        "proved_under_1s": sum(r.seconds < 1.0 for r in proved),
        "seconds": _stats([r.seconds for r in runs], 3),
        "cpu_seconds": _stats([cache["cpu", name, seed] for seed in _seeds(args)], 3),
        "proof_seconds": _stats([r.seconds for r in proved], 3),
        "nodes": _stats([float(r.nodes) for r in runs], 0),
        "gap_left": _stats([r.gap for r in runs if not r.optimal]),
    }


def _size(name: str, args: argparse.Namespace, cache: dict[Any, Any]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for seed in _seeds(args):
        inst = _instance(name, seed, args)
        row: dict[str, Any] = {"seed": seed, "lower_bound": lower_bound(inst)}
        row.update(_ga_runs(inst, args.ga_runs))
        best = row["ga"]
        if name in SMALL:
            bb = _bnb(name, seed, args, cache)
            row.update(bb=bb.makespan, bb_optimal=bb.optimal)
            best = min(best, bb.makespan)
            if bb.optimal:
                row["optimum"] = bb.makespan
        if args.cpsat_time > 0 and seed < args.seed0 + args.cpsat_instances and cpsat_available():
            cp = solve(inst, solver="cpsat", time_limit_s=args.cpsat_time, seed=0)
            row.update(cpsat=cp.makespan, cpsat_optimal=cp.optimal, cpsat_s=cp.seconds)
            best = min(best, cp.makespan)
            if cp.optimal:
                row["optimum"] = cp.makespan
        row["best_known"] = best
        for base in ("gpipe", "1f1b", "rr"):
            row[base] = solve(inst, solver=base).makespan
        rows.append(row)

    def ratios(key: str, ref: str) -> list[float]:
        return [r[key] / r[ref] - 1.0 for r in rows if key in r and ref in r]

    out: dict[str, Any] = {
        "size": name,
        "instances": len(rows),
        "ga_work": default_work(*(int(v) for v in name.split("x"))),
        "ga_runs": args.ga_runs,
        "ga_same_schedule": all(r["ga_same"] for r in rows),
        # per instance the median of its runs; then over instances
        "ga_seconds": _stats([r["ga_s"] for r in rows], 3),
        "ga_cpu_seconds": _stats([r["ga_cpu_s"] for r in rows], 3),
        # "clock": the time limit cut the GA short, so its schedule may differ on a rerun
        "ga_stopped_by": dict(collections.Counter(r["ga_stopped_by"] for r in rows)),
        "ga_gap_to_optimum": _stats(ratios("ga", "optimum")),
        "ga_gap_to_lower_bound": _stats(ratios("ga", "lower_bound")),
        "ga_vs_cpsat": _stats(ratios("ga", "cpsat")),
        "ga_vs_best_known": _stats(ratios("ga", "best_known")),
        "optimum_known": sum("optimum" in r for r in rows),
        "baselines_vs_ga": {b: _stats(ratios(b, "ga"), 3) for b in ("gpipe", "1f1b", "rr")},
    }
    if name in SMALL:
        out["bb_gap_to_optimum"] = _stats(ratios("bb", "optimum"))
    if any("cpsat" in r for r in rows):
        out["cpsat"] = {
            "time_limit_s": args.cpsat_time,
            "instances": sum("cpsat" in r for r in rows),
            "proved": sum(r.get("cpsat_optimal", False) for r in rows),
            "gap_to_lower_bound": _stats(ratios("cpsat", "lower_bound")),
        }
    return out


def _ga_runs(inst: JapspInstance, runs: int) -> dict[str, Any]:
    """The GA on its default work ``runs`` times with seed 0: its makespan, the median
    wall and CPU seconds, and whether every run gave the same orders."""
    results, cpu = [], []
    for _ in range(runs):
        c0 = time.process_time()
        results.append(solve_ga(inst, seed=0))
        cpu.append(time.process_time() - c0)
    ga = results[0]
    return {
        "ga": ga.makespan,
        "ga_s": statistics.median(r.seconds for r in results),
        "ga_cpu_s": statistics.median(cpu),
        # "clock" when any run was cut short: then the runs may differ
        "ga_stopped_by": "clock"
        if any(r.stopped_by == "clock" for r in results)
        else ga.stopped_by,
        "ga_same": all(r.orders == ga.orders and r.makespan == ga.makespan for r in results),
    }


def _identical(args: argparse.Namespace) -> str:
    if args.jitter > 0:
        return (
            f"nearly: each block time is its profile's times (1 +- {args.jitter}), so jobs "
            "of one batch size differ slightly and are not interchangeable"
        )
    return "yes: jobs of one batch size have identical block times (the paper's workload)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=10)
    parser.add_argument("--cpsat-time", type=float, default=30.0, help="0 skips CP-SAT")
    parser.add_argument("--cpsat-instances", type=int, default=2)
    parser.add_argument("--bb-time", type=float, default=5.0)
    parser.add_argument("--bb-sizes", default=",".join(BB_SIZES), help="'' skips B&B")
    parser.add_argument("--costs", action="store_true", help="add comm, switch and update costs")
    parser.add_argument("--sizes", default=",".join(SIZES), help="'' skips the GA table")
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="per-block perturbation of the profiles (0: jobs of one batch size are identical)",
    )
    parser.add_argument("--profiles", type=int, default=3, help="batch sizes per array")
    parser.add_argument("--seed0", type=int, default=0, help="first instance seed")
    parser.add_argument(
        "--ga-runs", type=int, default=1, help="GA runs per instance (same seed: same schedule?)"
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    cache: dict[Any, Any] = {}
    bb = [_bb_size(name, args, cache) for name in args.bb_sizes.split(",") if name]
    table = [_size(name, args, cache) for name in args.sizes.split(",") if name]
    print(
        json.dumps(
            {
                "benchmark": "japsp",
                "cpsat_available": cpsat_available(),
                "costs": args.costs,
                "profiles": args.profiles,
                "jitter": args.jitter,
                "identical_jobs": _identical(args),
                "seeds": [args.seed0, args.seed0 + args.instances - 1],
                "bb": bb,
                "table": table,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
