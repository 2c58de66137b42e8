"""``adaptipe monitor``: a live per-stage view of a run's telemetry."""

from __future__ import annotations

import argparse

from adaptipe.errors import PlanError

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``adaptipe monitor RUN_DIR|ADDRESS`` to the ``adaptipe`` command."""
    p = subparsers.add_parser(
        "monitor",
        help="live per-stage view of a run's telemetry (run directory or tcp:// address)",
        description=(
            "Follow a run directory's telemetry.jsonl, replay a finished run (--replay), "
            "or bind a standalone collector at a tcp:// address for workers started with "
            "ADAPTIPE_TELEMETRY=that address (it cannot attach to a collector that "
            "`adaptipe train` runs; watch that run's directory instead)."
        ),
    )
    p.add_argument("source", metavar="RUN_DIR|ADDRESS", help="run directory or tcp://host:port")
    p.add_argument("--refresh-s", type=float, default=0.5, help="seconds between frames")
    p.add_argument("--window", type=int, default=20, help="iterations averaged per stage")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--replay", action="store_true", help="play a finished run back in time")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed-up (with --replay)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Show the view until the run finishes (run directory) or Ctrl-C."""
    from adaptipe.monitor.live import watch

    # Checked here too, so that the errors name the flags.
    for name in ("refresh_s", "speed"):
        if not getattr(args, name) > 0:
            raise PlanError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(args, name)})")
    if args.window < 1:
        raise PlanError(f"--window must be >= 1 (got {args.window})")
    if "://" in args.source and args.replay:
        raise PlanError("--replay needs a run directory, not an address")
    watch(
        args.source,
        refresh_s=args.refresh_s,
        window=args.window,
        once=args.once,
        replay=args.replay,
        speed=args.speed,
    )
    return 0
