"""The dataset DynPipe's interference model learns from (``adaptipe collect-interference``).

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
describes every column, the machine and the run (`adaptipe.inject.dataset`).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from adaptipe.errors import PlanError
from adaptipe.inject.dataset import COLUMNS, DatasetSummary, DatasetWriter, sidecar_path
from adaptipe.inject.runner import InjectionError, inject
from adaptipe.inject.stage_probe import (
    KIND_VOCABULARY,
    STAGE_FEATURES,
    VARIANTS,
    CollectError,
    StageProbe,
    start_probe,
)
from adaptipe.monitor.features import FEATURES

__all__ = [
    "COLUMNS",
    "KIND_VOCABULARY",
    "STAGE_FEATURES",
    "CollectError",
    "DatasetSummary",
    "Level",
    "collect_interference",
    "default_levels",
    "sidecar_path",
]

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


class _Deck:
    """The levels each stage is measured under: "none" always, then the next ones of a
    shuffled deck of the others, so that every level comes up equally often."""

    def __init__(self, catalogue: Sequence[Level], rng: random.Random, *, per_stage: int) -> None:
        self.always = [lv for lv in catalogue if lv.name == "none"][:1]
        self.rest = [lv for lv in catalogue if lv.name != "none"]
        self.rng, self.per_stage = rng, per_stage
        self.deck: list[Level] = []

    def deal(self) -> list[Level]:
        chosen = list(self.always)
        while len(chosen) < self.per_stage and self.rest:
            self.deck = self.deck or self.rng.sample(self.rest, len(self.rest))
            chosen.append(self.deck.pop())
        self.rng.shuffle(chosen)
        return chosen


@dataclass(frozen=True, slots=True, kw_only=True)
class _Stage:
    """A random slice of a zoo model at a random micro-batch size, built in the probe."""

    label: str  # model[start:stop] mb=N
    columns: dict[str, Any]  # its meta columns
    features: dict[str, Any]  # its STAGE_FEATURES
    window: float  # timing window: whole hog periods, >= 3 steps
    measure: dict[str, Any]  # the probe's measure request

    @classmethod
    def draw(
        cls,
        worker: StageProbe,
        rng: random.Random,
        model: str,
        *,
        seed: int,
        core: int,
        windows: int,
        window_s: float,
    ) -> _Stage:
        pick = rng.randrange(len(VARIANTS[model]))
        config, microbatches = VARIANTS[model][pick]
        n = worker.hello["layers"][model][pick]
        start = rng.randrange(n)
        stop, mb = rng.randint(start + 1, n), rng.choice(microbatches)
        request = {"op": "stage", "model": model, "config": config, "seed": seed}
        built = worker.request(request | {"start": start, "stop": stop, "microbatch": mb}, "stage")
        window = max(1, math.ceil(3 * built["step_s"] / window_s)) * window_s
        columns = {"model": model, "layer_start": start, "layer_stop": stop, "core": core}
        columns["variant"] = ";".join(f"{k}={v}" for k, v in sorted(config.items())) or "default"
        return cls(
            label=f"{model}[{start}:{stop}] mb={mb}",
            columns=columns,
            features=built["features"],
            window=window,
            measure={"op": "measure", "windows": windows, "window_s": window},
        )

    def row(
        self, level: Level, base: dict[str, Any], hit: dict[str, Any], *, number: int
    ) -> dict[str, Any]:
        """The dataset row of a baseline and an interfered measurement under ``level``."""
        baseline = statistics.median(base["step_s"])
        interfered = statistics.median(hit["step_s"])
        row = dict(zip(FEATURES, hit["features"], strict=True))
        row |= self.features | level.columns() | self.columns
        row |= {"baseline_step_s": baseline, "interfered_step_s": interfered}
        row |= {"window_s": self.window, "row": number, "time_s": round(time.time(), 3)}
        row["slowdown"] = interfered / baseline
        return row


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
    rng = random.Random(seed)
    deck = _Deck(catalogue, rng, per_stage=levels_per_stage)
    run = {"seed": seed, "minutes": minutes, "models": list(models), "windows": windows}
    run |= {"window_s": window_s, "levels_per_stage": levels_per_stage}
    run |= {"levels": [lv.name for lv in catalogue]}
    run["started_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    total_s, drawn, pids = minutes * 60.0, 0, set[int]()
    data = DatasetWriter(out, run)
    try:
        with start_probe(core) as worker:
            pids.add(worker.pid)
            data.meta["machine"] = _machine(core, other, worker.hello)
            data.write_sidecar("running")
            while drawn == 0 or data.elapsed() < total_s:
                model = models[drawn % len(models)]
                drawn += 1
                stage = _Stage.draw(
                    worker, rng, model, seed=seed, core=core, windows=windows, window_s=window_s
                )
                before = data.rows
                for level in deck.deal():
                    if drawn > 1 and data.elapsed() >= total_s:
                        break
                    try:
                        base, hit, hogs = _pair(worker, level, core, other, stage.measure)
                    except InjectionError as exc:
                        data.failures.append(f"{level.name}: {exc}")
                        continue
                    pids |= hogs
                    row = stage.row(level, base, hit, number=data.rows)
                    data.add(row)
                    if progress is not None:
                        note = f"{stage.label} {level.name}: x{row['slowdown']:.2f}"
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
