"""``adaptipe collect-interference``: the dataset DynPipe's interference model learns from.

DynPipe (§V-A) trains a random forest offline: a typical training task runs solo and then
under various levels of injected interference, and each measurement becomes one sample
whose inputs are the device status and the task's characteristics and whose target is the
iteration-time ratio to the solo run. Here the task is a *stage*: a random contiguous
slice of a zoo model doing forward, backward and an SGD step on one micro-batch, in a
child process pinned to one core with one thread (`adaptipe.inject.stage_probe`). Each
row pairs a solo (baseline) measurement with the interfered one taken right after it,
because the machine is noisy:
``slowdown = median interfered step time / median baseline step time``. A step time is
the mean over a window of whole hog duty-cycle periods (the hogs are busy a fraction of
every 100 ms), so a window sees the hog's average share and not one phase of it.

Device features come from `sample_device` and `feature_vector` inside the measuring
process during the interfered windows, so the model learns from exactly what a running
stage reports. Rows are appended (and flushed) as they are measured; the JSON sidecar
describes every column, the machine and the run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from adaptipe.errors import PlanError
from adaptipe.inject.runner import InjectionError, inject
from adaptipe.inject.stage_probe import (
    KIND_VOCABULARY,
    STAGE_FEATURES,
    VARIANTS,
    CollectError,
    StageProbe,
    start_probe,
)
from adaptipe.monitor import features as features_module
from adaptipe.monitor.features import FEATURES
from adaptipe.serial import write_json

__all__ = [
    "COLUMNS",
    "KIND_VOCABULARY",
    "STAGE_FEATURES",
    "CollectError",
    "DatasetSummary",
    "Level",
    "add_collect_parser",
    "collect_interference",
    "default_levels",
    "run_collect_command",
    "sidecar_path",
]

DATASET_KIND = "adaptipe-interference-dataset"
DATASET_VERSION = 1
MODELS = ("mlp", "gpt", "cnn")
_HOG_PERIOD_S = 0.1  # the hogs' duty-cycle period (adaptipe.inject.injectors)
_SETTLE_S = 0.02  # after a hog is ready, before the interfered windows

Where = Literal["none", "same", "other"]
ProgressFn = Callable[[float, float, int, str], None]  # (elapsed_s, total_s, rows, note)


@dataclass(frozen=True, slots=True, kw_only=True)
class Level:
    """One interference level: CPU hogs on the stage's core or another one, memory, or both."""

    hog_where: Where = "none"
    hog_threads: int = 0
    hog_intensity: float = 0.0
    hog_method: str = "none"  # spin | matmul when there is a hog
    memory_gib: float = 0.0

    def __post_init__(self) -> None:
        hog = (self.hog_threads, self.hog_intensity, self.hog_method)
        if self.hog_where == "none" and hog != (0, 0.0, "none"):
            raise PlanError(f"level {self}: a level without a hog must leave its hog fields unset")
        if self.hog_where not in ("none", "same", "other"):
            raise PlanError(f"level hog_where {self.hog_where!r} unknown (allowed: same, other)")
        if self.hog_where != "none" and (
            self.hog_threads < 1
            or not 0 < self.hog_intensity <= 1
            or self.hog_method not in ("spin", "matmul")
        ):
            raise PlanError(
                f"level {self}: a hog needs threads >= 1, intensity in (0, 1] and method spin or matmul"
            )
        if not self.memory_gib >= 0:
            raise PlanError(f"level memory_gib must be >= 0 (got {self.memory_gib})")

    @property
    def name(self) -> str:
        parts = []
        if self.hog_where != "none":
            parts.append(
                f"cpu-{self.hog_where}-{self.hog_method}-{self.hog_threads}x{self.hog_intensity:.2f}"
            )
        if self.memory_gib:
            parts.append(f"mem-{self.memory_gib:g}GiB")
        return "+".join(parts) or "none"

    def columns(self) -> dict[str, Any]:
        return {
            "level": self.name,
            "hog_where": self.hog_where,
            "hog_threads": self.hog_threads,
            "hog_intensity": self.hog_intensity,
            "hog_method": self.hog_method,
            "memory_gib": self.memory_gib,
        }

    def injections(self, core: int, other: int | None) -> list[tuple[str, dict[str, Any]]]:
        """The ``inject(kind, **fields)`` calls that put this level in place."""
        out: list[tuple[str, dict[str, Any]]] = []
        if self.hog_where != "none":
            target = core if self.hog_where == "same" else other
            if target is None:
                raise PlanError(f"level {self.name} needs a second core; this process has one")
            hog = {"threads": self.hog_threads, "intensity": self.hog_intensity}
            out.append(("cpu_hog", {"cores": [target], "method": self.hog_method, **hog}))
        if self.memory_gib:
            out.append(("memory", {"gib": self.memory_gib}))
        return out


