"""How ``adaptipe train`` prints a run's summary: the result line, the per-stage table
and, for a job-array, how it was scheduled and its jobs ranked by validation loss."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from adaptipe.runtime import TrainSummary

__all__ = ["print_summary"]


def print_summary(summary: TrainSummary) -> None:
    """Print ``summary`` to stdout for a person (``--json`` prints ``summary.to_json()``)."""
    from rich.console import Console

    out = Console()
    done = summary.start_iteration + summary.iterations
    loss = "-" if summary.final_loss is None else f"{summary.final_loss:.4f}"
    if summary.jobs:  # a job-array: the last iteration's mean over the jobs still training
        loss += " (mean over the jobs training at the end; each job's below)"
    out.print(
        f"trained iterations {summary.start_iteration}..{done} in {summary.wall_s:.1f} s: "
        f"final loss {loss}, {summary.samples_per_s:.0f} samples/s (steady state)",
        soft_wrap=not out.is_terminal,  # a log keeps the sentence on one line
    )
    if summary.stages:
        _print_stages(out, summary.stages)
    if summary.jobs:
        _print_array_plan(out, Path(summary.run_dir), len(summary.jobs))
        _print_ranking(out, summary.jobs)
    moved = _migrations_said(Path(summary.run_dir))
    if moved:
        out.print(f"layers moved: {moved}", soft_wrap=not out.is_terminal)
    out.print(
        f"run directory: {summary.run_dir}"
        + (f"; checkpoint: {summary.checkpoint}" if summary.checkpoint else "")
    )


def _print_stages(out: Console, stages: Sequence[dict[str, float]]) -> None:
    from rich.table import Table

    table = Table(title="per-stage time per iteration (mean)")
    states = all("resident_jobs" in st for st in stages)  # a job-array
    cols = ["stage", "compute ms", "waiting ms", "communication ms"]
    for col in cols + (["job states resident (max)", "state wait ms (host)"] if states else []):
        table.add_column(col, justify="right")
    for s, st in enumerate(stages):
        cells = [
            str(s),
            f"{st['compute_s'] * 1e3:.1f}",
            f"{st['wait_s'] * 1e3:.1f}",
            f"{st['comm_s'] * 1e3:.1f}",
        ]
        if states:
            cells += [f"{st['resident_jobs']:.0f}", f"{st['state_wait_s'] * 1e3:.1f}"]
        table.add_row(*cells)
    _print_wide(out, table)


def _print_array_plan(out: Console, run_dir: Path, jobs: int) -> None:
    """How the array was scheduled (as `adaptipe prepare` says), and its re-plans."""
    plan = run_dir / "japsp-solution.json"
    if not plan.exists():
        return
    solution = json.loads(plan.read_text())
    rounds = solution.get("window", {}).get("rounds", 1)
    quality = (
        "optimal"
        if solution.get("optimal")
        else f"within {100 * float(solution.get('gap') or 0):.1f}% of its lower bound"
    )
    from adaptipe.japsp.window import ROUND_ORDERS

    order = solution.get("window", {}).get("round_order", "given")
    how = "" if order == "given" else f", in the {ROUND_ORDERS.get(order, order)} round order"
    out.print(
        f"job-array: {jobs} jobs, block order by the {solution['solver']} "
        f"solver ({quality}), windows of {rounds} iteration(s) with all jobs{how} "
        "(see japsp-solution.json)",
        soft_wrap=not out.is_terminal,
    )
    after = _replans_said(run_dir, ROUND_ORDERS)
    if after:
        out.print(f"after stops: {after}", soft_wrap=not out.is_terminal)


def _migrations_said(run_dir: Path) -> str:
    """The run's migrations (from control.jsonl), in one line ("" when none)."""
    import json

    path = run_dir / "control.jsonl"
    if not path.exists():
        return ""
    parts = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") != "migration":
            continue
        at = f"at iteration {event['iteration']} to {event['bounds']}"
        if event["ok"]:
            size = event["bytes"] / 1e6
            parts.append(f"{at} ({size:.2f} MB in {event['seconds'] * 1e3:.0f} ms)")
        else:
            why = "; ".join(event.get("causes", [])) or "unknown"
            parts.append(f"{at} failed, the old partition stayed ({why})")
    return "; ".join(parts)


def _replans_said(run_dir: Path, names: dict[str, str]) -> str:
    """The windows a job-array switched to after stops, in one line ("" when none)."""
    from adaptipe.runtime.control import replans
    from adaptipe.runtime.rundir import RunDir

    parts = []
    for row in replans(RunDir(run_dir)):
        jobs = f"{row['jobs']} job" + ("s" if row["jobs"] != 1 else "")
        order = names.get(row["round_order"], row["round_order"])
        parts.append(
            f"from iteration {row['iteration']}, windows of {row['window']} with {jobs} "
            f"({order} round order)"
        )
    return "; ".join(parts)


def _print_ranking(out: Any, jobs: list[dict[str, Any]]) -> None:
    """The sweep's jobs ranked by validation loss, every job name in full."""
    from rich.table import Table

    ranking = Table(title="jobs ranked by validation loss")
    for col in ("rank", "#", "job", "val loss", "train loss", "stopped"):
        left = col in ("job", "stopped")
        # A terminal folds a long name onto more lines rather than cut it.
        ranking.add_column(col, justify="left" if left else "right", overflow="fold")
    for row in jobs:
        train_loss = "-" if row.get("train_loss") is None else f"{row['train_loss']:.4f}"
        ranking.add_row(
            str(row["rank"]),
            str(row["job"]),  # the index `adaptipe stop` takes, like the name
            row["name"],
            f"{row['val_loss']:.4f}",
            train_loss,
            "- (stop came in the last window)"
            if "stop_unadopted" in row
            else _how_stopped(row.get("stopped")),
        )
    _print_wide(out, ranking)


def _print_wide(out: Any, table: Any) -> None:
    """Print ``table``; into a log or a pipe as wide as it takes (one line per row, no
    cell cut at 80 columns), on a terminal folded to its width."""
    from rich.console import Console
    from rich.measure import Measurement

    if not out.is_terminal:
        wide = Measurement.get(out, out.options.update_width(10_000), table).maximum
        out = Console(file=out.file, width=max(out.width, wide))
    out.print(table)


def _how_stopped(stop: dict[str, Any] | None) -> str:
    """How and when a job stopped: ``halving @ 40``, ``by hand @ 40`` (and the reason
    given to ``adaptipe stop --reason``), or ``-`` for a job that trained to the end.

    The iteration is where the stop took effect. Only halving records the rung it was
    ``decided_at``; its reason ("successive halving at iteration 40") says no more.
    """
    if stop is None:
        return "-"
    halving = stop.get("decided_at") is not None
    at = stop.get("iteration")
    at = stop.get("decided_at") if at is None else at
    cell = "halving" if halving else "by hand"
    if at is not None:
        cell += f" @ {at}"
    reason = str(stop.get("reason", "user"))
    if not halving and reason not in ("user", "by hand"):
        cell += f": {reason}"
    return cell
