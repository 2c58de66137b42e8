"""PPO on ``adaptipe/PipelineSwitch-v0``: the environments, reward scale, seeding and
progress it trains with, and `train_switch`: ``adaptipe controllers train switch``.

stable-baselines3 is imported here only, so that loading and running a trained policy
never imports it.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsFloat

import gymnasium as gym
import numpy as np
import torch

from adaptipe.controllers.switch_policy import (
    DEFAULT_STAGES,
    ENV_ID,
    Progress,
    TrainSettings,
    from_sb3,
    save_switch,
    switch_artifact,
)
from adaptipe.envs.heldout import TRAINING_FAMILIES
from adaptipe.errors import PlanError

if TYPE_CHECKING:
    from stable_baselines3 import PPO
    from stable_baselines3.common.running_mean_std import RunningMeanStd

    from adaptipe.envs.episode import EpisodeSettings

__all__ = ["ScaledReward", "learn", "quiet_samples_per_s", "train_switch", "training_metadata"]


def quiet_samples_per_s(settings: EpisodeSettings) -> float:
    """Samples/s of the initial plan with no interference: the reward's unit."""
    from adaptipe.envs.episode import initial_bounds
    from adaptipe.sim.conditions import iteration_times

    costs = settings.layer_costs()
    s = settings.stages
    t = iteration_times(
        costs, initial_bounds(settings), np.ones((1, s)), np.full((1, s - 1), np.inf)
    )
    return costs.samples_per_iteration / float(t[0])


class ScaledReward(gym.RewardWrapper):
    """The environment's reward over `quiet_samples_per_s`.

    The raw reward is 100-300 samples/s, so the critic's targets run to thousands over
    an episode; PPO clips the gradient of actor and critic together (norm 0.5), and a
    loss that large leaves the actor almost no step. A fixed unit (unlike VecNormalize's
    running reward scale) keeps the reward a plain fraction of the quiet speed."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.unit = quiet_samples_per_s(env.unwrapped.settings)  # type: ignore[attr-defined]

    def reward(self, reward: SupportsFloat) -> float:
        return float(reward) / self.unit


def _progress_callback(progress: Progress, total: int) -> Any:
    from stable_baselines3.common.callbacks import BaseCallback

    class _Report(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            progress(min(self.num_timesteps, total), total)

        def _on_training_end(self) -> None:
            progress(min(self.num_timesteps, total), total)

    return _Report()


def _printer(done: int, total: int) -> None:
    print(f"train switch: {done}/{total} timesteps ({100 * done / total:.0f}%)", flush=True)


def _maker(episode: EpisodeSettings) -> Callable[[], gym.Env]:
    return lambda: ScaledReward(gym.make(ENV_ID, settings=episode))


def learn(
    *,
    seed: int,
    timesteps: int,
    progress: bool | Progress,
    n_envs: int,
    settings: TrainSettings,
    stages: int = DEFAULT_STAGES,
    models: tuple[str, ...] = ("gpt",),
) -> tuple[PPO, RunningMeanStd | None, dict[str, Any]]:
    """Train on ``stages``-stage episodes of ``models`` (environment ``i`` trains
    ``models[i % len(models)]``: the observation reads the same for every model, so one
    policy can serve several); the model, VecNormalize's observation statistics (None
    without) and the episodes' settings (the first model's, with ``models`` when more)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.utils import set_random_seed
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    import adaptipe.envs  # noqa: F401 (registers the environments)
    from adaptipe.envs.episode import EpisodeSettings

    if timesteps < 1 or n_envs < 1:
        raise PlanError(f"train switch: timesteps and n_envs must be >= 1 ({timesteps}, {n_envs})")
    if not models or len(models) > n_envs:
        raise PlanError(f"train switch: 1 to n_envs ({n_envs}) models (got {list(models)})")
    set_random_seed(seed)
    episodes = [EpisodeSettings(stages=stages, model=m) for m in models]
    venv: Any = DummyVecEnv([_maker(episodes[i % len(episodes)]) for i in range(n_envs)])
    if settings.obs_norm:
        venv = VecNormalize(venv, norm_obs=True, norm_reward=False, gamma=settings.gamma)
    bar = progress is True and all(importlib.util.find_spec(m) for m in ("tqdm", "rich"))
    callback = None
    if callable(progress):
        callback = _progress_callback(progress, timesteps)
    elif progress and not bar:
        callback = _progress_callback(_printer, timesteps)
    model = PPO(
        "MlpPolicy",
        venv,
        learning_rate=settings.learning_rate,
        n_steps=settings.n_steps,
        batch_size=settings.batch_size,
        n_epochs=settings.n_epochs,
        gamma=settings.gamma,
        gae_lambda=settings.gae_lambda,
        clip_range=settings.clip_range,
        ent_coef=settings.ent_coef,
        policy_kwargs={"net_arch": {"pi": list(settings.hidden), "vf": list(settings.hidden)}},
        seed=seed,
        device="cpu",
        verbose=0,
    )
    # A logger with no outputs: SB3's default makes an empty SB3-<date> folder in the
    # system's temporary folder on every learn() even with verbose=0.
    model.set_logger(Logger(folder=None, output_formats=[]))
    model.learn(total_timesteps=timesteps, callback=callback, progress_bar=bar)
    obs_rms = venv.obs_rms if settings.obs_norm else None
    env = {k: v for k, v in asdict(episodes[0]).items() if k != "cost"}
    env["cost"] = episodes[0].cost.to_json()
    if len(models) > 1:
        env["models"] = list(models)
    return model, obs_rms, env


