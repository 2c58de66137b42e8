"""The PPO switch policy (`adaptipe.controllers.switch_policy`): its artifact acts as the
trained PPO did, changed or mismatched artifacts are refused, seeded training repeats
itself, and `LearnedSwitch` acts in an episode as the policy did in the environment."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

import adaptipe.envs  # noqa: F401 (registers the environments)
from adaptipe.controllers.artifacts import load_artifact, save_artifact, shipped
from adaptipe.controllers.switch_policy import (
    ENV_ID,
    FORMAT,
    LearnedSwitch,
    SwitchConfig,
    TrainSettings,
    from_sb3,
    load_switch,
    save_switch,
    switch_artifact,
)
from adaptipe.envs.episode import EpisodeSettings
from adaptipe.envs.evaluate import run_controller
from adaptipe.envs.generators import generate
from adaptipe.envs.gym_envs import PipelineSwitch
from adaptipe.envs.switch_training import learn, train_switch, training_metadata
from adaptipe.errors import PlanError

TINY = TrainSettings(n_steps=64, batch_size=32, n_epochs=2)


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any, dict[str, Any]]:
    torch.set_num_threads(1)
    return learn(seed=3, timesteps=128, progress=False, n_envs=2, settings=TINY)


def _observations(n_episodes: int = 2, *, stages: int = 4, model: str = "gpt") -> np.ndarray:
    env = gym.make(ENV_ID, settings=EpisodeSettings(stages=stages, model=model))
    rows = []
    for e in range(n_episodes):
        obs, _ = env.reset(seed=100 + e)
        done, k = False, 0
        while not done:
            rows.append(obs)
            obs, _, done, _, _ = env.step(k % 2)
            k += 1
    rng = np.random.default_rng(0)  # and some far from the training data
    rows += list(rng.uniform(0.0, 5.0, size=(50, len(rows[0]))).astype(np.float32))
    return np.stack(rows)


def test_the_artifact_acts_as_the_trained_ppo(tiny: Any, tmp_path: Path) -> None:
    model, obs_rms, env = tiny
    root = save_switch(from_sb3(model, obs_rms, env, hidden=TINY.hidden), tmp_path / "s",
                       training={"seed": 3})  # fmt: skip
    policy = load_switch(root)
    obs = _observations()
    want, _ = model.predict(model.get_env().normalize_obs(obs), deterministic=True)
    got = [policy.act(o) for o in obs]
    assert got == [int(a) for a in want]
    assert set(got) <= {0, 1} and policy.config.hidden == (32, 16)


def test_a_2_stage_artifact_acts_as_the_trained_ppo(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model, obs_rms, env = learn(
        seed=4, timesteps=128, progress=False, n_envs=2, settings=TINY, stages=2,
        models=("gpt", "cnn"),
    )  # fmt: skip
    venv = model.get_env()
    assert [e.unwrapped.settings.model for e in venv.venv.envs] == ["gpt", "cnn"]
    root = save_switch(from_sb3(model, obs_rms, env, hidden=TINY.hidden), tmp_path / "s2",
                       training={"seed": 4})  # fmt: skip
    policy = load_switch(root, stages=2)
    obs = np.concatenate([_observations(1, stages=2), _observations(1, stages=2, model="cnn")])
    want, _ = model.predict(venv.normalize_obs(obs), deterministic=True)
    assert [policy.act(o) for o in obs] == [int(a) for a in want]
    assert policy.config.stages == 2 and policy.config.env["models"] == ["gpt", "cnn"]
    with pytest.raises(PlanError, match=r"1 to n_envs \(1\) models"):
        learn(seed=0, timesteps=8, progress=False, n_envs=1, settings=TINY, models=("gpt", "cnn"))


def test_a_tampered_weight_file_is_refused(tiny: Any, tmp_path: Path) -> None:
    model, obs_rms, env = tiny
    root = save_switch(from_sb3(model, obs_rms, env, hidden=TINY.hidden), tmp_path / "s",
                       training={})  # fmt: skip
    blob = bytearray((root / "weights.safetensors").read_bytes())
    blob[-1] ^= 1
    (root / "weights.safetensors").write_bytes(bytes(blob))
    with pytest.raises(PlanError, match=r"weights.safetensors: sha256 .* changed after training"):
        load_switch(root)


def _resave(root: Path, out: Path, **config: Any) -> Path:
    """``root``'s artifact with its config changed (and the manifest re-pinned)."""
    art = load_artifact(root, model="switch", format=FORMAT)
    data = art.json("config.json") | config
    files = dict(art.files) | {"config.json": json.dumps(data).encode()}
    return save_artifact(out, model="switch", format=FORMAT, files=files, training={})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"stages": 5}, r"obs_size 84 is not what this adaptipe encodes for 5 stages"),
        ({"hidden": [64, 64]}, r"the weights do not fit the config's network"),
        ({"activation": "relu"}, r"unsupported network"),
        ({"kind": "other"}, r"not a switch policy's config"),
    ],
)
def test_a_mismatched_config_is_refused(
    tiny: Any, tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    model, obs_rms, env = tiny
    root = save_switch(from_sb3(model, obs_rms, env, hidden=TINY.hidden), tmp_path / "s",
                       training={})  # fmt: skip
    with pytest.raises(PlanError, match=message):
        load_switch(_resave(root, tmp_path / "bad", **config))


@pytest.mark.parametrize(
    ("stages", "folder"), [(None, "switch"), (4, "switch"), (2, "switch-2stages")]
)
def test_each_stage_count_has_its_shipped_policy(stages: int | None, folder: str) -> None:
    assert switch_artifact(stages) == shipped(folder)
    policy = load_switch(stages=stages)
    assert policy.config.stages == (stages or 4)
    assert policy.config.obs_size == len(_observations(1, stages=stages or 4)[0])


def test_a_stage_count_with_no_shipped_policy_is_refused_naming_those_there_are() -> None:
    with pytest.raises(PlanError, match=r"no shipped switch policy for 3 stages \(shipped: 2, 4"):
        switch_artifact(3)
    with pytest.raises(PlanError, match=r"no shipped switch policy for 3 stages"):
        load_switch(stages=3)
    with pytest.raises(PlanError, match=r"trained for 4 stages, the pipeline has 2"):
        load_switch(switch_artifact(4), stages=2)
    trace = generate("poisson-light", stages=3, iterations=40, seed=0)
    from adaptipe.envs.episode import Episode, EpisodeSettings

    episode = Episode(trace, EpisodeSettings(stages=3))
    episode.run()
    with pytest.raises(PlanError, match=r"trained for 4 stages, the observation has 3"):
        LearnedSwitch(load_switch()).decide(episode.observation())


def test_seeded_training_repeats_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    kwargs: dict[str, Any] = {"seed": 1, "timesteps": 64, "progress": False, "n_envs": 1}
    a = train_switch(out=tmp_path / "a", settings=TINY, **kwargs)
    b = train_switch(out=tmp_path / "b", settings=TINY, **kwargs)
    assert list(scratch.glob("SB3-*")) == []  # no logger folders left behind
    assert (a / "weights.safetensors").read_bytes() == (b / "weights.safetensors").read_bytes()
    ma, mb = (load_artifact(p, model="switch", format=FORMAT) for p in (a, b))
    assert ma.files == mb.files
    assert {**ma.training, "seconds": 0} == {**mb.training, "seconds": 0}


@pytest.mark.parametrize("stages", [4, 2])
def test_the_shipped_policy_records_how_to_train_it_again(stages: int) -> None:
    root = switch_artifact(stages)
    art = load_artifact(root, model="switch", format=FORMAT)
    t = dict(art.training)
    config = SwitchConfig.from_json(art.json("config.json"))
    kwargs: dict[str, Any] = {
        "seed": t["seed"],
        "timesteps": t["timesteps"],
        "n_envs": t["n_envs"],
        "settings": TrainSettings(),
        "stages": config.stages,
    }
    again = training_metadata(**kwargs)
    if stages == 4:  # trained before stages and models were recorded: its config has them
        again.pop("stages"), again.pop("models")
    else:  # one policy for the bench's CNN and the demo's GPT
        again = training_metadata(**(kwargs | {"models": ("gpt", "cnn")}))
        assert config.env["models"] == ["gpt", "cnn"]
    assert {k: v for k, v in t.items() if k != "seconds"} == again
    assert config.stages == config.env["stages"] == stages and config.hidden == (32, 16)
    assert sum(p.stat().st_size for p in root.iterdir()) < 300_000


@pytest.mark.parametrize("stages", [4, 2])
def test_learned_switch_acts_as_the_policy_did_in_the_environment(stages: int) -> None:
    policy = load_switch(stages=stages)
    controller = LearnedSwitch(policy)
    env = PipelineSwitch(settings=EpisodeSettings(stages=stages))
    actions = []
    for seed in (7, 8):
        obs, info = env.reset(seed=seed)
        done = False
        while not done:
            action = policy.act(obs)
            assert env.episode is not None
            decision = controller.decide(env.episode.observation())
            want = tuple(info["candidates"][0]) if action == 1 and info["candidates"] else None
            assert decision.bounds == want
            actions.append(action)
            obs, _, done, _, info = env.step(action)
    assert len(actions) == 38
    trace = generate("poisson-heavy", stages=stages, iterations=60, seed=5)
    episode = run_controller(controller, trace, env.settings, seed=5)
    assert episode.done and episode.throughput() > 0
