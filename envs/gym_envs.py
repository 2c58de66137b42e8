"""The gymnasium environments: ``adaptipe/PipelineSwitch-v0`` and
``adaptipe/PipelineRepartition-v0``.

An episode is one `Episode` (`adaptipe.envs.episode`): a training run of a zoo model on
``stages`` stages under a trace, drawn at reset from ``traces`` or generated from one of
``families`` (`adaptipe.envs.generators`; by default the training families, with
seeds below the held-out ones: `adaptipe.envs.heldout`) with the reset's seed. A step trains
``iterations_per_step`` iterations in the simulator; its reward is samples per second
over the step, net of the switch's stall (the migration cost model) and of preemptions.

Before each step the environment lists the candidates from what the runtime would
observe (never the trace's true slowdowns): the best ``candidates`` partitions other
than the one in force, scored by the simulator on the measured slowdowns
(`adaptipe.controllers.candidates`). The actions:

- ``PipelineSwitch-v0``: ``Discrete(2)``: 0 stays, 1 switches to the best candidate
  (AutoPipe's RL decision: whether to switch, not where).
- ``PipelineRepartition-v0``: ``Discrete(K + 1)``: 0 stays, ``k`` switches to candidate
  ``k`` (DynPipe's choice among K).

The observation is `adaptipe.controllers.encode.encode` of the `Observation` that
`adaptipe.controllers.observe` builds from the episode's telemetry records, with the
candidates' predicted times. ``info`` carries the step's samples/s, stall, partition
and iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from adaptipe.controllers.encode import HIGH, encode, encoded_size
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.replan import stage_slowdowns
from adaptipe.envs.episode import Episode, EpisodeSettings, StepResult
from adaptipe.envs.heldout import HELD_OUT_SEED, TRAINING_FAMILIES
from adaptipe.envs.trace import Trace
from adaptipe.errors import PlanError

__all__ = ["PipelineRepartition", "PipelineSwitch", "candidates_for"]

Bounds = tuple[int, ...]


def candidates_for(
    obs: Observation, slowdowns: Sequence[float], k: int
) -> list[tuple[Bounds, float]]:
    """The best ``k`` partitions other than the one in force, with their predicted
    seconds per iteration, best first."""
    from adaptipe.controllers.candidates import top_k

    return top_k(obs, slowdowns, k)


class _PipelineEnv(gym.Env[npt.NDArray[np.float32], np.int64]):
    metadata = {"render_modes": []}  # noqa: RUF012 (gymnasium's instance attribute)

    def __init__(
        self,
        *,
        settings: EpisodeSettings | None = None,
        traces: Sequence[Trace] = (),
        families: Sequence[str] = TRAINING_FAMILIES,
        trace_iterations: int = 200,
        candidates: int = 1,
    ) -> None:
        self.settings = settings if settings is not None else EpisodeSettings()
        self.traces, self.families = tuple(traces), tuple(families)
        if not self.traces and not self.families:
            raise PlanError("environment: give traces or families to draw episodes from")
        for t in self.traces:
            if t.stages != self.settings.stages:
                raise PlanError(
                    f"environment: a trace has {t.stages} stages, the pipeline {self.settings.stages}"
                )
        self.trace_iterations, self.k = trace_iterations, candidates
        self._size = encoded_size(self.settings.stages, self.k)
        self.observation_space = gym.spaces.Box(0.0, HIGH, shape=(self._size,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(self.k + 1)
        self.episode: Episode | None = None
        self._candidates: list[tuple[Bounds, float]] = []

    # ------------------------------------------------------------------ gymnasium
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[npt.NDArray[np.float32], dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        trace = options.get("trace") or self._draw()
        self.episode = Episode(
            trace,
            self.settings,
            bounds=options.get("bounds"),
            seed=int(self.np_random.integers(2**31)),
        )
        # The first window runs on the initial plan: nothing to decide on before it.
        while len(self.episode.history) * self.settings.iterations_per_step < self.settings.window:
            self.episode.run()
        return self._observe(), self._info(self.episode.history[-1])

    def step(
        self, action: np.int64 | int
    ) -> tuple[npt.NDArray[np.float32], float, bool, bool, dict[str, Any]]:
        episode = self.episode
        if episode is None:
            raise PlanError("environment: call reset() before step()")
        a = int(action)
        if not 0 <= a <= self.k:
            raise PlanError(f"environment: action must be 0..{self.k} (got {a})")
        target = self._candidates[a - 1][0] if a and a <= len(self._candidates) else None
        result = episode.run(target)
        terminated = episode.done
        obs = self._observe() if not terminated else np.zeros(self._size, np.float32)
        return obs, float(result.samples_per_s), terminated, False, self._info(result)

    # ------------------------------------------------------------------ helpers
    def _draw(self) -> Trace:
        if self.traces:
            return self.traces[int(self.np_random.integers(len(self.traces)))]
        from adaptipe.envs.generators import generate

        family = self.families[int(self.np_random.integers(len(self.families)))]
        return generate(
            family,
            stages=self.settings.stages,
            iterations=self.trace_iterations,
            seed=int(self.np_random.integers(HELD_OUT_SEED)),  # never a held-out seed
        )

    def _observe(self) -> npt.NDArray[np.float32]:
        assert self.episode is not None
        obs = self.episode.observation()
        slow = stage_slowdowns(obs)
        self._candidates = candidates_for(obs, slow, self.k)
        times = [t for _, t in self._candidates]
        times += [times[-1] if times else 0.0] * (self.k - len(times))  # pad: as the last
        return encode(obs, times, slowdowns=slow)

    def _info(self, result: StepResult) -> dict[str, Any]:
        return {
            "samples_per_s": result.samples_per_s,
            "switch_s": result.switch_s,
            "bounds": list(result.bounds),
            "iteration": result.first,
            "candidates": [list(b) for b, _ in self._candidates],
        }


class PipelineSwitch(_PipelineEnv):
    """``adaptipe/PipelineSwitch-v0``: stay (0) or switch to the best candidate (1)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs, candidates=1)


class PipelineRepartition(_PipelineEnv):
    """``adaptipe/PipelineRepartition-v0``: stay (0) or take candidate k of K (k)."""

    def __init__(self, *, candidates: int = 4, **kwargs: Any) -> None:
        if candidates < 1:
            raise PlanError(f"environment: candidates must be >= 1 (got {candidates})")
        super().__init__(**kwargs, candidates=candidates)
