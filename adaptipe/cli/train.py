"""``adaptipe train``: train a run config over real stage processes, with a progress bar."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from adaptipe.errors import PlanError

if TYPE_CHECKING:
    from adaptipe.runtime import TrainSummary

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a run config over real stage processes")
    p.add_argument("config", nargs="?", help="run config (TOML)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    p.add_argument(
        "--run-dir", help="where plans, metrics and checkpoints go (default: from the config)"
    )
    p.add_argument(
        "--inject", metavar="SCENARIO", help="run an interference scenario (TOML) alongside"
    )
    p.add_argument("--inject-seed", type=int, default=0, help="seed of the scenario's random draws")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if (args.config is None) == (args.resume is None):
        raise PlanError(
            "give a CONFIG.toml to start a run, or --resume RUN_DIR to continue one (not both)"
        )
    summary = _train(args)
    if args.json:
        print(json.dumps(summary.to_json()))
        return 0
    from adaptipe.cli.summary import print_summary

    print_summary(summary)
    return 0


def _train(args: argparse.Namespace) -> TrainSummary:
    """Train with a progress bar on stderr (none with ``--json`` or ``--no-progress``)."""
    from adaptipe.cli.progress import training_progress
    from adaptipe.controllers.live import decider
    from adaptipe.runtime import train

    with training_progress(disable=args.json or args.no_progress) as on_iteration:
        return train(
            args.config if args.config is not None else Path(args.resume),
            run_dir=args.resume if args.resume is not None else args.run_dir,
            resume=args.resume is not None,
            on_iteration=on_iteration,
            inject=args.inject,
            inject_seed=args.inject_seed,
            decider=decider,
        )
