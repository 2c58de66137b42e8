"""The interference model's dataset: measured rows from ``adaptipe collect-interference``
and synthetic rows from the trace generators, each tagged with the scenario it came from.

A row is `adaptipe.controllers.interference.features` (the stage's device readings and
its static features) with the slowdown ratio against a solo run as the label, plus what
the *stale-information* baseline would have predicted: the last slowdown measured
before the row. Grouped cross-validation keeps every scenario's rows on one side.

- **Synthetic** (`trace_rows`): one trace per (family, seed) from
  `adaptipe.envs.generators.generate` over `TRAINING_FAMILIES` (the held-out
  ``colocated`` family is never used), seeds below `HELD_OUT_SEED`. Each (iteration,
  stage) is a row: that iteration's device readings and slowdown. The trace draws the
  machine (``num_cpus``, ``mem_total_gib``) and a random contiguous partition of a
  built-in profile (``gpt`` or ``cnn``) for its stage features; the synthetic slowdown
  does not depend on them. Stale: the stage's slowdown at the previous iteration (1.0,
  solo, at the first). Group: the trace.
- **Measured** (`csv_rows`): every row of a collect CSV (`MEASURED`: the ones shipped). Its rows are no time series
  (each is a fresh baseline/interfered pair on a random level), so stale is what a
  controller knew right after a re-partition: the slowdown last measured under the same
  interference level on another stage (1.0 when that level was not seen yet). Group:
  the stage (file, model, variant, layers, micro-batch), so no configuration is on both
  sides of a split (DynPipe's public code split rows 70/30 at random).
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from adaptipe.controllers.interference import StageInfo, features, stage_info
from adaptipe.envs.episode import load_profile
from adaptipe.envs.generators import generate
from adaptipe.envs.heldout import HELD_OUT_SEED, TRAINING_FAMILIES
from adaptipe.errors import PlanError
from adaptipe.inject.dataset import COLUMNS
from adaptipe.monitor.features import FEATURES
from adaptipe.monitor.schema import DeviceSample

__all__ = ["MEASURED", "Dataset", "TraceSpec", "build_dataset", "csv_rows", "trace_rows"]

Array = npt.NDArray[np.float64]

#: The measured rows shipped with the repository (``envs/data/``): ``adaptipe
#: collect-interference`` on the 2-core CPU this project is developed on, and what the
#: shipped forest trains on besides the synthetic traces (docs/interference.md).
MEASURED: tuple[Path, ...] = (Path(__file__).resolve().parent / "data" / "interference-cpu.csv",)


@dataclass(frozen=True, slots=True, kw_only=True)
class Dataset:
    """Rows for the model: inputs ``x``, label ``y``, the stale baseline and the group."""

    x: Array  # (rows, len(INPUTS))
    y: Array  # slowdown ratio against a solo run
    stale: Array  # the last slowdown measured before the row
    groups: tuple[str, ...]  # scenario per row
    sources: tuple[str, ...] = ()  # what the rows came from, for the manifest

    def __len__(self) -> int:
        return len(self.y)

    def digest(self) -> str:
        """sha256 of the rows, labels and groups: what seeded training must reproduce."""
        h = hashlib.sha256()
        for a in (self.x, self.y, self.stale):
            h.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
        h.update("\n".join(self.groups).encode())
        return h.hexdigest()

    @property
    def num_groups(self) -> int:
        return len(set(self.groups))

    @staticmethod
    def join(parts: Sequence[Dataset]) -> Dataset:
        parts = [p for p in parts if len(p)]
        if not parts:
            raise PlanError("interference dataset: no rows")
        return Dataset(
            x=np.concatenate([p.x for p in parts]),
            y=np.concatenate([p.y for p in parts]),
            stale=np.concatenate([p.stale for p in parts]),
            groups=tuple(g for p in parts for g in p.groups),
            sources=tuple(s for p in parts for s in p.sources),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceSpec:
    """Which synthetic traces: ``seeds`` per family of ``families``, each ``iterations``
    long on ``stages`` stages; seeds start at ``first_seed`` (below `HELD_OUT_SEED`)."""

    families: tuple[str, ...] = TRAINING_FAMILIES
    seeds: int = 8
    iterations: int = 300
    stages: int = 4
    first_seed: int = 0

    def __post_init__(self) -> None:
        if self.seeds < 0 or self.iterations < 2 or self.stages < 2:
            raise PlanError(f"trace spec {self}: seeds >= 0, iterations >= 2, stages >= 2")
        if self.first_seed + self.seeds > HELD_OUT_SEED:
            raise PlanError(
                f"trace spec: seeds {self.first_seed}..{self.first_seed + self.seeds - 1} reach "
                f"the held-out seeds (>= {HELD_OUT_SEED})"
            )

    def to_json(self) -> dict[str, object]:
        return {"families": list(self.families), "seeds": self.seeds,
                "iterations": self.iterations, "stages": self.stages,
                "first_seed": self.first_seed}  # fmt: skip


_MACHINES = ((4, 16.0), (8, 32.0), (16, 64.0))  # (num_cpus, mem_total_gib) a trace draws


def trace_rows(family: str, *, seed: int, iterations: int, stages: int) -> Dataset:
    """The rows of one synthetic trace (see the module doc)."""
    rng = np.random.default_rng([seed, 7])  # apart from the generator's own streams
    cpus, mem = _MACHINES[int(rng.integers(len(_MACHINES)))]
    trace = generate(family, stages=stages, iterations=iterations, seed=seed,
                     num_cpus=cpus, mem_total_gib=mem)  # fmt: skip
    profile = load_profile(("gpt", "cnn")[seed % 2])
    cuts = np.sort(rng.choice(np.arange(1, len(profile.layers)), stages - 1, replace=False))
    bounds = (0, *(int(c) for c in cuts), len(profile.layers))
    info = [stage_info(profile, bounds, s) for s in range(stages)]
    slow = trace.slowdowns()
    x = np.empty((iterations * stages, len(FEATURES) + len(StageInfo.NAMES)))
    source: Literal["cpu", "nvml"] = "cpu" if trace.device_source == "cpu" else "nvml"
    for i, row in enumerate(trace.rows):
        for s in range(stages):
            sample = DeviceSample(stage=s, time_s=float(i), source=source, fields=row.device[s])
            x[i * stages + s] = features(sample, info[s])
    stale = np.vstack([np.ones((1, stages)), slow[:-1]])
    return Dataset(
        x=x,
        y=slow.reshape(-1),
        stale=stale.reshape(-1),
        groups=(f"trace:{family}:{seed}",) * (iterations * stages),
    )


def csv_rows(path: str | Path) -> Dataset:
    """The rows of one ``adaptipe collect-interference`` CSV (see the module doc)."""
    where = Path(path)
    try:
        with where.open(newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise PlanError(
                    f"{where}: not a collect-interference CSV: columns {', '.join(missing[:5])} "
                    "missing (write one with `adaptipe collect-interference`)"
                )
            raw = list(reader)
    except OSError as exc:
        raise PlanError(f"{where}: unreadable ({exc})") from None
    xs, ys, stale, groups = [], [], [], []
    last_by_level: dict[str, float] = {}
    for n, r in enumerate(raw, start=2):
        try:
            vec = np.array([float(r[f]) for f in FEATURES])
            info = StageInfo(
                solo_s=float(r["baseline_step_s"]),
                layers=int(r["stage_layers"]),
                input_bytes=float(r["stage_input_bytes"]),
                output_bytes=float(r["stage_activation_bytes"]),
                param_bytes=4.0 * float(r["stage_params"]),  # the zoo trains float32
            )
            y = float(r["slowdown"])
        except (KeyError, ValueError) as exc:
            raise PlanError(f"{where}:{n}: malformed row ({exc})") from None
        xs.append(features(vec, info))
        ys.append(y)
        stale.append(last_by_level.get(r["level"], 1.0))
        last_by_level[r["level"]] = y
        stage = f"{r['model']}:{r['variant']}:{r['layer_start']}-{r['layer_stop']}:{r['stage_microbatch']}"
        groups.append(f"collect:{where.name}:{stage}")
    if not ys:
        raise PlanError(f"{where}: no rows")
    return Dataset(x=np.array(xs), y=np.array(ys), stale=np.array(stale), groups=tuple(groups))


def build_dataset(
    *, spec: TraceSpec | None = TraceSpec(), data: Iterable[str | Path] = ()
) -> Dataset:
    """Synthetic rows from ``spec`` (None: none) joined with every CSV in ``data``."""
    parts: list[Dataset] = []
    sources: list[str] = []
    if spec is not None and spec.seeds:
        for family in spec.families:
            for k in range(spec.seeds):
                seed = spec.first_seed + k
                parts.append(
                    trace_rows(family, seed=seed, iterations=spec.iterations, stages=spec.stages)
                )
        sources.append(f"synthetic traces {spec.to_json()}")
    for path in data:
        parts.append(csv_rows(path))
        sources.append(f"collect-interference {Path(path).name}")
    joined = Dataset.join(parts)
    return Dataset(x=joined.x, y=joined.y, stale=joined.stale, groups=joined.groups,
                   sources=tuple(sources))  # fmt: skip
