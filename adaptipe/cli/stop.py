"""``adaptipe stop``: stop jobs of a running job-array (the others keep training).

It reads and writes the run directory only: importing torch (seconds on a busy machine)
would delay the request by as many iterations.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "stop", help="stop jobs of a running job-array (the others keep training)"
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the running array")
    p.add_argument(
        "jobs",
        nargs="+",
        metavar="JOB",
        help='job names or indices in the sweep (a name wins: a job may be named "3")',
    )
    p.add_argument("--reason", default="user", help="recorded with the stop (default: user)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.runtime.control import array_jobs, manager_running, stop_jobs
    from adaptipe.runtime.rundir import RunDir

    stopped = stop_jobs(args.run_dir, args.jobs, reason=args.reason)
    rundir = RunDir(Path(args.run_dir))
    names, _ = array_jobs(rundir)
    which = ", ".join(f"{names[j]} (#{j})" for j in stopped)
    print(f"asked {args.run_dir} to stop job(s) {which}")
    started = rundir.metrics.exists() or any((rundir.root / "stages").glob("stage-*.jsonl"))
    manager = manager_running(rundir)
    if manager is not False:  # here, or on another host
        print("the manager re-plans the array; the workers switch at the next iteration")
    elif not started:
        print(
            "note: this run has not started training and no manager acts on the request; "
            "a new `adaptipe train` of the config starts afresh without it (leave the jobs "
            "out of the [sweep] instead)",
            file=sys.stderr,
        )
    else:
        print(
            "note: no `adaptipe train` manages this run now (it stopped before its last "
            "iteration, or its workers run under torchrun); the request applies when "
            f"`adaptipe train --resume {args.run_dir}` continues it",
            file=sys.stderr,
        )
    return 0
