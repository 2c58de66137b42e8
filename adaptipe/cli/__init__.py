"""The ``adaptipe`` command: thin sub-commands over the library.

Every step writes a plan file and reads one (profile -> partition -> schedule ->
simulation), so a user can inspect, diff and hand-edit what flows between them. Each
sub-command is one module here with ``add_parser(subparsers)`` and ``run(args) -> int``;
building the parser imports neither torch nor the runtime (``adaptipe stop`` answers
without them), each ``run`` imports what it calls.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from adaptipe.errors import AdaptipeError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``adaptipe`` parser; each sub-command's ``func`` is its module's ``run``."""
    from adaptipe.cli import (
        adapt,
        cluster,
        collect,
        controllers,
        hosts,
        inject,
        japsp,
        link,
        manage,
        monitor,
        plan,
        prepare,
        profile,
        repartition,
        report,
        simulate,
        stop,
        trace,
        train,
    )

    parser = argparse.ArgumentParser(
        prog="adaptipe", description="Adaptive pipeline-parallel training for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # In the order `adaptipe --help` lists them.
    for command in (
        profile,
        link,
        plan,
        simulate,
        train,
        inject,
        hosts,
        collect,
        japsp,
        monitor,
        report,
        stop,
        repartition,
        adapt,
        manage,
        trace,
        controllers,
        prepare,
        cluster,
    ):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except AdaptipeError as exc:
        print(f"adaptipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt as exc:
        from adaptipe.runtime.launch import Terminated

        notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", []))
        if isinstance(exc, Terminated):
            print(f"terminated{notes}", file=sys.stderr)
            return 128 + signal.SIGTERM
        print(f"interrupted{notes}", file=sys.stderr)
        return 130
