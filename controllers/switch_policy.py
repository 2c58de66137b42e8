"""The learned switch policy: AutoPipe's arbiter, trained with PPO in
``adaptipe/PipelineSwitch-v0`` and run by the manager as a `Controller`.

AutoPipe's arbiter is "a fully connected neural network ... two hidden layers with 32
and 16 neurons"; it reads the environment's metrics, the partition in force and the new
one, and outputs "whether or not to switch", rewarded by "the training speed of one
iteration ... [with] the normalized switching cost" (seed 003, §4.3). Here:

- **policy**: stable-baselines3 ``PPO("MlpPolicy")`` with actor and critic each
  ``tanh`` 32-16, on the environment's observation (`adaptipe.controllers.encode.encode`);
  action 0 keeps, 1 moves to the best candidate (`adaptipe.controllers.candidates.top_k`,
  k = 1, on the measured slowdowns).
- **reward**: the environment's samples/s net of the switch's stall (the cost is paid
  in the same seconds as the speed, so it is normalised by construction), divided by
  the quiet throughput of the initial plan so that it reads about 0.3-1.0 (see
  `_ScaledReward`).
- **artifact**: the actor (two ``Linear`` layers and the action head) and the
  observation normalisation (`VecNormalize`'s running mean and variance) as
  safetensors, and a JSON config; `load_switch` builds a fresh `SwitchPolicy` from the
  config and loads the weights into it. Nothing on the load path unpickles
  (``PPO.save``/``PPO.load`` would).
- `LearnedSwitch`: the `Controller` ("ppo") that lists the candidate, encodes and acts
  (argmax) exactly as the environment and ``PPO.predict(deterministic=True)`` did.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from adaptipe.controllers.artifacts import load_artifact, save_artifact, shipped
from adaptipe.controllers.base import Decision
from adaptipe.controllers.candidates import top_k
from adaptipe.controllers.encode import encode, encoded_size
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.replan import stage_slowdowns
from adaptipe.errors import PlanError

__all__ = [
    "ENV_ID",
    "FORMAT",
    "LearnedSwitch",
    "SwitchConfig",
    "SwitchPolicy",
    "TrainSettings",
    "from_sb3",
    "load_switch",
    "save_switch",
    "switch_artifact",
]

ENV_ID = "adaptipe/PipelineSwitch-v0"
MODEL = "switch"
FORMAT = 1
WEIGHTS, CONFIG = "weights.safetensors", "config.json"
Progress = Callable[[int, int], None]
SHIPPED_STAGES = {4: MODEL, 2: f"{MODEL}-2stages"}
"""The shipped policies: per stage count, its folder under ``controllers/artifacts``."""
DEFAULT_STAGES = 4  # the environments' default pipeline, and the first policy shipped


def switch_artifact(stages: int | None = None) -> Path:
    """The shipped policy's folder for ``stages`` stages (None: the default, 4).

    Raises:
        PlanError: no policy is shipped for ``stages``; the message names those that are.
    """
    n = DEFAULT_STAGES if stages is None else stages
    if n not in SHIPPED_STAGES:
        have = ", ".join(str(k) for k in sorted(SHIPPED_STAGES))
        raise PlanError(
            f"no shipped switch policy for {n} stages (shipped: {have} stages); "
            f"`adaptipe controllers train switch --stages {n} --out DIR` trains one"
        )
    return shipped(SHIPPED_STAGES[n])


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchConfig:
    """What a saved policy is: the network's shape, what it reads and the episodes it
    was trained on (`adaptipe.envs.episode.EpisodeSettings`'s fields)."""

    obs_size: int
    stages: int
    candidates: int = 1
    hidden: tuple[int, ...] = (32, 16)
    actions: int = 2
    activation: str = "tanh"
    obs_norm: bool = True
    clip_obs: float = 10.0
    epsilon: float = 1e-8
    env: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        want = encoded_size(self.stages, self.candidates)
        if self.obs_size != want:
            raise PlanError(
                f"switch policy: obs_size {self.obs_size} is not what this adaptipe encodes "
                f"for {self.stages} stages and {self.candidates} candidate(s) ({want}); "
                "retrain it with `adaptipe controllers train switch`"
            )
        if self.actions != self.candidates + 1 or self.activation != "tanh" or not self.hidden:
            raise PlanError(
                f"switch policy: unsupported network (actions {self.actions}, activation "
                f"{self.activation!r}, hidden {list(self.hidden)})"
            )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["hidden"], data["env"] = list(self.hidden), dict(self.env)
        return {"kind": "adaptipe-switch-policy", **data}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SwitchConfig:
        if data.get("kind") != "adaptipe-switch-policy":
            raise PlanError("switch policy: config.json is not a switch policy's config")
        fields = {k: v for k, v in data.items() if k != "kind"}
        try:
            return cls(**{**fields, "hidden": tuple(int(h) for h in fields.get("hidden", ()))})
        except TypeError as exc:
            raise PlanError(f"switch policy: bad config.json ({exc})") from None


class SwitchPolicy(torch.nn.Module):
    """The actor of SB3's ``MlpPolicy`` rebuilt from a `SwitchConfig`: observation
    normalisation (VecNormalize's), ``policy_net`` (Linear-Tanh per hidden layer) and
    ``action_net`` (the logits). Parameter names are SB3's, so its weights load as they
    are."""

    obs_mean: torch.Tensor
    obs_var: torch.Tensor

    def __init__(self, config: SwitchConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[torch.nn.Module] = []
        width = config.obs_size
        for h in config.hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.Tanh()]
            width = h
        self.policy_net = torch.nn.Sequential(*layers)
        self.action_net = torch.nn.Linear(width, config.actions)
        self.register_buffer("obs_mean", torch.zeros(config.obs_size, dtype=torch.float64))
        self.register_buffer("obs_var", torch.ones(config.obs_size, dtype=torch.float64))

    def normalize(self, obs: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """``obs`` as VecNormalize hands it to the policy (float64 arithmetic, as there)."""
        if not self.config.obs_norm:
            return obs.astype(np.float32)
        mean, var = self.obs_mean.numpy(), self.obs_var.numpy()
        c = self.config.clip_obs
        out: npt.NDArray[np.float64] = np.clip(
            (obs - mean) / np.sqrt(var + self.config.epsilon), -c, c
        )
        return out.astype(np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.action_net(self.policy_net(x))
        return logits

    @torch.no_grad()
    def act(self, obs: npt.NDArray[np.float32]) -> int:
        """The deterministic action (argmax of the logits) for one raw encoded observation."""
        if obs.shape != (self.config.obs_size,):
            raise PlanError(
                f"switch policy: observation of shape {obs.shape}, the policy reads "
                f"({self.config.obs_size},)"
            )
        x = torch.as_tensor(self.normalize(obs)).unsqueeze(0)
        return int(self(x).argmax(dim=1).item())


def save_switch(
    policy: SwitchPolicy,
    out: str | Path,
    *,
    training: Mapping[str, Any],
    metrics: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``policy`` as a ``switch`` artifact (`adaptipe.controllers.artifacts`)."""
    tensors = {k: v.detach().contiguous().clone() for k, v in policy.state_dict().items()}
    config = json.dumps(policy.config.to_json(), indent=1, sort_keys=True).encode()
    return save_artifact(
        out,
        model=MODEL,
        format=FORMAT,
        files={WEIGHTS: save_tensors(tensors), CONFIG: config},
        training=training,
        metrics=metrics,
    )


def load_switch(path: str | Path | None = None, *, stages: int | None = None) -> SwitchPolicy:
    """The policy in the artifact at ``path`` (default: the shipped one for ``stages``,
    `switch_artifact`), built fresh from its config and loaded from its safetensors;
    refused if the files were changed, the config does not match this adaptipe's
    encoder or the weights' shapes, or ``stages`` is given and differs from the
    policy's."""
    root = Path(path) if path is not None else switch_artifact(stages)
    art = load_artifact(root, model=MODEL, format=FORMAT)
    config = SwitchConfig.from_json(art.json(CONFIG))
    if stages is not None and stages != config.stages:
        raise PlanError(
            f"{root}: the switch policy was trained for {config.stages} stages, the pipeline "
            f"has {stages}; `adaptipe controllers train switch --stages {stages}` trains one"
        )
    policy = SwitchPolicy(config)
    tensors = load_tensors(art.files[WEIGHTS])
    try:
        policy.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise PlanError(f"{root}: the weights do not fit the config's network ({exc})") from None
    return policy.eval()


class LearnedSwitch:
    """The PPO switch policy as a `Controller`: move to the best candidate or keep."""

    name = "ppo"

    def __init__(self, policy: SwitchPolicy | None = None) -> None:
        self.policy = policy if policy is not None else load_switch()

    def decide(self, observation: Observation) -> Decision:
        k = self.policy.config.candidates
        if observation.num_stages != self.policy.config.stages:
            raise PlanError(
                f"ppo: the policy was trained for {self.policy.config.stages} stages, the "
                f"observation has {observation.num_stages}"
            )
        slow = stage_slowdowns(observation)
        found = top_k(observation, slow, k)  # as the environment lists them
        times = [t for _, t in found]
        times += [times[-1] if times else 0.0] * (k - len(times))
        action = self.policy.act(encode(observation, times, slowdowns=slow))
        if action == 0 or action > len(found):
            return Decision(reason=f"ppo keeps (action {action})")
        bounds, t = found[action - 1]
        return Decision(bounds=bounds, reason=f"ppo moves to {bounds} ({t * 1e3:.1f} ms)")


# ---------------------------------------------------------------------- training
@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSettings:
    """PPO's settings (SB3's names); the defaults are what the shipped policy used."""

    learning_rate: float = 3e-4
    n_steps: int = 256  # per environment and rollout
    batch_size: int = 64
    n_epochs: int = 10
    gamma: float = 0.9  # a move pays off over the next few steps, not the whole run
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    ent_coef: float = 0.0
    hidden: tuple[int, ...] = (32, 16)  # AutoPipe's arbiter
    obs_norm: bool = True


def from_sb3(
    model: Any, obs_rms: Any, env_settings: Mapping[str, Any], *, hidden: tuple[int, ...]
) -> SwitchPolicy:
    """A `SwitchPolicy` with the actor of SB3's ``model`` (a ``PPO``) and VecNormalize's
    ``obs_rms`` (None: no normalisation)."""
    stages = int(env_settings["stages"])
    config = SwitchConfig(
        obs_size=encoded_size(stages, 1),
        stages=stages,
        hidden=hidden,
        obs_norm=obs_rms is not None,
        env=dict(env_settings),
    )
    policy = SwitchPolicy(config)
    sb3 = model.policy
    policy.policy_net.load_state_dict(sb3.mlp_extractor.policy_net.state_dict())
    policy.action_net.load_state_dict(sb3.action_net.state_dict())
    if obs_rms is not None:
        policy.obs_mean.copy_(torch.as_tensor(obs_rms.mean, dtype=torch.float64))
        policy.obs_var.copy_(torch.as_tensor(obs_rms.var, dtype=torch.float64))
    return policy.eval()
