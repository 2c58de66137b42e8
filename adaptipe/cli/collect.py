"""``adaptipe collect-interference``: measure zoo stages under injected interference ->
the dataset DynPipe's slowdown model learns from."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from adaptipe.inject.collect import MODELS

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``adaptipe collect-interference`` to the ``adaptipe`` command."""
    p = subparsers.add_parser(
        "collect-interference",
        help="measure zoo stages under injected interference -> dataset for the slowdown model",
    )
    p.add_argument("--out", default="data/interference.csv", help="dataset CSV (and its .json)")
    p.add_argument("--minutes", type=float, default=10.0, help="time budget (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of stage slices and level order")
    p.add_argument("--models", default=",".join(MODELS), help="comma list (default mlp,gpt,cnn)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Collect with a progress bar, then print rows and the mean slowdown of every level."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from adaptipe.inject.collect import collect_interference

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    columns = (
        TextColumn("[bold]collect[/]"),
        BarColumn(),
        TextColumn("{task.fields[rows]} rows"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=Console(stderr=True), disable=args.no_progress) as bar:
        task = bar.add_task("", total=args.minutes * 60.0, rows=0)

        def step(elapsed_s: float, total_s: float, rows: int, note: str) -> None:
            bar.update(task, completed=min(elapsed_s, total_s), rows=rows, description=note)

        summary = collect_interference(
            Path(args.out), minutes=args.minutes, seed=args.seed, models=models, progress=step
        )
    table = Table(
        title=f"{summary.rows} rows from {summary.stages} stages in {summary.wall_s:.0f} s"
    )
    for col in ("level", "rows", "mean slowdown"):
        table.add_column(col, justify="left" if col == "level" else "right")
    for name, (mean, count) in summary.slowdown_by_level.items():
        table.add_row(name, str(count), f"{mean:.2f}")
    Console().print(table)
    print(f"wrote {summary.path} and {summary.sidecar}")
    for failure in summary.failures[:5]:
        print(f"skipped: {failure}", file=sys.stderr)
    return 0
