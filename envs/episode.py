"""One simulated training run under a trace: what the environments step and the
evaluation replays controllers on.

An `Episode` trains a model (its per-layer profile) on ``stages`` stage workers under a
`Trace`. `Episode.run` takes the partition to train the next ``iterations_per_step``
iterations on (None: keep the one in force) and returns a `StepResult`: the simulator's
seconds for those iterations (`adaptipe.sim.conditions.iteration_times` at the trace's
true slowdowns and bandwidths), the switch's stall from the migration cost model
(`adaptipe.sim.migration.MigrationCost`, the way the runtime pays it: the moving layers'
state over the slowest link the move crosses, now), the stalls of the trace's
preemptions, and samples per second net of all of them.

What a controller sees is what the runtime would: the episode writes the telemetry
records the stages would have sent (``stage_stats`` with per-layer forward and backward
seconds summed over the iteration's micro-batches, ``link_sample`` per link,
``device_sample`` per stage from the trace's device readings), each measurement with
seeded multiplicative noise, and `Episode.observation` builds the `Observation` from
them with the runtime manager's own builder (`adaptipe.controllers.observe`). The
trace's true slowdowns reach the controller only through those measurements.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adaptipe.controllers.observation import Observation, observe
from adaptipe.controllers.replan import best_partition
from adaptipe.envs.trace import Trace
from adaptipe.errors import PlanError
from adaptipe.monitor.schema import DeviceSample, LinkSample, Record, StageStats
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.serial import load_json_file
from adaptipe.sim.conditions import LayerCosts, iteration_times
from adaptipe.sim.migration import MigrationCost, layer_owners, moved_layers

__all__ = ["MODELS", "Episode", "EpisodeSettings", "StepResult", "load_profile"]

PROFILES = Path(__file__).parent / "profiles"
MODELS = ("gpt", "cnn")
"""Models with a built-in profile (``envs/profiles``: measured with ``adaptipe profile``
on this 2-core machine, one thread; the GPT with 14 blocks, 16 layers)."""


@functools.lru_cache(maxsize=8)
def load_profile(model: str) -> Profile:
    """The built-in profile of a zoo model (one of `MODELS`), or a profile file (a path
    ending in ``.json``, e.g. a run's ``profile.json``)."""
    if model.endswith(".json"):
        return load_json_file(model, Profile.from_json)
    if model not in MODELS:
        raise PlanError(
            f"episode: model must be one of {', '.join(MODELS)} or a profile's .json path "
            f"(got {model!r})"
        )
    return load_json_file(PROFILES / f"{model}.json", Profile.from_json)


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeSettings:
    """What an episode trains and how it is measured."""

    model: str = "gpt"  # one of MODELS, or a profile file
    stages: int = 4
    microbatches: int = 8
    iterations_per_step: int = 10  # K: a step of the environment
    window: int = 8  # iterations an observation covers (``[adapt].window``)
    noise: float = 0.03  # relative spread of every measurement (lognormal sigma)
    cost: MigrationCost = field(default_factory=MigrationCost)

    def __post_init__(self) -> None:
        load_profile(self.model)
        layers = len(load_profile(self.model).layers)
        if not 2 <= self.stages <= layers:
            raise PlanError(
                f"episode: stages must be 2..{layers} for {self.model} (got {self.stages})"
            )
        for name in ("microbatches", "iterations_per_step", "window"):
            if getattr(self, name) < 1:
                raise PlanError(f"episode: {name} must be >= 1 (got {getattr(self, name)})")
        if not 0 <= self.noise < 1:
            raise PlanError(f"episode: noise must be in [0, 1) (got {self.noise})")

    @property
    def profile(self) -> Profile:
        return load_profile(self.model)

    def layer_costs(self) -> LayerCosts:
        return LayerCosts.from_profile(self.profile, microbatches=self.microbatches)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """One step: iterations ``[first, first + len(iteration_s))`` on ``bounds``."""

    first: int
    bounds: tuple[int, ...]
    iteration_s: tuple[float, ...]  # the simulator's, preemption stalls included
    switch_s: float  # the move into ``bounds`` (0 without one)
    samples: int

    @property
    def seconds(self) -> float:
        return sum(self.iteration_s) + self.switch_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class Episode:
    """A run of ``settings``' model under ``trace`` (see the module doc).

    ``bounds``: the initial partition (default: DynPipe's planner on the quiet profile,
    the plan a run starts with). ``seed`` draws the measurement noise.
    """

    def __init__(
        self,
        trace: Trace,
        settings: EpisodeSettings,
        *,
        bounds: Sequence[int] | None = None,
        seed: int = 0,
    ) -> None:
        if trace.stages != settings.stages:
            raise PlanError(
                f"episode: the trace has {trace.stages} stages, the pipeline {settings.stages}"
            )
        self.trace, self.settings = trace, settings
        self.costs = settings.layer_costs()
        self.profile = settings.profile
        self._slow, self._bws = trace.slowdowns(), trace.bandwidths()
        self._rng = np.random.default_rng(seed)
        self.bounds = tuple(bounds) if bounds is not None else initial_bounds(settings)
        self.iteration = 0  # the next iteration to train
        self.clock_s = 0.0
        keep = settings.window * (3 + settings.stages)  # enough for a full window
        self.records: deque[Record] = deque(maxlen=keep * settings.stages)
        self.history: list[StepResult] = []

    @property
    def done(self) -> bool:
        return self.iteration >= self.trace.iterations

    @property
    def partition(self) -> Partition:
        return _partition(self.profile, self.bounds)

    def observation(self) -> Observation:
        """What the manager would observe now (`observe` on the records written so far)."""
        return observe(
            self.records,
            self.profile,
            self.partition,
            window=self.settings.window,
            workers=self.settings.stages,
            microbatches=self.settings.microbatches,
        )

    def switch_cost(self, bounds: Sequence[int], method: str = "live") -> float:
        """Seconds a move from the partition in force to ``bounds`` stalls training now."""
        moving = moved_layers(self.bounds, bounds)
        if not moving:
            return 0.0
        layers = self.profile.layers
        state = sum(layers[i].param_bytes + layers[i].optimizer_bytes for i in moving)
        row = min(self.iteration, self.trace.iterations - 1)
        crossed = _crossed_links(self.bounds, bounds, moving)
        bw = min((self._bws[row, s] for s in crossed), default=math.inf)
        return self.settings.cost.switch_s(
            method, int(state), bw if math.isfinite(bw) else _FREE_BPS
        )

    def run(self, bounds: Sequence[int] | None = None, *, method: str = "live") -> StepResult:
        """Train the next step on ``bounds`` (None: the partition in force)."""
        if self.done:
            raise PlanError("episode: the trace has ended; reset for a new episode")
        switch = 0.0
        if bounds is not None and tuple(bounds) != self.bounds:
            _partition(self.profile, bounds)  # refuses a bad partition
            switch = self.switch_cost(bounds, method)
            self.bounds = tuple(int(b) for b in bounds)
        first = self.iteration
        last = min(first + self.settings.iterations_per_step, self.trace.iterations)
        times = iteration_times(
            self.costs, self.bounds, self._slow[first:last], self._bws[first:last]
        )
        times = times + np.array([self.trace.rows[i].stall_s() for i in range(first, last)])
        self.clock_s += switch
        for k, i in enumerate(range(first, last)):
            self.clock_s += float(times[k])
            self._measure(i, float(times[k]))
        self.iteration = last
        result = StepResult(
            first=first,
            bounds=self.bounds,
            iteration_s=tuple(float(t) for t in times),
            switch_s=switch,
            samples=(last - first) * self.costs.samples_per_iteration,
        )
        self.history.append(result)
        return result

    def throughput(self) -> float:
        """Samples per second over the episode so far, stalls included."""
        seconds = sum(r.seconds for r in self.history)
        return sum(r.samples for r in self.history) / seconds if seconds > 0 else 0.0

    # ------------------------------------------------------------------ telemetry
    def _noisy(self, value: float) -> float:
        sigma = self.settings.noise
        return value * float(np.exp(self._rng.normal(0.0, sigma))) if sigma > 0 else value

    def _measure(self, i: int, iteration_s: float) -> None:
        """The records the stages would send for iteration ``i``."""
        s_count, m = self.settings.stages, self.settings.microbatches
        row = self.trace.rows[i]
        for s in range(s_count):
            lo, hi = self.bounds[s], self.bounds[s + 1]
            slow = float(self._slow[i, s])
            fwd = tuple(self._noisy(self.costs.forward_s[j] * slow * m) for j in range(lo, hi))
            bwd = tuple(self._noisy(self.costs.backward_s[j] * slow * m) for j in range(lo, hi))
            compute = sum(fwd) + sum(bwd)
            self.records.append(
                StageStats(
                    run_id="episode", stage=s, iteration=i, time_s=self.clock_s,
                    first_layer=lo, forward_s=fwd, backward_s=bwd, compute_s=compute,
                    wait_s=max(iteration_s - compute, 0.0), comm_s=0.0,
                    iteration_s=self._noisy(iteration_s),
                )
            )  # fmt: skip
            if row.device:
                self.records.append(
                    DeviceSample(
                        stage=s,
                        time_s=self.clock_s,
                        source="nvml" if self.trace.device_source == "nvml" else "cpu",
                        fields=dict(row.device[s]),
                    )
                )
        for s in range(s_count - 1):
            bw = float(self._bws[i, s])
            if math.isfinite(bw):
                nbytes = self.costs.activation_bytes[self.bounds[s + 1] - 1]
                measured = self._noisy(bw)
                self.records.append(
                    LinkSample(
                        src=s, dst=s + 1, time_s=self.clock_s, nbytes=int(nbytes),
                        seconds=nbytes / measured, bandwidth_Bps=measured,
                    )
                )  # fmt: skip


_FREE_BPS = 1e9  # an unlimited link still moves state at about loopback's rate here


def initial_bounds(settings: EpisodeSettings) -> tuple[int, ...]:
    """The plan a run starts with: DynPipe's planner on the quiet profile."""
    profile = settings.profile
    quiet = Observation.from_profile(
        profile, _even(len(profile.layers), settings.stages), microbatches=settings.microbatches
    )
    bounds, _ = best_partition(quiet, (1.0,) * settings.stages)
    return bounds


def _even(layers: int, stages: int) -> tuple[int, ...]:
    return tuple(round(s * layers / stages) for s in range(stages + 1))


def _partition(profile: Profile, bounds: Sequence[int]) -> Partition:
    try:
        return Partition(
            model=profile.model,
            num_layers=len(profile.layers),
            bounds=tuple(int(b) for b in bounds),
            planner="episode",
        )
    except (PlanError, TypeError, ValueError) as exc:
        raise PlanError(f"episode: {list(bounds)} is not a partition ({exc})") from None


def _crossed_links(old: Sequence[int], new: Sequence[int], moving: Sequence[int]) -> list[int]:
    """The stage boundaries the moving layers cross (``s`` for link ``s <-> s + 1``)."""
    was, now = layer_owners(old), layer_owners(new)
    crossed: set[int] = set()
    for layer in moving:
        a, b = sorted((was[layer], now[layer]))
        crossed.update(range(a, b))
    return sorted(crossed)
