"""``adaptipe prepare``: write a run's plans without starting workers (for torchrun)."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prepare", help="write a run's plans without starting workers (for torchrun)"
    )
    p.add_argument("config", help="run config (TOML)")
    p.add_argument("--run-dir", help="where to write (default: from the config)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.runtime import prepare

    rundir, config = prepare(args.config, run_dir=args.run_dir)
    partition = rundir.read_partition()
    # A job-array's block order comes from its JAPSP solver, not [pipeline].schedule.
    schedule = config.pipeline.schedule
    if config.sweep is not None:
        sweep = config.sweep
        length = sweep.rounds(len(config.jobs), config.pipeline.stages)
        schedule = (
            f"{len(config.jobs)} jobs in JAPSP windows of {length} iteration(s)"
            f"{' (auto)' if sweep.window == 'auto' else ''} ([sweep].solver {sweep.solver})"
        )
    print(
        f"wrote the plans of {args.config} to {rundir.root}: {schedule} over "
        f"{config.pipeline.stages} stage(s), partition bounds {list(partition.bounds)}"
    )
    print(
        f"start one worker per stage with: torchrun ... -m adaptipe.runtime.worker --run-dir {rundir.root}"
    )
    return 0
