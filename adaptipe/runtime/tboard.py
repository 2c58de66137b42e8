"""The run's TensorBoard files (``[train] tensorboard``), from its config: one
TensorBoard run per job (its name, batch size and learning rate as the schedule sets
it) and one for the pipeline (`adaptipe.monitor.tensorboard`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adaptipe.monitor.tensorboard import TensorBoardSink
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir

__all__ = ["final_validation", "open_sink", "with_sink"]


def open_sink(run: RunDir, cfg: RunConfig) -> TensorBoardSink | None:
    """A sink writing into ``RUN_DIR/tensorboard/``, or None when turned off (or the
    tensorboard package is missing: said once)."""
    if not cfg.train.tensorboard:
        return None
    jobs = {str(j.index): j.name for j in cfg.jobs}
    if len(cfg.jobs) == 1:
        jobs = {"0": run.root.name}

    def lr_of(key: str, step: int) -> float | None:
        index = int(key)
        if not 0 <= index < len(cfg.jobs):
            return None
        opt = cfg.jobs[index].optimizer
        schedule = opt.lr_schedule()
        return float(opt.lr if schedule is None else schedule.lr(opt.lr, step))

    return TensorBoardSink.open(
        run.root / "tensorboard",
        jobs,
        batch_sizes={str(j.index): j.batch_size for j in cfg.jobs},
        lr_of=lr_of,
    )


def with_sink(
    on_iteration: Callable[[dict[str, Any], int], None] | None, sink: TensorBoardSink | None
) -> Callable[[dict[str, Any], int], None] | None:
    """``on_iteration`` that also writes each merged record to ``sink``."""
    if sink is None:
        return on_iteration

    def both(rec: dict[str, Any], total: int) -> None:
        sink.iteration(rec)
        if on_iteration is not None:
            on_iteration(rec, total)

    return both


def final_validation(
    run: RunDir, cfg: RunConfig, ranked: list[dict[str, Any]], iteration: int
) -> None:
    """The sweep's final validation losses (`rank_jobs`) at ``iteration``."""
    sink = open_sink(run, cfg)
    if sink is None:
        return
    losses = {str(row["job"]): row.get("val_loss") for row in ranked if "job" in row}
    sink.validation(iteration, losses)
    sink.close()
