"""``adaptipe japsp``: schedule a job-array through one pipeline (ArrayPipe's JAPSP)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.japsp.solve import AUTO_THRESHOLD, SOLVERS

__all__ = ["add_parser", "run"]

_COUNTED = {"ga": "work units", "cpsat": "branches"}  # what `Result.nodes` counts
_RULE_SAYS = {
    "serial": "rounds one after another",
    "fit": "a later round's block fills a gap it fits",
    "eager": "any block that can start first goes",
}


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``japsp INSTANCE.json --solver ... [--time-limit S] [--seed N] [--json]``."""
    p = subparsers.add_parser(
        "japsp",
        help="schedule a job-array through one pipeline (ArrayPipe's JAPSP)",
        description="Order the forward and backward blocks of J sibling jobs on S pipeline "
        "stages to minimise the makespan (ArrayPipe's JAPSP, Eq. 3-9).",
    )
    p.add_argument(
        "instance", help="instance JSON: {stages, jobs: [{name, forward, backward, ...}]}"
    )
    p.add_argument("--solver", choices=SOLVERS, default="auto")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="S",
        help="seconds (default: bb/cpsat 10; ga none: it runs on 10,000 work units per "
        "job x stage, 1 to 10 million, and given S on one million a second)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--auto-threshold",
        type=int,
        default=AUTO_THRESHOLD,
        metavar="JxS",
        help=f"auto runs B&B when jobs*stages <= this (default {AUTO_THRESHOLD})",
    )
    p.add_argument(
        "--window",
        type=_window_arg,
        default=1,
        metavar="R",
        help="also plan a window of R iterations whose blocks overlap ([sweep] window; "
        '"auto": its default for these jobs and stages): the round order it picks, its '
        "makespan and the time per iteration",
    )
    p.add_argument(
        "--memory-budget",
        type=_at_least(0, "--memory-budget"),
        default=0,
        metavar="K",
        help="with --window: at most K jobs in flight per stage; 0, the default, sets no cap "
        "([sweep] memory_budget)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)
    return p


def _at_least(least: int, flag: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer (got {text!r})") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {least} (got {value})")
        return value

    return parse


def _window_arg(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f'--window must be "auto" or an integer (got {text!r})'
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--window must be >= 1 (got {value})")
    return value


def run(args: argparse.Namespace) -> int:
    """Load the instance, solve, print; returns the exit status."""
    from adaptipe.japsp.instance import JapspInstance
    from adaptipe.japsp.solve import solve
    from adaptipe.serial import load_json_file

    if args.memory_budget and args.window == 1:
        raise PlanError("--memory-budget caps the jobs in flight of a window: give --window R")

    inst = load_json_file(args.instance, JapspInstance.from_json)
    rounds = args.window
    if rounds == "auto":
        from adaptipe.japsp.window import auto_window

        rounds = auto_window(inst.num_jobs, inst.num_stages)
    result = solve(
        inst,
        solver=args.solver,
        time_limit_s=args.time_limit,
        seed=args.seed,
        auto_threshold=args.auto_threshold,
    )
    window = None
    if rounds != 1 or args.memory_budget:
        from adaptipe.japsp.window import JITTER, ROUND_ORDERS, best_window, expected_makespan

        round_orders, window = best_window(inst, result.orders, rounds, budget=args.memory_budget)
        jittered = expected_makespan(inst, window, jitter=JITTER)
    if args.json:
        out = result.to_json()
        if window is not None:
            out["window"] = {
                "rounds": window.rounds,
                "makespan": window.makespan,
                "per_iteration": window.makespan / window.rounds,
                "jittered_makespan": jittered,
                "rule": window.rule,
                "round_order": window.order,
                "round_orders": [[f"{k}{j}" for k, j in stage] for stage in round_orders],
                "orders": window.to_json(),
            }
        print(json.dumps(out))
        return 0
    status = "optimal" if result.optimal else f"gap {100 * result.gap:.2f}%"
    print(
        f"{args.instance}: {inst.num_jobs} jobs x {inst.num_stages} stages, solver {result.solver}"
    )
    print(
        f"makespan {result.makespan:g}  lower bound {result.lower_bound:g}  ({status})  "
        f"{result.seconds:.3f} s, {result.nodes} {_COUNTED.get(result.solver, 'nodes')}"
        + (f", stopped by {result.stopped_by}" if result.stopped_by else "")
    )
    for s, stage in enumerate(result.orders):
        print(f"  stage {s}: " + " ".join(f"{k}{j}" for k, j in stage))
    if window is not None:
        per = window.makespan / window.rounds
        change = per / result.makespan - 1 if result.makespan > 0 else 0.0  # all-zero times
        if abs(change) < 5e-4:  # rounds that cannot overlap: equal up to float noise
            versus = "the same as"
        elif change < 0:
            versus = f"{100 * -change:.1f}% less than"
        else:
            versus = f"{100 * change:.1f}% more than"
        unbudgeted = " with no budget" if args.memory_budget else ""
        print(
            f"window of {window.rounds}: makespan {window.makespan:g}, {per:g} per iteration "
            f"({versus} one iteration at a time{unbudgeted}), rule {window.rule} "
            f"({_RULE_SAYS[window.rule]}); with block times spread by {100 * JITTER:.0f}%, "
            f"about {jittered / window.rounds:.3g} per iteration (mean of seeded replays); "
            f"round order: {ROUND_ORDERS[window.order]}"
        )
        for s, stage in enumerate(round_orders):
            print(f"  stage {s}: " + " ".join(f"{k}{j}" for k, j in stage))
    return 0
