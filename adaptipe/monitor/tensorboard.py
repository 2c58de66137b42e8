"""TensorBoard event files for a run: one TensorBoard run per job, so a sweep's jobs
compare side by side, and one for the pipeline.

``RUN_DIR/tensorboard/<job name>/`` gets ``loss``, ``val_loss`` (at halving rungs and
the end), ``lr`` and ``samples_per_s`` (the job's samples over the iteration's span);
``RUN_DIR/tensorboard/pipeline/`` gets the merged ``samples_per_s`` and
``iteration_s`` and, per stage, ``stage<k>/compute_s``, ``wait_s`` and ``comm_s``.
``tensorboard --logdir RUN_DIR/tensorboard`` shows them.

The sink reads the same merged records as ``metrics.jsonl`` (plain dicts) and the
control events, so `export` can also write them after the fact from a finished run's
files. An iteration's scalars of one TensorBoard run go out as one event (one
``Summary`` with a value per tag, through torch's ``FileWriter``): ``SummaryWriter.
add_scalar`` made an event per scalar, 71 us of CPU each with tensorboard's pure-Python
CRC, and the manager of a 4-job array writes 20 an iteration on the core it may share
with a stage; one event per run cost 13 us a scalar, and the manager's loop on
bench_adaptive's 4-job CNN 1.23-1.30 ms of CPU an iteration against 1.76-2.01 (0.72-0.83
without TensorBoard; session 24). It needs the ``tensorboard`` package (a dependency);
where it is missing, `TensorBoardSink.open` says so once and returns None, and training
goes on.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["TensorBoardSink", "export", "job_dir_name"]

_STAGE_FIELDS = ("compute_s", "wait_s", "comm_s")
LrOf = Callable[[str, int], float | None]


def job_dir_name(name: str) -> str:
    """A job's name as a folder name (slashes and other path-unsafe characters go)."""
    cleaned = re.sub(r"[^A-Za-z0-9=.,_+-]", "_", name).strip(".")
    return cleaned or "job"


class TensorBoardSink:
    """Writes merged iteration records and control events as TensorBoard scalars."""

    def __init__(
        self,
        root: Path,
        jobs: Mapping[str, str],
        *,
        batch_sizes: Mapping[str, int] | None = None,
        lr_of: LrOf | None = None,
    ) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import FileWriter

        self.root = root
        self.jobs = dict(jobs)  # job key (sweep index as a string) -> name
        self.batch_sizes = dict(batch_sizes or {})
        self.lr_of = lr_of
        self._writer, self._summary = FileWriter, Summary
        self._writers: dict[str, Any] = {}
        self._runs: dict[str, str] = {}  # job key -> its run's folder name

    @classmethod
    def open(
        cls,
        root: Path,
        jobs: Mapping[str, str],
        *,
        batch_sizes: Mapping[str, int] | None = None,
        lr_of: LrOf | None = None,
    ) -> TensorBoardSink | None:
        """A sink, or None (with a warning) where the tensorboard package is missing."""
        try:
            return cls(root, jobs, batch_sizes=batch_sizes, lr_of=lr_of)
        except ImportError as exc:
            warnings.warn(
                f"no TensorBoard files: {exc} (pip install tensorboard, or set "
                "[train] tensorboard = false)",
                stacklevel=2,
            )
            return None

    def _get(self, run: str) -> Any:
        writer = self._writers.get(run)
        if writer is None:
            writer = self._writers[run] = self._writer(str(self.root / run), flush_secs=10)
        return writer

    def _run(self, key: str) -> str:
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = job_dir_name(self.jobs.get(key, f"job{key}"))
        return run

    def _scalars(self, run: str, step: int, values: Iterable[tuple[str, Any]]) -> None:
        """One event for ``run`` at ``step`` with each finite value under its tag."""
        kept = [
            self._summary.Value(tag=tag, simple_value=float(v))
            for tag, v in values
            if isinstance(v, int | float) and math.isfinite(v)
        ]
        if kept:
            self._get(run).add_summary(self._summary(value=kept), step)

    def iteration(self, row: Mapping[str, Any]) -> None:
        """One merged metrics record (`adaptipe.runtime.metrics_merge`)."""
        step = int(row["iteration"])
        span = row.get("iteration_s")
        losses = row.get("losses") or {"0": row.get("loss")}
        for key, loss in losses.items():
            values = [("loss", loss)]
            if self.lr_of is not None:
                values.append(("lr", self.lr_of(key, step)))
            size = self.batch_sizes.get(key)
            if size and isinstance(span, int | float) and span > 0 and loss is not None:
                values.append(("samples_per_s", size / span))
            self._scalars(self._run(key), step, values)
        pipeline = [("samples_per_s", row.get("samples_per_s")), ("iteration_s", span)]
        for stage, stats in enumerate(row.get("stages") or ()):
            pipeline += [(f"stage{stage}/{name}", stats.get(name)) for name in _STAGE_FIELDS]
        self._scalars("pipeline", step, pipeline)

    def control(self, event: Mapping[str, Any]) -> None:
        """A control event: halving rungs carry the jobs' validation losses."""
        val = event.get("val_loss")
        if event.get("event") == "halving" and isinstance(val, Mapping):
            self.validation(int(event["iteration"]), val)

    def validation(self, step: int, losses: Mapping[str, Any]) -> None:
        for key, loss in losses.items():
            self._scalars(self._run(key), step, [("val_loss", loss)])

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def _lines(path: Path) -> Iterable[dict[str, Any]]:
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a run still going


def export(
    metrics: Path,
    control: Path,
    root: Path,
    jobs: Mapping[str, str],
    *,
    batch_sizes: Mapping[str, int] | None = None,
    lr_of: LrOf | None = None,
) -> int:
    """Write a finished run's ``metrics.jsonl`` and ``control.jsonl`` to ``root``;
    the number of iterations written."""
    sink = TensorBoardSink(root, jobs, batch_sizes=batch_sizes, lr_of=lr_of)
    count = 0
    for row in _lines(metrics):
        sink.iteration(row)
        count += 1
    for event in _lines(control):
        sink.control(event)
    sink.close()
    return count
