"""``adaptipe adapt``: pause, resume or change the controller of a running run.

It reads and writes the run directory only (no torch), so the request leaves at once;
the manager applies it at its next poll and logs an ``adapt_control`` event
(`adaptipe.runtime.adapt_requests`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "adapt",
        help="pause, resume or change the controller of a running run (no flag: show it)",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--pause", action="store_true", help="start no more controller calls")
    what.add_argument("--resume", action="store_true", help="let the controller decide again")
    p.add_argument(
        "--controller",
        metavar="NAME",
        help="decide with this controller from the next check on (none stops deciding)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.monitor.runlog import control_events
    from adaptipe.runtime.adapt_requests import read_override, request_adapt
    from adaptipe.runtime.control import manager_running
    from adaptipe.runtime.rundir import RunDir

    root = Path(args.run_dir)
    config = (
        json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
    )
    configured = (config.get("adapt") or {}).get("controller", "none")
    if not (args.pause or args.resume or args.controller):
        override = read_override(root)
        held = override.paused if override else False
        chosen = override.controller if override and override.controller else configured
        print(
            f"{root}: controller {chosen} ({'paused' if held else 'deciding'}); "
            f"configured {configured}"
        )
        said = [e for e in control_events(root) if e.get("event") in ("decision", "adapt_control")]
        last = said[-1] if said else None
        if last is not None:
            print(f"last control event: {json.dumps(last)[:300]}")
        return 0
    if (config.get("train") or {}).get("telemetry") is False:
        print(f"{root}: [train].telemetry is off, so no controller can run here", file=sys.stderr)
        return 2
    paused: bool | None = True if args.pause else False if args.resume else None
    asked = request_adapt(root, paused=paused, controller=args.controller)
    chosen = asked.controller or configured
    print(
        f"asked {root}: controller {chosen}, {'paused' if asked.paused else 'deciding'} "
        f"(request {asked.seq})"
    )
    if manager_running(RunDir(root)) is False:
        print(
            "note: no manager runs this run now; the request applies when it is resumed "
            f"(`adaptipe train --resume {root}`)",
            file=sys.stderr,
        )
    else:
        print("the manager applies it at its next poll (see control.jsonl: adapt_control)")
    return 0
