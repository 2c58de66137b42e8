"""The run directory: every plan a run used, its metrics, errors and checkpoints.

```
RUN_DIR/
  config.toml        the file the user gave (copy)
  config.json        the resolved config: every default filled in
  profile.json       when a planner needed one
  partition.json     the partition used
  schedule.json      the schedule used (all workers' instruction lists)
  metrics.jsonl      one merged record per iteration (loss, samples/s, per-stage times)
  telemetry.jsonl    every telemetry record the collector accepted (stage stats, device
                     samples, events)
  summary.json       the final summary
  stages/stage-N.jsonl   what worker N reported, line by line
  logs/stage-N.log       worker N's stdout and stderr
  errors/stage-N.txt     why worker N failed (first line: the cause)
  trace/stage-N.json     worker N's timeline of the traced iterations, if any
  checkpoints/iter-NNNNNN/, checkpoints/latest.json
```
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.schedule.types import Schedule
from adaptipe.serial import atomic_write_text, load_json_file, read_json, write_json

if TYPE_CHECKING:
    from adaptipe.runtime.config import RunConfig

__all__ = ["RunDir"]


class RunDir:
    """Paths and typed readers/writers for one run directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    # paths
    @property
    def config_json(self) -> Path:
        return self.root / "config.json"

    @property
    def partition_json(self) -> Path:
        return self.root / "partition.json"

    @property
    def schedule_json(self) -> Path:
        return self.root / "schedule.json"

    @property
    def profile_json(self) -> Path:
        return self.root / "profile.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def telemetry(self) -> Path:
        return self.root / "telemetry.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def trace(self) -> Path:
        return self.root / "trace"

    def trace_file(self, stage: int) -> Path:
        return self.trace / f"stage-{stage}.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_dir(self, iteration: int) -> Path:
        return self.checkpoints / f"iter-{iteration:06d}"

    def stage_metrics(self, stage: int, *, create: bool = True) -> Path:
        """A stage's report file; ``create`` makes its folder (for the writer)."""
        path = self.root / "stages" / f"stage-{stage}.jsonl"
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def log(self, stage: int) -> Path:
        path = self.root / "logs" / f"stage-{stage}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def error(self, stage: int) -> Path:
        return self.root / "errors" / f"stage-{stage}.txt"

    # writers
    def write_plans(
        self,
        *,
        config: RunConfig,
        partition: Partition,
        schedule: Schedule,
        profile: Profile | None,
        config_source: Path | None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if (
            config_source is not None
            and config_source.resolve() != (self.root / "config.toml").resolve()
        ):
            shutil.copyfile(config_source, self.root / "config.toml")
        write_json(self.config_json, config.to_dict())
        write_json(self.partition_json, partition.to_json())
        write_json(self.schedule_json, schedule.to_json())
        if profile is not None:
            write_json(self.profile_json, profile.to_json())
        for name, data in (extra or {}).items():
            write_json(self.root / name, data)

    def write_error(self, stage: int, cause: str, details: str) -> None:
        atomic_write_text(self.error(stage), f"{cause}\n\n{details}")

    def clear_stage_files(self) -> None:
        """Forget a previous attempt's per-stage reports and errors (resume starts anew)."""
        for folder in ("stages", "errors"):
            shutil.rmtree(self.root / folder, ignore_errors=True)

    @staticmethod
    def drop_torn_line(path: Path) -> None:
        """Cut a JSON-lines log back to its last complete line: a manager killed while
        writing leaves half a line, which the next launch's records would run into."""
        if not path.exists():
            return
        with path.open("rb+") as fh:
            data = fh.read()
            if data and not data.endswith(b"\n"):
                fh.truncate(data.rfind(b"\n") + 1)

    def forget_metrics_from(self, iteration: int) -> None:
        """Drop the metrics of iterations ``iteration`` and later: a run resumed from
        that checkpoint trains them again, and the report must show them once."""
        if not self.metrics.exists():
            return
        lines = self.metrics.read_text().splitlines(keepends=True)
        keep = [line for line in lines if _iteration_of(line) < iteration]
        if len(keep) != len(lines):
            atomic_write_text(self.metrics, "".join(keep))

    # readers
    def read_config(self) -> RunConfig:
        from adaptipe.runtime.config import RunConfig

        data = read_json(self.config_json)
        sweep = data.get("sweep") if isinstance(data, dict) else None
        for job in sweep.get("jobs") or [] if isinstance(sweep, dict) else []:
            # Written before jobs had a data_seed: their data order followed their seed.
            if isinstance(job, dict) and "seed" in job and "data_seed" not in job:
                job["data_seed"] = job["seed"]
        # Saved by this or an older version: checked as then (`RunConfig.from_dict`).
        return RunConfig.from_dict(data, source=str(self.config_json), strict=False)

    def read_partition(self) -> Partition:
        return load_json_file(self.partition_json, Partition.from_json)

    def read_schedule(self) -> Schedule:
        return load_json_file(self.schedule_json, Schedule.from_json)

    def read_error(self, stage: int) -> str | None:
        path = self.error(stage)
        if not path.exists():
            return None
        return path.read_text().split("\n", 1)[0]

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]


def _iteration_of(line: str) -> float:
    """A metrics line's iteration (a torn or foreign line sorts first: it is kept)."""
    try:
        value = json.loads(line).get("iteration", -1)
    except (ValueError, AttributeError):
        return -1
    return value if isinstance(value, int) else -1