def default_levels(*, other_core: bool = True, memory_gib: float = 0.5) -> tuple[Level, ...]:
    """none; hogs on the stage's core (1-2 threads, 4 intensities, spin and matmul); hogs
    on another core; memory pressure; and hog + memory combinations."""
    levels = [Level()]
    for method in ("spin", "matmul"):
        for threads in (1, 2):
            for intensity in (0.25, 0.5, 0.75, 1.0):
                levels.append(Level(hog_where="same", hog_threads=threads,
                                    hog_intensity=intensity, hog_method=method))  # fmt: skip
        if other_core:
            levels.append(
                Level(hog_where="other", hog_threads=1, hog_intensity=1.0, hog_method=method)
            )
    levels.append(Level(memory_gib=memory_gib))
    for method, threads, intensity in (("spin", 1, 0.5), ("matmul", 2, 1.0)):
        hog = Level(hog_where="same", hog_threads=threads, hog_intensity=intensity,
                    hog_method=method, memory_gib=memory_gib)  # fmt: skip
        levels.append(hog)
    return tuple(levels)


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


# ---- the collection ---------------------------------------------------------------------------


def _check(
    out: Path,
    minutes: float,
    models: Sequence[str],
    levels_per_stage: int,
    windows: int,
    window_s: float,
) -> None:
    if isinstance(minutes, bool) or not isinstance(minutes, int | float) or not 0 < minutes < 1e6:
        raise PlanError(f"minutes must be a finite number > 0 (got {minutes!r})")
    if not models:
        raise PlanError(f"models must name at least one model (allowed: {', '.join(MODELS)})")
    for name in models:
        if name not in MODELS:
            raise PlanError(f"unknown model {name!r} (allowed: {', '.join(MODELS)})")
    if out.suffix != ".csv":
        raise PlanError(f"out {str(out)!r} must be a .csv file (the sidecar is its .json)")
    if levels_per_stage < 1:
        raise PlanError(f"levels_per_stage must be >= 1 (got {levels_per_stage})")
    if windows < 1 or not 0 < window_s < 60:
        raise PlanError(f"windows must be >= 1 and window_s in (0, 60) (got {windows}, {window_s})")


def _machine(core: int, other: int | None, hello: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {"hostname": platform.node(), "platform": platform.platform()}
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
        info["cpu"] = names[0] if names else platform.processor()
    with contextlib.suppress(OSError, ValueError, IndexError):
        info["mem_total_bytes"] = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    return info | {
        "num_cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "stage_core": core,
        "other_core": other,
        "stage_threads": 1,
        "python": platform.python_version(),
        "torch": hello["torch"],
    }


def _describe(column: str) -> str:
    """A column's meaning; device features take theirs from `adaptipe.monitor.features`."""
    if column in _DESCRIPTIONS:
        return _DESCRIPTIONS[column]
    for line in (features_module.__doc__ or "").splitlines():
        name, _, meaning = line.partition(" ")
        if name == column and meaning.strip():
            return f"device: {meaning.strip()}"
    return "device feature"


class _Dataset:
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


def _pair(
    worker: StageProbe, level: Level, core: int, other: int | None, measure: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], set[int]]:
    """Baseline then interfered measurement; every injection has ended when this returns."""
    base = worker.request(measure, "measured")
    pids: set[int] = set()
    with ExitStack() as hogs:
        for kind, fields in level.injections(core, other):
            pids.update(hogs.enter_context(inject(kind, **fields)).pids())
        if pids:
            time.sleep(_SETTLE_S)
        hit = worker.request(measure, "measured")
    return base, hit, pids


