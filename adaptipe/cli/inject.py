"""``adaptipe inject``: run an interference scenario on its own, in the foreground."""

from __future__ import annotations

import argparse
import signal
import threading
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adaptipe.inject import Event

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``adaptipe inject SCENARIO.toml`` to the ``adaptipe`` command."""
    p = subparsers.add_parser(
        "inject",
        help="run an interference scenario: hogs, memory, throttles, slowdowns, kills, link shapes",
    )
    p.add_argument("scenario", help="scenario file (TOML)")
    p.add_argument("--stages", type=int, default=None, help="the run's stage count (checked)")
    p.add_argument("--dry-run", action="store_true", help="print the expanded timeline only")
    p.add_argument("--seed", type=int, default=0, help="seed of Poisson arrivals and kill draws")
    p.add_argument(
        "--horizon-s", type=float, default=None, help="draw Poisson arrivals up to this second"
    )
    p.add_argument(
        "--control-dir", help="folder for throttle and slowdown state (default: a temporary one)"
    )
    p.set_defaults(func=run)
    return p


def _show(event: Event) -> None:
    verb = event.kind.removeprefix("injection-")
    where = "" if event.stage is None else f" stage {event.stage}"
    shown = ("shape", "restored", "pids", "reason", "error")
    extra = {k: v for k, v in event.detail.items() if k in shown and v != []}
    notes = " ".join(f"{k}={v}" for k, v in extra.items())
    origin = event.detail.get("origin")
    print(f"[{event.elapsed_s:8.2f} s] {verb:<6} {event.injector}{where} ({origin}) {notes}")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    """Print the timeline, then (unless ``--dry-run``) run it until it ends or Ctrl-C."""
    from adaptipe.inject import CONTROL_DIR_ENV, ScenarioRunner, expand, load_scenario

    scenario = load_scenario(args.scenario, num_stages=args.stages)
    scenario = expand(scenario, horizon_s=args.horizon_s, seed=args.seed)
    timed = tuple(i for i in scenario.injections if not i.by_iteration)
    counted = len(scenario.injections) - len(timed)
    print(f"{scenario.source}: {len(timed)} timed, {counted} iteration-keyed (seed {args.seed})")
    for injection in scenario.injections:
        print(f"  {injection.describe()}")
    if args.dry_run:
        return 0
    if counted:
        print("iteration-keyed injections need a training run; skipped here")

    def kill_stage(stage: int) -> None:
        print(f"  (no run attached: stage {stage} would be killed now)")

    runner = ScenarioRunner(
        replace(scenario, injections=timed),
        on_event=_show,
        control_dir=args.control_dir,
        kill_stage=kill_stage,
        seed=args.seed,
    )
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        with runner:
            if runner.control_dir is not None:
                print(f"control files: {runner.control_dir} (give workers {CONTROL_DIR_ENV})")
            runner.wait()
    except KeyboardInterrupt:
        print("interrupted: every injection has ended")
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 1 if runner.failures else 0
