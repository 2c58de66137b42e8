"""The interference dataset's files: its columns and what each means, the CSV written one
flushed row at a time, and the JSON sidecar that describes it (`adaptipe.inject.collect`
measures the rows).
"""

from __future__ import annotations

import csv
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptipe.inject.stage_probe import STAGE_FEATURES
from adaptipe.monitor import features as features_module
from adaptipe.monitor.features import FEATURES
from adaptipe.serial import write_json

__all__ = [
    "COLUMNS",
    "DATASET_KIND",
    "DATASET_VERSION",
    "DatasetSummary",
    "DatasetWriter",
    "sidecar_path",
]

DATASET_KIND = "adaptipe-interference-dataset"
DATASET_VERSION = 1

_LEVEL_COLUMNS = ("level", "hog_where", "hog_threads", "hog_intensity", "hog_method", "memory_gib")
_MEASURE_COLUMNS = ("baseline_step_s", "interfered_step_s", "window_s")
_META_COLUMNS = ("row", "time_s", "model", "variant", "layer_start", "layer_stop", "core")
COLUMNS: tuple[str, ...] = (
    *FEATURES, *STAGE_FEATURES, *_LEVEL_COLUMNS, *_MEASURE_COLUMNS, *_META_COLUMNS, "slowdown"
)  # fmt: skip
_DESCRIPTIONS = {
    "stage_params": "parameters in the stage",
    "stage_flops": "FLOPs of one forward + backward on the micro-batch (torch FlopCounterMode)",
    "stage_input_bytes": "bytes of the stage's input activation",
    "stage_activation_bytes": "bytes of the stage's output activation (sent forward)",
    "stage_stash_bytes": "bytes autograd saves for backward, parameters excluded",
    "stage_layers": "layers in the stage",
    "stage_microbatch": "samples per micro-batch",
    "level": "interference level name (none, cpu-WHERE-METHOD-THREADSxINTENSITY, mem-GiB)",
    "hog_where": "where CPU hogs run: none, same (the stage's core), other (another core)",
    "hog_threads": "hog processes (one thread each)",
    "hog_intensity": "busy fraction of every 100 ms per hog",
    "hog_method": "hog load: none, spin (Python loop) or matmul (one-thread numpy)",
    "memory_gib": "GiB of touched memory held by another process",
    "baseline_step_s": "median step time, solo, measured right before (a profile gives this)",
    "interfered_step_s": "median step time under the level",
    "window_s": "length of each timing window (whole hog periods)",
    "row": "row number in this file",
    "time_s": "unix time of the interfered measurement",
    "model": "zoo model name",
    "variant": "model config overrides (name=value;...) or default",
    "layer_start": "first layer of the stage",
    "layer_stop": "one past the stage's last layer",
    "core": "the core the stage is pinned to",
    "slowdown": "label: interfered_step_s / baseline_step_s",
}


def _role(column: str) -> str:
    if column in FEATURES:
        return "device"
    if column in STAGE_FEATURES:
        return "stage"
    if column in _LEVEL_COLUMNS:
        return "level"
    if column in _MEASURE_COLUMNS:
        return "measurement"
    return "label" if column == "slowdown" else "meta"


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetSummary:
    path: Path
    sidecar: Path
    rows: int
    stages: int
    wall_s: float
    columns: tuple[str, ...]
    slowdown_by_level: dict[str, tuple[float, int]]  # level -> (mean slowdown, rows)
    failures: tuple[str, ...] = ()  # levels that could not be put in place (skipped)
    pids: tuple[int, ...] = field(default=(), repr=False)  # every process this run started


def sidecar_path(out: Path) -> Path:
    """The JSON sidecar next to a dataset: ``data/x.csv`` -> ``data/x.json``."""
    return out.with_suffix(".json")


def _describe(column: str) -> str:
    """A column's meaning; device features take theirs from `adaptipe.monitor.features`."""
    if column in _DESCRIPTIONS:
        return _DESCRIPTIONS[column]
    for line in (features_module.__doc__ or "").splitlines():
        name, _, meaning = line.partition(" ")
        if name == column and meaning.strip():
            return f"device: {meaning.strip()}"
    return "device feature"


class DatasetWriter:
    """The CSV (one flushed row per measurement) and its sidecar, kept current."""

    def __init__(self, out: Path, run: dict[str, Any]) -> None:
        self.path, self.sidecar = out, sidecar_path(out)
        self.began = time.monotonic()
        self.rows, self.stages = 0, 0
        self.by_level: dict[str, list[float]] = {}
        self.failures: list[str] = []
        self.meta: dict[str, Any] = {
            "kind": DATASET_KIND,
            "version": DATASET_VERSION,
            "data": out.name,
            "format": "csv",
            "label": "slowdown",
            "features": [*FEATURES, *STAGE_FEATURES],
            "columns": [
                {"name": c, "role": _role(c), "description": _describe(c)} for c in COLUMNS
            ],
            "machine": {},
            "run": run,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        self._fh = out.open("w", newline="")
        self._writer = csv.writer(self._fh)
        self._writer.writerow(COLUMNS)
        self._fh.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def add(self, row: dict[str, Any]) -> None:
        self._writer.writerow([row[c] for c in COLUMNS])
        self._fh.flush()  # an interrupted collection keeps every row measured so far
        self.rows += 1
        self.by_level.setdefault(row["level"], []).append(row["slowdown"])

    def means(self) -> dict[str, tuple[float, int]]:
        return {k: (statistics.fmean(v), len(v)) for k, v in sorted(self.by_level.items())}

    def write_sidecar(self, status: str) -> None:
        done = {"status": status, "rows": self.rows, "stages": self.stages}
        done |= {"wall_s": round(self.elapsed(), 3), "failures": self.failures[:20]}
        done["slowdown_mean_by_level"] = {k: m for k, (m, _) in self.means().items()}
        write_json(self.sidecar, self.meta | {"run": self.meta["run"] | done})

    def close(self) -> None:
        self._fh.close()
