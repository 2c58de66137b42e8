"""``adaptipe manage``: the manager of a run whose workers torchrun starts (other hosts)."""

from __future__ import annotations

import argparse
import json

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "manage",
        help="manage a prepared run whose workers torchrun starts (telemetry, stops, moves)",
        description=(
            "The manager of `adaptipe train` on its own, for workers started by torchrun: "
            "start it first (the workers find it through RUN_DIR/control/manager.json), "
            "then the workers; it merges metrics, collects telemetry (CURVE off loopback), "
            "answers `adaptipe stop` and `adaptipe repartition`, and writes the summary."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory `adaptipe prepare` wrote")
    p.add_argument(
        "--bind",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="this host's address the workers reach (default 127.0.0.1: workers on this host)",
    )
    p.add_argument(
        "--resume", action="store_true", help="the workers resume from the latest checkpoint"
    )
    p.add_argument(
        "--wait-s",
        type=float,
        default=600.0,
        help="seconds without a word from any stage before the run counts as lost",
    )
    p.add_argument(
        "--inject",
        metavar="SCENARIO",
        help="run an interference scenario (TOML) on the run's clock: link shapes on a bed, "
        "hogs; not kills, slowdowns or throttles",
    )
    p.add_argument("--inject-seed", type=int, default=0, help="seed of the scenario's random draws")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.cli.progress import training_progress
    from adaptipe.controllers.live import decider
    from adaptipe.runtime.manage import manage

    with training_progress("manage", disable=args.json or args.no_progress) as on_iteration:
        summary = manage(
            args.run_dir,
            bind=args.bind,
            resume=args.resume,
            on_iteration=on_iteration,
            wait_s=args.wait_s,
            inject=args.inject,
            inject_seed=args.inject_seed,
            decider=decider,
        )
    if args.json:
        print(json.dumps(summary.to_json()))
        return 0
    from adaptipe.cli.summary import print_summary

    print_summary(summary)
    return 0
