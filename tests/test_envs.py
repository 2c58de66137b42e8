"""The environments' ground (`adaptipe.envs`): episodes simulate what the runtime would
do and measure, the observation is the runtime manager's, and the oracle is the best
plan there is (brute force on small instances)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest

from adaptipe.controllers import Keep, Threshold, ThresholdSettings
from adaptipe.controllers.base import Decision
from adaptipe.controllers.live import LiveDecider
from adaptipe.controllers.observation import Observation
from adaptipe.envs.episode import Episode, EpisodeSettings
from adaptipe.envs.evaluate import evaluate, plot_report, run_controller, warm_steps
from adaptipe.envs.oracle import all_partitions, oracle
from adaptipe.envs.trace import Trace, rows_from
from adaptipe.errors import PlanError
from adaptipe.sim.conditions import iteration_times


def _trace(
    stages: int, slow: Sequence[Sequence[float]], bw: float = math.inf, seed: int = 0
) -> Trace:
    return Trace(
        stages=stages,
        family="hand",
        seed=seed,
        rows=rows_from(slow, [[bw] * (stages - 1)] * len(slow)),
    )


def _step(stages: int, onset: int, n: int, stage: int = 1, factor: float = 3.0) -> Trace:
    quiet = [1.0] * stages
    slowed = [factor if s == stage else 1.0 for s in range(stages)]
    return _trace(stages, [quiet] * onset + [slowed] * (n - onset))


def test_an_episode_trains_on_the_simulator_under_the_trace() -> None:
    settings = EpisodeSettings(model="gpt", stages=4, iterations_per_step=10)
    trace = _step(4, 20, 40)
    episode = Episode(trace, settings)
    results = [episode.run() for _ in range(4)]
    assert episode.done and [r.first for r in results] == [0, 10, 20, 30]
    expected = iteration_times(
        settings.layer_costs(), episode.bounds, trace.slowdowns(), trace.bandwidths()
    )
    got = [t for r in results for t in r.iteration_s]
    assert got == pytest.approx(list(expected))
    assert results[3].samples_per_s < 0.7 * results[0].samples_per_s  # stage 1 at 3x
    with pytest.raises(PlanError, match="the trace has ended"):
        episode.run()


def test_a_switch_pays_the_cost_models_stall_and_a_preemption_its_restart() -> None:
    settings = EpisodeSettings(model="gpt", stages=2)
    rows = rows_from([[1.0, 1.0]] * 20, [[1e8]] * 20)
    rows = (*rows[:15], type(rows[15])(slowdown=(1.0, 1.0), bandwidth_Bps=(1e8,),
            events=({"kind": "preempt", "stage": 0, "stall_s": 4.0},)), *rows[16:])  # fmt: skip
    trace = Trace(stages=2, family="hand", rows=rows)
    episode = Episode(trace, settings, bounds=(0, 8, 16))
    first = episode.run((0, 10, 16))
    profile = settings.profile
    moved = sum(profile.layers[i].param_bytes + profile.layers[i].optimizer_bytes for i in (8, 9))
    assert first.switch_s == pytest.approx(settings.cost.stall_s(moved, 1e8))
    second = episode.run()
    assert second.switch_s == 0.0 and max(second.iteration_s) > 4.0
    assert episode.throughput() == pytest.approx(
        (first.samples + second.samples) / (first.seconds + second.seconds)
    )


class _Capture:
    name = "capture"

    def __init__(self) -> None:
        self.seen: list[Observation] = []

    def decide(self, observation: Observation) -> Decision:
        self.seen.append(observation)
        return Decision()


def test_the_observation_is_the_runtime_managers_from_the_same_records() -> None:
    settings = EpisodeSettings(model="cnn", stages=2, microbatches=4, window=6)
    episode = Episode(_step(2, 10, 30), settings, seed=3)
    episode.run()
    episode.run()
    capture = _Capture()
    manager = LiveDecider(
        capture, settings.profile, window=6, workers=2, microbatches=settings.microbatches
    )
    manager(list(episode.records), episode.partition)
    assert capture.seen == [episode.observation()]
    obs = episode.observation()
    assert obs.iterations == tuple(range(14, 20)) and obs.microbatches == 4


def test_measurements_are_noisy_but_seeded() -> None:
    settings = EpisodeSettings(model="cnn", stages=2, noise=0.05)
    a, b, c = (Episode(_step(2, 5, 20), settings, seed=s) for s in (1, 1, 2))
    for e in (a, b, c):
        e.run()
    assert a.observation() == b.observation() != c.observation()


def _replay(trace: Trace, settings: EpisodeSettings, plan: Sequence[tuple[int, ...]]) -> float:
    episode = Episode(trace, settings)
    for bounds in plan:
        episode.run(bounds)
    return sum(r.seconds for r in episode.history)


def test_the_oracle_is_the_best_plan_by_brute_force() -> None:
    settings = EpisodeSettings(model="cnn", stages=2, iterations_per_step=5, window=5)
    trace = _trace(
        2, [[1.0, 1.0]] * 5 + [[1.0, 4.0]] * 5 + [[4.0, 1.0]] * 5 + [[1.0, 1.0]] * 5, bw=2e7
    )
    best = oracle(trace, settings, warm_steps=1)
    parts = all_partitions(6, 2)
    start = Episode(trace, settings).bounds
    plans = [(start, *rest) for rest in itertools.product(parts, repeat=3)]
    times = [_replay(trace, settings, p) for p in plans]
    assert best.seconds == pytest.approx(min(times))
    assert _replay(trace, settings, best.steps) == pytest.approx(best.seconds)
    assert best.switches >= 1 and best.steps[0] == start


def test_evaluation_reports_fractions_of_the_oracle_and_plots(tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = EpisodeSettings(model="gpt", stages=4)
    traces = [_step(4, 60, 200), _trace(4, [[1.0, 1.0, 2.5, 1.0]] * 200, seed=1)]
    report = evaluate(
        {"none": Keep, "threshold": lambda: Threshold(ThresholdSettings(patience=1))},
        traces,
        settings,
    )
    table = {r["controller"]: r for r in report.table()}
    assert table["oracle"]["mean"] == 1.0
    assert 0 < table["none"]["max"] < table["threshold"]["mean"] <= 1.0 + 1e-9
    assert table["none"]["switches"] == 0 and table["threshold"]["switches"] >= 1
    assert plot_report(report, tmp_path / "eval.png").stat().st_size > 0
    assert report.to_json()["settings"]["stages"] == 4


def test_a_controller_runs_after_the_warm_steps_only() -> None:
    settings = EpisodeSettings(model="cnn", stages=2, iterations_per_step=4, window=6)
    capture = _Capture()
    episode = run_controller(capture, _step(2, 5, 20), settings)
    assert warm_steps(settings) == 2 and episode.done
    assert [o.iteration for o in capture.seen] == [7, 11, 15]
    assert np.isfinite(episode.throughput())
