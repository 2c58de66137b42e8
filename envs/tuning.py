"""The baselines' thresholds and margins, tuned on training traces only.

Each tunable baseline has a small grid of settings; `tune_baselines` runs every point
on the training traces (the training families, seeds below the held-out ones) and
keeps, per baseline, the settings with the highest throughput over all of them (total
samples over total seconds). The held-out traces never take part.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from adaptipe.controllers.base import Controller
from adaptipe.controllers.baselines import BASELINES, Straggler, StragglerSettings
from adaptipe.controllers.threshold import Threshold, ThresholdSettings
from adaptipe.envs.episode import EpisodeSettings
from adaptipe.envs.evaluate import run_controller
from adaptipe.envs.heldout import TRAINING_FAMILIES
from adaptipe.envs.trace import Trace

__all__ = ["GRIDS", "Tuned", "training_traces", "tune_baselines"]

Factory = Callable[[], Controller]

GRIDS: dict[str, list[dict[str, Any]]] = {
    "threshold": [
        {"margin": m, "patience": p, "cooldown": c}
        for m, p, c in itertools.product((0.05, 0.1, 0.2, 0.3), (1, 2, 3), (0, 20))
    ],
    "straggler": [{"factor": f} for f in (1.5, 2.0, 3.0)],
}


def _build(name: str, params: dict[str, Any]) -> Factory:
    if name == "threshold":
        return lambda: Threshold(ThresholdSettings(**params))
    if name == "straggler":
        return lambda: Straggler(StragglerSettings(**params))
    raise KeyError(name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tuned:
    """A baseline's chosen settings and what they gave on the training traces."""

    name: str
    params: dict[str, Any]
    samples_per_s: float
    factory: Factory


def training_traces(
    *,
    stages: int,
    iterations: int = 200,
    seeds: int = 2,
    families: Sequence[str] = TRAINING_FAMILIES,
) -> list[Trace]:
    """``seeds`` traces of every training family, seeds 0, 1, ... (all below the
    held-out ones)."""
    from adaptipe.envs.generators import generate

    return [
        generate(family, stages=stages, iterations=iterations, seed=seed)
        for family in families
        for seed in range(seeds)
    ]


def tune_baselines(traces: Sequence[Trace], settings: EpisodeSettings) -> dict[str, Tuned]:
    """Per tunable baseline, the grid point with the highest throughput on ``traces``."""
    out = {}
    for name, grid in GRIDS.items():
        best: Tuned | None = None
        for params in grid:
            factory = _build(name, params)
            samples = seconds = 0.0
            for trace in traces:
                episode = run_controller(factory(), trace, settings, seed=trace.seed or 0)
                samples += sum(r.samples for r in episode.history)
                seconds += sum(r.seconds for r in episode.history)
            rate = samples / seconds
            if best is None or rate > best.samples_per_s:
                best = Tuned(name=name, params=params, samples_per_s=rate, factory=factory)
        assert best is not None
        out[name] = best
    return out


def baseline_factories(tuned: dict[str, Tuned] | None = None) -> dict[str, Factory]:
    """Every baseline (`BASELINES`), the tuned ones with their tuned settings."""
    factories: dict[str, Factory] = dict(BASELINES)
    for name, t in (tuned or {}).items():
        factories[name] = t.factory
    return factories