def collect_interference(
    out: Path,
    *,
    minutes: float,
    seed: int,
    models: Sequence[str] = MODELS,
    progress: ProgressFn | None = None,
    levels: Sequence[Level] | None = None,
    levels_per_stage: int = 6,
    windows: int = 4,
    window_s: float = _HOG_PERIOD_S,
) -> DatasetSummary:
    """Measure stages under interference for about `minutes`; write ``out`` and its sidecar.

    Each stage (a random slice of the next model at a random micro-batch size) is measured
    under "none" plus the next ``levels_per_stage - 1`` levels of a shuffled deck of
    `levels` (default `default_levels`), so every level comes up equally often. The first
    stage is always measured in full, so even a tiny budget yields rows; after that no
    measurement starts past the deadline. ``out`` is overwritten.

    Args:
        progress: called as ``progress(elapsed_s, total_s, rows, note)`` after each row.
        levels: the levels to sweep; "none" (`Level()`) among them is measured on every stage.
        windows: timing windows per measurement (the median is kept).
        window_s: the shortest window; it grows in whole hog periods to hold >= 3 steps.

    Raises:
        PlanError: a bad argument, or a level this machine cannot run (one core).
        CollectError: the measuring process failed.
    """
    out = Path(out)
    _check(out, minutes, models, levels_per_stage, windows, window_s)
    affinity = sorted(os.sched_getaffinity(0))
    core, other = affinity[-1], (affinity[0] if len(affinity) > 1 else None)
    catalogue = (
        tuple(levels) if levels is not None else default_levels(other_core=other is not None)
    )
    if not catalogue:
        raise PlanError("levels must name at least one level (e.g. Level() for none)")
    for level in catalogue:
        level.injections(core, other)  # a level that cannot run here fails now
    always = [lv for lv in catalogue if lv.name == "none"][:1]
    rest = [lv for lv in catalogue if lv.name != "none"]
    rng = random.Random(seed)
    run = {"seed": seed, "minutes": minutes, "models": list(models), "windows": windows}
    run |= {"window_s": window_s, "levels_per_stage": levels_per_stage}
    run |= {"levels": [lv.name for lv in catalogue]}
    run["started_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    total_s, drawn, deck, pids = minutes * 60.0, 0, list[Level](), set[int]()
    data = _Dataset(out, run)
    try:
        with start_probe(core) as worker:
            pids.add(worker.pid)
            data.meta["machine"] = _machine(core, other, worker.hello)
            data.write_sidecar("running")
            while drawn == 0 or data.elapsed() < total_s:
                model = models[drawn % len(models)]
                drawn += 1
                pick = rng.randrange(len(VARIANTS[model]))
                config, microbatches = VARIANTS[model][pick]
                n = worker.hello["layers"][model][pick]
                start = rng.randrange(n)
                stop, mb = rng.randint(start + 1, n), rng.choice(microbatches)
                request = {"op": "stage", "model": model, "config": config, "seed": seed}
                built = worker.request(
                    request | {"start": start, "stop": stop, "microbatch": mb}, "stage"
                )
                window = max(1, math.ceil(3 * built["step_s"] / window_s)) * window_s
                measure = {"op": "measure", "windows": windows, "window_s": window}
                chosen = list(always)
                while len(chosen) < levels_per_stage and rest:
                    deck = deck or rng.sample(rest, len(rest))
                    chosen.append(deck.pop())
                rng.shuffle(chosen)
                stage = {"model": model, "layer_start": start, "layer_stop": stop, "core": core}
                stage["variant"] = (
                    ";".join(f"{k}={v}" for k, v in sorted(config.items())) or "default"
                )
                before = data.rows
                for level in chosen:
                    if drawn > 1 and data.elapsed() >= total_s:
                        break
                    try:
                        base, hit, hogs = _pair(worker, level, core, other, measure)
                    except InjectionError as exc:
                        data.failures.append(f"{level.name}: {exc}")
                        continue
                    pids |= hogs
                    baseline = statistics.median(base["step_s"])
                    interfered = statistics.median(hit["step_s"])
                    row = dict(zip(FEATURES, hit["features"], strict=True))
                    row |= built["features"] | level.columns() | stage
                    row |= {"baseline_step_s": baseline, "interfered_step_s": interfered}
                    row |= {"window_s": window, "row": data.rows, "time_s": round(time.time(), 3)}
                    row["slowdown"] = interfered / baseline
                    data.add(row)
                    if progress is not None:
                        note = (
                            f"{model}[{start}:{stop}] mb={mb} {level.name}: x{row['slowdown']:.2f}"
                        )
                        progress(data.elapsed(), total_s, data.rows, note)
                data.stages += 1 if data.rows > before else 0
    except KeyboardInterrupt:
        data.write_sidecar("interrupted")
        raise
    except BaseException as exc:
        data.write_sidecar(f"failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        data.close()
    data.write_sidecar("complete")
    return DatasetSummary(
        path=out,
        sidecar=data.sidecar,
        rows=data.rows,
        stages=data.stages,
        wall_s=round(data.elapsed(), 3),
        columns=COLUMNS,
        slowdown_by_level=data.means(),
        failures=tuple(data.failures),
        pids=tuple(sorted(pids)),
    )


# ---- CLI ------------------------------------------------------------------------------------


def add_collect_parser(
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
    p.set_defaults(func=run_collect_command)
    return p


def run_collect_command(args: argparse.Namespace) -> int:
    """Collect with a progress bar, then print rows and the mean slowdown of every level."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

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
