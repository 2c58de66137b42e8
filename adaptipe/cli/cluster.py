"""``adaptipe cluster``: Gavel's heterogeneity-aware allocation (seed 002, chapter 5).

    adaptipe cluster trace OUT.json [--jobs 100] [--rate 2] [--workers 4] [--multi] [--slo]
    adaptipe cluster allocate TRACE.json --policy max_min_fairness [--agnostic]
    adaptipe cluster simulate TRACE.json [--policies ...] [--round-s 360] [--png FILE]
    adaptipe cluster run SPEC.toml [--out DIR]   # real runs, time-sliced (root)

``simulate`` replays the trace under each policy in its heterogeneity-aware and
-agnostic forms and prints a table (mean job completion time, makespan, cost, SLO
violations) and, with ``--json``, one JSON object; ``--png`` draws each policy's
completion-time distribution, aware against agnostic.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser", "run"]

_POLICIES = ("max_min_fairness", "min_makespan", "fifo", "min_cost")


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cluster", help="Gavel: allocate jobs across device types; simulate a job trace"
    )
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = sub.add_parser("trace", help="write a job trace in the manner of Gavel's experiments")
    t.add_argument("out")
    t.add_argument("--jobs", type=int, default=100)
    t.add_argument("--rate", type=float, default=None, help="arrivals per hour (default: static)")
    t.add_argument("--workers", type=int, default=4, help="workers per device type")
    t.add_argument("--multi", action="store_true", help="multi-worker jobs (70/25/5%%)")
    t.add_argument("--slo", action="store_true", help="SLOs of 1.2x, 2x or 10x the duration")
    t.add_argument("--seed", type=int, default=0)
    a = sub.add_parser("allocate", help="one allocation of a trace's jobs, all present at once")
    a.add_argument("trace")
    a.add_argument("--policy", choices=_POLICIES, default="max_min_fairness")
    a.add_argument("--agnostic", action="store_true", help="the heterogeneity-agnostic form")
    a.add_argument("--json", action="store_true")
    r = sub.add_parser("run", help="time-slice real runs on CPU-quota device types (root)")
    r.add_argument("spec", help="the jobs, device types and policy (TOML)")
    r.add_argument("--out", default="runs/cluster-run", help="run directories and the log")
    r.add_argument("--json", action="store_true")
    s = sub.add_parser("simulate", help="replay a trace under each policy, aware and agnostic")
    s.add_argument("trace")
    s.add_argument("--policies", default=",".join(_POLICIES), help="comma-separated")
    s.add_argument("--round-s", type=float, default=360.0, help="round length (Gavel: 6 min)")
    s.add_argument("--png", help="write completion-time CDFs here")
    s.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.action == "trace":
        return _trace(args)
    if args.action == "allocate":
        return _allocate(args)
    if args.action == "run":
        return _run(args)
    return _simulate(args)


def _trace(args: argparse.Namespace) -> int:
    from adaptipe.cluster.trace import generate, save_trace

    trace = generate(
        jobs=args.jobs,
        rate_per_hour=args.rate,
        workers_per_type=args.workers,
        multi_worker=args.multi,
        slos=args.slo,
        seed=args.seed,
    )
    save_trace(trace, args.out)
    print(f"wrote {len(trace.jobs)} jobs on {trace.cluster.total} workers to {args.out}")
    return 0


def _allocate(args: argparse.Namespace) -> int:
    import time

    from adaptipe.cluster.policies import allocate
    from adaptipe.cluster.trace import load_trace

    trace = load_trace(args.trace)
    start = time.perf_counter()
    alloc = allocate(trace.jobs, trace.cluster, policy=args.policy, aware=not args.agnostic)
    seconds = time.perf_counter() - start
    rows = {
        job.name: [round(float(v), 6) for v in row]
        for job, row in zip(trace.jobs, alloc.x, strict=True)
    }
    out = {
        "policy": alloc.policy,
        "aware": alloc.aware,
        "objective": alloc.objective,
        "seconds": seconds,
        "types": list(trace.cluster.types),
        "allocation": rows,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{alloc.policy} ({'aware' if alloc.aware else 'agnostic'}): objective "
          f"{alloc.objective:.4g}, solved in {seconds * 1e3:.0f} ms")  # fmt: skip
    print("job".ljust(24) + "".join(t.rjust(10) for t in trace.cluster.types))
    for name, row in rows.items():
        print(name[:24].ljust(24) + "".join(f"{v:10.3f}" for v in row))
    return 0


def _run(args: argparse.Namespace) -> int:
    import functools
    from pathlib import Path

    from adaptipe.timeslice import load_spec, run_sliced

    spec = load_spec(args.spec)
    say = (lambda _: None) if args.json else functools.partial(print, flush=True)
    result = run_sliced(spec, Path(args.out), say=say)
    if args.json:
        print(json.dumps(result))
        return 0
    for name, share in result["shares"].items():
        alone = result.get("alone", {}).get(name, {})
        print(f"{name}: rounds {share['rounds']} against allocated {share['allocated']} "
              f"(largest gap {share['largest_gap_rounds']} rounds); done after "
              f"{result['completion_s'][name]:.0f} s; same as alone: {alone.get('equal')}")  # fmt: skip
    print(f"log: {Path(args.out) / 'cluster-run.json'}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from adaptipe.cluster.simulate import simulate
    from adaptipe.cluster.trace import load_trace
    from adaptipe.errors import PlanError

    trace = load_trace(args.trace)
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in _POLICIES]
    if bad:
        raise PlanError(f"--policies: unknown {bad[0]!r} (allowed: {', '.join(_POLICIES)})")
    results: list[dict[str, Any]] = []
    runs = [(p, aware) for p in policies for aware in (True, False)]
    with Progress(console=Console(stderr=True), transient=True, disable=args.json) as bar:
        task = bar.add_task("simulating", total=len(runs))
        for policy, aware in runs:
            sim = simulate(
                trace.jobs, trace.cluster, policy=policy, aware=aware, round_s=args.round_s
            )
            results.append(sim.to_json())
            bar.advance(task)
    if args.png:
        _plot(results, args.png)
    if args.json:
        print(json.dumps({"trace": args.trace, "round_s": args.round_s, "results": results}))
        return 0
    print(f"{'policy':18} {'form':9} {'mean JCT (h)':>12} {'makespan (h)':>12} "
          f"{'cost ($)':>10} {'SLO missed':>10}")  # fmt: skip
    for r in results:
        print(f"{r['policy']:18} {'aware' if r['aware'] else 'agnostic':9} "
              f"{r['mean_jct_s'] / 3600:12.2f} {r['makespan_s'] / 3600:12.2f} "
              f"{r['cost']:10.1f} {r['slo_violations']:10d}")  # fmt: skip
    if args.png:
        print(f"completion-time CDFs: {args.png}")
    return 0


def _plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    policies = list(dict.fromkeys(r["policy"] for r in results))
    fig, axes = plt.subplots(1, len(policies), figsize=(4 * len(policies), 3.2), squeeze=False)
    for ax, policy in zip(axes[0], policies, strict=True):
        for r in results:
            if r["policy"] != policy:
                continue
            hours = np.sort(np.array(list(r["completion_s"].values())) / 3600.0)
            share = np.arange(1, len(hours) + 1) / max(len(hours), 1)
            label = f"{'aware' if r['aware'] else 'agnostic'} (mean {hours.mean():.1f} h)"
            ax.step(hours, share, where="post", label=label)
        ax.set_title(policy)
        ax.set_xlabel("job completion time (h)")
        ax.set_ylabel("fraction of jobs")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
