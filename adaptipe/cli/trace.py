"""``adaptipe trace``: a run's traced timeline ([train] trace_iterations): per-stage
times, a Gantt PNG, and the simulator's prediction next to it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.units import parse_bandwidth

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "trace",
        help="show a run's traced timeline ([train] trace_iterations): per-stage times, Gantt PNG",
    )
    p.add_argument("run_dir")
    p.add_argument("--png", help="write the timeline as a Gantt chart PNG here")
    p.add_argument("--json", action="store_true", help="print the per-stage summary as JSON")
    p.add_argument(
        "--profile", help="also simulate the run's schedule and partition with this Profile JSON"
    )
    p.add_argument("--bandwidth", default="inf", help="link bandwidth for that (e.g. 2GB/s)")
    p.add_argument("--latency", type=float, default=0.0, help="link latency in seconds for that")
    p.add_argument("--sim-png", help="with --profile: write the simulated Gantt chart here")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.runtime.rundir import RunDir
    from adaptipe.runtime.trace import compare, read_trace, summarise

    if args.sim_png and not args.profile:
        raise PlanError("--sim-png needs --profile (the profile to simulate the run with)")
    rundir = RunDir(args.run_dir)
    events, (first, end) = read_trace(rundir.trace)
    iterations = end - first
    summary = summarise(events, iterations=iterations)
    if args.png:
        from adaptipe.sim.gantt import plot_timeline

        workers = max(e.worker for e in events) + 1
        plot_timeline(
            events,
            args.png,
            workers=workers,
            title=f"{rundir.root.name}: iterations {first}-{end - 1} as run (gaps: waiting)",
        )
    found = None
    if args.profile:
        from adaptipe.profile import Profile
        from adaptipe.serial import load_json_file

        found = compare(
            rundir,
            load_json_file(args.profile, Profile.from_json),
            latency_s=args.latency,
            bandwidth_Bps=parse_bandwidth(args.bandwidth),
        )
        if args.sim_png:
            from adaptipe.sim import plot_gantt

            plot_gantt(found.simulation, args.sim_png, title=f"{rundir.root.name}: simulated")
    if args.json:
        out: dict[str, Any] = {"iterations": [first, end], "stages": summary}
        if found is not None:
            out["simulated"] = {
                "measured_s": found.measured_s,
                "predicted_s": found.predicted_s,
                "error": found.error,
                "stages": found.simulated,
            }
        print(json.dumps(out))
        return 0
    print(f"{rundir.root}: iterations {first}-{end - 1}, per iteration:")
    for stage, row in summary.items():
        kinds = ", ".join(
            f"{k} {v['count']} x {v['mean_s'] * 1e3:.2f} ms" for k, v in row["kinds"].items()
        )
        print(
            f"  stage {stage}: busy {row['busy_s'] * 1e3:.1f} ms, idle "
            f"{row['idle_s'] * 1e3:.1f} ms ({kinds})"
        )
        if found is not None:
            sim = found.simulated[stage]
            print(
                f"    simulated: busy {sim['busy_s'] * 1e3:.1f} ms, idle {sim['idle_s'] * 1e3:.1f} ms"
            )
    if found is not None:
        print(
            f"iteration: measured {found.measured_s * 1e3:.1f} ms, simulated "
            f"{found.predicted_s * 1e3:.1f} ms ({found.error:+.1%})"
        )
    for path in (args.png, args.sim_png):
        if path:
            print(f"wrote {path}")
    return 0
