"""Controllers judged on traces against the oracle: ``adaptipe controllers eval``.

`run_controller` replays one controller on one trace: the first window on the initial
plan, then at every step the controller decides from the `Observation` the episode's
telemetry gives (the runtime manager's builder) and the episode trains the step on its
decision. `evaluate` does that for every controller on every trace, beside the oracle
(`adaptipe.envs.oracle`), and reports each controller's mean throughput as a fraction
of the oracle's, per trace family, with the spread over the family's seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptipe.controllers.base import Controller
from adaptipe.envs.episode import Episode, EpisodeSettings
from adaptipe.envs.oracle import oracle
from adaptipe.envs.trace import Trace

__all__ = ["ControllerRun", "EvalReport", "evaluate", "plot_report", "run_controller", "warm_steps"]

ControllerFactory = Callable[[], Controller]


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerRun:
    """One controller on one trace."""

    controller: str
    family: str
    seed: int | None
    samples_per_s: float
    switches: int
    switch_s: float
    oracle_samples_per_s: float

    @property
    def fraction(self) -> float:
        return self.samples_per_s / self.oracle_samples_per_s if self.oracle_samples_per_s else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "controller": self.controller,
            "family": self.family,
            "seed": self.seed,
            "samples_per_s": self.samples_per_s,
            "switches": self.switches,
            "switch_s": self.switch_s,
            "oracle_samples_per_s": self.oracle_samples_per_s,
            "fraction_of_oracle": self.fraction,
        }


def warm_steps(settings: EpisodeSettings) -> int:
    """Steps on the initial plan before the first observation has a full window."""
    return math.ceil(settings.window / settings.iterations_per_step)


def run_controller(
    controller: Controller, trace: Trace, settings: EpisodeSettings, *, seed: int = 0
) -> Episode:
    """``controller`` on ``trace`` (see the module doc); the finished episode."""
    episode = Episode(trace, settings, seed=seed)
    for _ in range(warm_steps(settings)):
        if not episode.done:
            episode.run()
    while not episode.done:
        decision = controller.decide(episode.observation())
        episode.run(decision.bounds, method=decision.method)
    return episode


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalReport:
    """Every run, and per (controller, family) the fraction of the oracle's throughput."""

    runs: tuple[ControllerRun, ...]
    settings: Mapping[str, Any]

    def table(self) -> list[dict[str, Any]]:
        """Per controller and family: mean, standard deviation, min and max fraction of
        the oracle over the family's traces (seeds), and the mean switches."""
        groups: dict[tuple[str, str], list[ControllerRun]] = {}
        for run in self.runs:
            groups.setdefault((run.controller, run.family), []).append(run)
        rows = []
        for (name, family), runs in groups.items():
            fractions = [r.fraction for r in runs]
            rows.append(
                {
                    "controller": name,
                    "family": family,
                    "traces": len(runs),
                    "mean": statistics.fmean(fractions),
                    "std": statistics.stdev(fractions) if len(fractions) > 1 else 0.0,
                    "min": min(fractions),
                    "max": max(fractions),
                    "switches": statistics.fmean(r.switches for r in runs),
                }
            )
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "adaptipe-controller-eval",
            "version": 1,
            "settings": dict(self.settings),
            "table": self.table(),
            "runs": [r.to_json() for r in self.runs],
        }


def evaluate(
    controllers: Mapping[str, ControllerFactory],
    traces: Sequence[Trace],
    settings: EpisodeSettings,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> EvalReport:
    """Every controller (a fresh one per trace) and the oracle on every trace."""
    runs: list[ControllerRun] = []
    warm = warm_steps(settings)
    total = len(traces) * (len(controllers) + 1)
    done = 0
    for trace in traces:
        seed = trace.seed if trace.seed is not None else 0
        best = oracle(trace, settings, warm_steps=warm)
        runs.append(
            ControllerRun(
                controller="oracle", family=trace.family, seed=trace.seed,
                samples_per_s=best.samples_per_s, switches=best.switches, switch_s=0.0,
                oracle_samples_per_s=best.samples_per_s,
            )
        )  # fmt: skip
        done += 1
        for name, factory in controllers.items():
            episode = run_controller(factory(), trace, settings, seed=seed)
            runs.append(
                ControllerRun(
                    controller=name,
                    family=trace.family,
                    seed=trace.seed,
                    samples_per_s=episode.throughput(),
                    switches=sum(1 for r in episode.history if r.switch_s > 0),
                    switch_s=sum(r.switch_s for r in episode.history),
                    oracle_samples_per_s=best.samples_per_s,
                )
            )
            done += 1
            if progress is not None:
                progress(done, total)
    shown = {
        "model": settings.model,
        "stages": settings.stages,
        "microbatches": settings.microbatches,
        "iterations_per_step": settings.iterations_per_step,
        "window": settings.window,
        "noise": settings.noise,
        "cost": settings.cost.to_json(),
    }
    return EvalReport(runs=tuple(runs), settings=shown)


def plot_report(report: EvalReport, path: str | Path) -> Path:
    """A bar per controller and trace family: mean fraction of the oracle, with the
    min-max range over the family's seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.table()
    families = sorted({r["family"] for r in rows})
    names = [n for n in dict.fromkeys(r["controller"] for r in rows) if n != "oracle"]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(families)), 4.0))
    for k, name in enumerate(names):
        got = {r["family"]: r for r in rows if r["controller"] == name}
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(families))]
        means = [got[f]["mean"] if f in got else 0.0 for f in families]
        # max(..., 0): a mean of equal fractions can round past its min or max
        low = [
            max(m - got[f]["min"], 0.0) if f in got else 0.0
            for f, m in zip(families, means, strict=True)
        ]
        high = [
            max(got[f]["max"] - m, 0.0) if f in got else 0.0
            for f, m in zip(families, means, strict=True)
        ]
        ax.bar(xs, means, width, yerr=[low, high], capsize=2, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(families)), families)
    ax.set_ylabel("throughput / oracle's")
    ax.set_ylim(0.0, 1.05)
    ax.legend(  # below the axes: the bars reach the top and the bottom
        fontsize="small", ncols=min(len(names), 7), loc="upper center", bbox_to_anchor=(0.5, -0.1)
    )
    ax.set_title(f"controllers on held-out traces ({report.settings.get('model')}, "
                 f"{report.settings.get('stages')} stages)")  # fmt: skip
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
