"""One entry point for every JAPSP solver, its `Result`, and the ``adaptipe japsp`` command.

``auto`` follows the paper's practice (§V-B: B&B up to a job-array size threshold, the
GA beyond): branch-and-bound when ``J * S <= auto_threshold``, else the GA; either way
the result carries a lower bound and the remaining gap.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.japsp.evaluate import Orders
from adaptipe.japsp.instance import JapspInstance

__all__ = [
    "AUTO_THRESHOLD",
    "SOLVERS",
    "Result",
    "add_japsp_parser",
    "run_japsp_command",
    "solve",
]

SOLVERS = ("bb", "ga", "auto", "gpipe", "1f1b", "rr", "cpsat")
AUTO_THRESHOLD = 16
"""``J * S`` up to which ``auto`` runs B&B. Measured (bench/bench_japsp.py, generated
instances, 10 seeds each): B&B proves every 4x4, 5x4 and 6x4 instance in under a second
when jobs of one batch size have identical times (the paper's workload), but with 2%
per-job jitter a 6x4 instance can take ~8 s of CPU and 5x4 up to ~3 s under load; beyond
16 the GA, within about 1% of the optimum there in well under a second, is the safer
default (``auto_threshold`` raises it)."""
_DEFAULT_LIMIT = {"bb": 10.0, "ga": 1.0, "cpsat": 10.0}
_COUNTED = {"ga": "work units", "cpsat": "branches"}  # what `Result.nodes` counts
_RULE_SAYS = {
    "serial": "rounds one after another",
    "fit": "a later round's block fills a gap it fits",
    "eager": "any block that can start first goes",
}


@dataclass(frozen=True, slots=True)
class Result:
    """A solver's answer: per-stage orders and what is known about their quality.

    ``gap`` is ``(makespan - lower_bound) / makespan``; ``optimal`` is True only when the
    solver proved it (B&B finished, CP-SAT proved, or the makespan meets the bound).
    ``nodes`` counts B&B nodes, GA work (blocks visited, `adaptipe.japsp.budget`) or
    CP-SAT branches. ``stopped_by`` says what ended the search, and so whether a rerun
    gives the same schedule: ``"search"`` (B&B searched everything, CP-SAT finished),
    ``"bound"`` (the makespan met the lower bound), ``"work"`` or ``"generations"`` (the
    GA's budget: reproducible for its seed), ``"clock"`` (the time limit: a rerun may
    differ), or ``""`` (a baseline: no search).
    """

    solver: str
    orders: Orders
    makespan: float
    lower_bound: float
    optimal: bool
    seconds: float
    nodes: int = 0
    stopped_by: str = ""

    @property
    def gap(self) -> float:
        if self.makespan <= 0:
            return 0.0
        return max(0.0, (self.makespan - self.lower_bound) / self.makespan)

    def to_json(self) -> dict[str, Any]:
        return {
            "solver": self.solver,
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "optimal": self.optimal,
            "gap": self.gap,
            "seconds": self.seconds,
            "nodes": self.nodes,
            "stopped_by": self.stopped_by,
            "orders": [[f"{k}{j}" for k, j in stage] for stage in self.orders],
        }


def solve(
    inst: JapspInstance,
    *,
    solver: str = "auto",
    time_limit_s: float | None = None,
    seed: int = 0,
    auto_threshold: int = AUTO_THRESHOLD,
) -> Result:
    """Solve ``inst`` with ``solver`` (one of `SOLVERS`).

    ``time_limit_s`` defaults to 10 s for ``bb`` and ``cpsat`` and 1 s for ``ga``. The
    baselines ignore it and report the best lower bound next to their makespan.
    ``auto`` runs B&B when ``J * S <= auto_threshold`` and the GA otherwise.
    """
    if solver not in SOLVERS:
        raise PlanError(f"solver must be one of {', '.join(SOLVERS)} (got {solver!r})")
    if time_limit_s is not None and not time_limit_s > 0:
        raise PlanError(f"time limit must be > 0 seconds (got {time_limit_s})")
    if solver == "auto":
        solver = "bb" if inst.num_jobs * inst.num_stages <= auto_threshold else "ga"
    limit = time_limit_s if time_limit_s is not None else _DEFAULT_LIMIT.get(solver, 0.0)
    if solver == "bb":
        from adaptipe.japsp.bnb import solve_bnb

        return solve_bnb(inst, time_limit_s=limit, seed=seed)
    if solver == "ga":
        from adaptipe.japsp.genetic import solve_ga

        return solve_ga(inst, time_limit_s=limit, seed=seed)
    if solver == "cpsat":
        from adaptipe.japsp.cpsat import solve_cpsat

        return solve_cpsat(inst, time_limit_s=limit, seed=seed)
    from adaptipe.japsp.baselines import BASELINES
    from adaptipe.japsp.bounds import lower_bound

    t0 = time.perf_counter()
    timeline = BASELINES[solver](inst)
    lb = lower_bound(inst)
    return Result(
        solver=solver,
        orders=timeline.orders,
        makespan=timeline.makespan,
        lower_bound=lb,
        optimal=timeline.makespan <= lb + 1e-9,
        seconds=time.perf_counter() - t0,
    )


def add_japsp_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``japsp INSTANCE.json --solver ... [--time-limit S] [--seed N] [--json]``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
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
        "--time-limit", type=float, default=None, metavar="S", help="seconds (bb/cpsat 10, ga 1)"
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
    p.set_defaults(func=run_japsp_command)
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


def run_japsp_command(args: argparse.Namespace) -> int:
    """Load the instance, solve, print; returns the exit status."""
    from adaptipe.serial import load_json_file

    if args.memory_budget and args.window == 1:
        raise PlanError("--memory-budget caps the jobs in flight of a window: give --window R")

    inst = load_json_file(args.instance, JapspInstance.from_json)
    if args.window == "auto":
        from adaptipe.japsp.window import auto_window

        args.window = auto_window(inst.num_jobs, inst.num_stages)
    result = solve(
        inst,
        solver=args.solver,
        time_limit_s=args.time_limit,
        seed=args.seed,
        auto_threshold=args.auto_threshold,
    )
    window = None
    if args.window != 1 or args.memory_budget:
        from adaptipe.japsp.window import JITTER, ROUND_ORDERS, best_window, expected_makespan

        round_orders, window = best_window(
            inst, result.orders, args.window, budget=args.memory_budget
        )
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
