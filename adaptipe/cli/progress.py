"""The training progress bar that ``adaptipe train``, ``adaptipe manage`` and the demo
show: iterations done, loss, samples/s, time (on stderr)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ProgressFn", "training_progress"]

ProgressFn = Callable[[dict[str, Any], int], None]


@contextlib.contextmanager
def training_progress(
    title: str = "train", *, console: Any = None, disable: bool = False, remaining: bool = True
) -> Iterator[ProgressFn]:
    """A bar fed by merged metrics records: yields the ``on_iteration`` callback that
    `adaptipe.runtime.train` and `adaptipe.runtime.manage.manage` take."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns: list[ProgressColumn] = [
        TextColumn(f"[bold]{title}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} samples/s"),
        TimeElapsedColumn(),
    ]
    if remaining:
        columns.append(TimeRemainingColumn())
    console = console if console is not None else Console(stderr=True)
    with Progress(*columns, console=console, disable=disable) as bar:
        task = bar.add_task(title, total=None, loss="-", rate="-")

        def on_iteration(rec: dict[str, Any], total: int) -> None:
            loss = "-" if rec["loss"] is None else f"{rec['loss']:.4f}"
            rate = "-" if rec["samples_per_s"] is None else f"{rec['samples_per_s']:.0f}"
            bar.update(task, total=total, completed=rec["iteration"] + 1, loss=loss, rate=rate)

        yield on_iteration