def train_switch(
    *,
    seed: int = 0,
    out: Path | None = None,
    timesteps: int = 64_000,
    progress: bool | Progress = True,
    n_envs: int = 4,
    settings: TrainSettings = TrainSettings(),  # noqa: B008 (frozen: a safe default)
    stages: int = DEFAULT_STAGES,
    models: tuple[str, ...] = ("gpt",),
) -> Path:
    """Train the switch policy with PPO and save it as an artifact in ``out`` (default:
    the shipped folder for ``stages``, `switch_artifact`). Seeded: the same arguments
    give the same weights.

    Args:
        stages: the pipeline's stages; a policy reads and acts for one stage count.
        models: the zoo models (`adaptipe.envs.episode.MODELS`) the episodes train.
        timesteps: environment steps in all (about 7 ms each here).
        progress: True for a progress bar (SB3's, or printed lines without tqdm and
            rich), a callable for ``(done, total)`` calls, False for none.
        n_envs: environments stepped in lockstep (one process).
    """
    torch.set_num_threads(1)
    target = out if out is not None else switch_artifact(stages)  # refused before training
    start = time.perf_counter()
    model, obs_rms, env_settings = learn(
        seed=seed,
        timesteps=timesteps,
        progress=progress,
        n_envs=n_envs,
        settings=settings,
        stages=stages,
        models=models,
    )
    policy = from_sb3(model, obs_rms, env_settings, hidden=settings.hidden)
    training = training_metadata(
        seed=seed, timesteps=timesteps, n_envs=n_envs, settings=settings, stages=stages,
        models=models,
    )  # fmt: skip
    training["seconds"] = round(time.perf_counter() - start, 1)
    return save_switch(policy, target, training=training)


def training_metadata(
    *,
    seed: int,
    timesteps: int,
    n_envs: int,
    settings: TrainSettings,
    stages: int,
    models: tuple[str, ...] = ("gpt",),
) -> dict[str, Any]:
    """What `train_switch` records of how the policy was made (all but its seconds)."""
    return {
        "algorithm": "PPO (stable-baselines3 MlpPolicy)",
        "env": ENV_ID,
        "stages": stages,
        "models": list(models),
        "seed": seed,
        "timesteps": timesteps,
        "n_envs": n_envs,
        "families": list(TRAINING_FAMILIES),
        "reward": "samples/s net of stalls over the initial plan's quiet samples/s",
        "ppo": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
    }
