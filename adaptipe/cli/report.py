"""``adaptipe report``: charts and one self-contained HTML page from a run directory."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``adaptipe report RUN_DIR`` to the ``adaptipe`` command."""
    p = subparsers.add_parser("report", help="charts and an HTML page from a run directory")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--out", help="folder for the PNGs and report.html (default RUN_DIR/report)")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="[LABEL=]RUN_DIR",
        help="also draw this run's throughput (e.g. the static plan under the same "
        "injection); repeatable",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.monitor.report import make_report

    compare = {}
    for item in args.compare:
        label, sep, path = item.partition("=")
        compare[label if sep else Path(item).name] = path if sep else item
    page = make_report(args.run_dir, args.out, compare=compare)
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    print(f"wrote {page} ({', '.join(pngs)})")
    return 0
