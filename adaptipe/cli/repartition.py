"""``adaptipe repartition``: move layers between the stages of a running pipeline.

It reads and writes the run directory only (no torch), so the request leaves at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "repartition",
        help="move layers between the stages of a running pipeline (at the next boundary)",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the running pipeline")
    p.add_argument(
        "--bounds",
        required=True,
        metavar="B0,B1,...",
        help="layer bounds, as [pipeline].partition takes them (e.g. 0,3,8)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.errors import PlanError
    from adaptipe.runtime.repartition import repartition
    from adaptipe.runtime.rundir import RunDir

    try:
        bounds = [int(b) for b in args.bounds.split(",")]
    except ValueError:
        raise PlanError(
            f"--bounds must be comma-separated layer indices like 0,3,8 (got {args.bounds!r})"
        ) from None
    version = repartition(args.run_dir, bounds)
    print(f"asked {args.run_dir} to hold layers {bounds} (plan version {version.version})")
    rundir = RunDir(Path(args.run_dir))
    if any((rundir.root / "stages").glob("stage-*.jsonl")):
        print("the workers move the layers at their next boundary")
    else:
        print("the workers take it on when they start (or resume)")
    return 0
