"""The gymnasium environments: gymnasium's and stable-baselines3's checkers pass,
episodes are deterministic under a seed, and actions do what they say (a step's cost:
bench/bench_envs.py)."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import adaptipe.envs  # noqa: F401  (registers the environments)
from adaptipe.envs.episode import EpisodeSettings
from adaptipe.envs.gym_envs import PipelineRepartition, PipelineSwitch
from adaptipe.envs.trace import Trace, rows_from
from adaptipe.errors import PlanError


def _traces(n: int = 3, stages: int = 4, iterations: int = 60) -> list[Trace]:
    out = []
    for k in range(n):
        slow = [[1.0] * stages] * 20 + [
            [1.0 + (s == (k % stages)) * 2.0 for s in range(stages)]
        ] * (iterations - 20)
        out.append(
            Trace(
                stages=stages, family="hand", seed=k,
                rows=rows_from(slow, [[math.inf] * (stages - 1)] * iterations),
            )
        )  # fmt: skip
    return out


@pytest.mark.parametrize(
    "env_id", ["adaptipe/PipelineSwitch-v0", "adaptipe/PipelineRepartition-v0"]
)
def test_gymnasium_and_stable_baselines3_checkers_pass(env_id: str) -> None:
    env = gym.make(env_id, traces=_traces())
    gym_check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(gym.make(env_id, traces=_traces()).unwrapped, warn=False)


def _rollout(env: gym.Env, seed: int, actions: list[int]) -> tuple[np.ndarray, list[float]]:  # type: ignore[type-arg]
    obs, _ = env.reset(seed=seed)
    seen, rewards = [obs], []
    for a in actions:
        obs, reward, terminated, _, _ = env.step(a)
        seen.append(obs)
        rewards.append(reward)
        if terminated:
            break
    return np.concatenate(seen), rewards


def test_episodes_are_deterministic_under_a_seed() -> None:
    actions = [0, 1, 0, 2, 0, 0]
    a = _rollout(PipelineRepartition(traces=_traces(), candidates=3), 7, actions)
    b = _rollout(PipelineRepartition(traces=_traces(), candidates=3), 7, actions)
    c = _rollout(PipelineRepartition(traces=_traces(), candidates=3), 8, actions)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    assert not np.array_equal(a[0], c[0])


def test_switching_to_the_best_candidate_relieves_a_slowed_stage() -> None:
    settings = EpisodeSettings(model="gpt", stages=4, noise=0.0)
    trace = _traces(n=2)[1]  # stage 1 at 3x from iteration 20
    stay, switch = (
        PipelineSwitch(settings=settings, traces=[trace]),
        PipelineSwitch(settings=settings, traces=[trace]),
    )
    stay.reset(seed=0)
    switch.reset(seed=0)
    for _ in range(2):  # to the onset and past it: the window sees it
        stay.step(0)
        switch.step(0)
    _, r_stay, _, _, _ = stay.step(0)
    _, r_moved, _, _, info = switch.step(1)
    assert info["switch_s"] > 0
    _, r_stay, _, _, _ = stay.step(0)
    _, r_moved, _, _, _ = switch.step(0)
    assert r_moved > 1.2 * r_stay


def test_bad_use_is_refused() -> None:
    env = PipelineSwitch(traces=_traces())
    with pytest.raises(PlanError, match="call reset"):
        env.step(0)
    env.reset(seed=0)
    with pytest.raises(PlanError, match=r"action must be 0..1"):
        env.step(2)
    with pytest.raises(PlanError, match="3 stages, the pipeline 4"):
        PipelineSwitch(traces=_traces(stages=3))
