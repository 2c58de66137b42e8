"""AutoPipe's speed predictor: for (recent conditions, candidate partition), the mean
seconds per iteration over the next K iterations (AutoPipe §4.2, Fig. 7).

AutoPipe's meta-network runs an LSTM over the dynamic metrics (per-worker bandwidth and
per-layer forward/backward times, every iteration) and joins its state with the static
metrics (per-layer output, gradient and weight bytes; layer and worker counts) and the
partition through fully connected layers. The paper gives no sizes, window, loss or
target; what we chose, and why, is in ``docs/predictor.md``. In short:

**Encoding** (`encode`; every feature is a log-ratio or a fraction, so no learned
normalisation is needed and one network serves any speed of machine). ``ref`` is the
quiet pipeline's ideal iteration: the profiled work of all layers times the
micro-batches over the stages.

- *dynamic series* ``[window, L + 2 S]``, one row per observed iteration, oldest first:
  per layer ``log(measured / profiled)`` forward + backward seconds (0 where no stage
  reported it), per stage in force the same over the layers it holds (its slowdown),
  and per stage ``log(measured iteration seconds / ref)``;
- *static vector* ``[4 L + (S - 1)]``: per layer the profiled forward and backward
  share of the total work, ``log(bytes / mean bytes)`` of what a cut after it carries
  and of its state; per link ``log1p(boundary seconds / ref stage time)`` at the
  observed bandwidth; with ``device`` (off in the shipped artifact: it helped nothing
  on the simulated traces and real CPU readings lie far outside the synthetic ones) per
  stage the latest device features (`adaptipe.monitor.features`);
- *candidate vector* ``[L S + 2 S + 2 + 3]``: each layer's stage one-hot, per candidate
  stage its profiled work share (times the stage count) times the slowdown of the
  device that would hold it, once with the window's median slowdown and once with the
  latest iteration's, the analytical model's ``log(t / ref)`` and ``log(t / t in
  force)``, and per further `SCENARIOS` row (the last iteration's measured slowdowns,
  the mean of the last two, the median of the last three) ``log(t_row / t)``.

**Target** ``latest-ratio``: ``log(true / t_latest)``, ``t_latest`` being the simulator
fed the last iteration's measured stage slowdowns and the window's links. The network
learns only what that misses (measurement noise on one iteration, where the conditions
are heading, what a slowdown does to a stage it moves to) and starts from the best
single guess, instead of relearning the pipeline schedule. ``ratio`` (relative to the
analytical model on the window's median slowdowns, `adaptipe.controllers.candidates.score`)
and ``log-time`` (``log(true / ref)``) are kept for the comparisons in the docs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from adaptipe.controllers.artifacts import load_artifact, shipped
from adaptipe.controllers.candidates import layer_costs, link_bandwidths
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.replan import stage_slowdowns
from adaptipe.errors import PlanError
from adaptipe.monitor.features import FEATURES
from adaptipe.sim.conditions import iteration_times

__all__ = [
    "FORMAT",
    "Encoded",
    "Predictor",
    "PredictorConfig",
    "SpeedPredictor",
    "encode",
    "load_predictor",
]

FORMAT = 2
MODEL = "predictor"
TARGETS = ("latest-ratio", "ratio", "log-time")
SCENARIOS = ("median", "latest", "last-2", "last-3")  # the slowdowns the simulator is fed
Array = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictorConfig:
    """What the network is built from (``config.json``): the pipeline it serves and its
    sizes."""

    layers: int = 16
    stages: int = 4
    window: int = 8
    horizon: int = 10  # K: iterations the predicted mean covers
    hidden: int = 32  # LSTM state
    fc: tuple[int, ...] = (64, 32)
    target: str = "latest-ratio"
    device: bool = False  # the stages' device features in the static vector

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise PlanError(f"predictor: target must be one of {TARGETS} (got {self.target!r})")
        for name in ("layers", "stages", "window", "horizon", "hidden"):
            if int(getattr(self, name)) < 1:
                raise PlanError(f"predictor: {name} must be >= 1 (got {getattr(self, name)})")

    @property
    def dynamic_size(self) -> int:
        return self.layers + 2 * self.stages

    @property
    def static_size(self) -> int:
        features = len(FEATURES) if self.device else 0
        return 4 * self.layers + (self.stages - 1) + self.stages * features

    @property
    def candidate_size(self) -> int:
        return self.layers * self.stages + 2 * self.stages + 2 + len(SCENARIOS) - 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"fc": list(self.fc), "features": list(FEATURES) * self.device}

    @classmethod
    def from_json(cls, data: Any, *, source: str) -> PredictorConfig:
        try:
            features = list(data.pop("features", []))
            if data.get("device", True) and features != list(FEATURES):
                raise PlanError(f"{source}: device features differ from this adaptipe's")
            return cls(**(data | {"fc": tuple(int(v) for v in data["fc"])}))
        except (AttributeError, KeyError, TypeError) as exc:
            raise PlanError(f"{source}: not a predictor config ({exc})") from None


class SpeedPredictor(torch.nn.Module):
    """An LSTM over the dynamic series; its last state joined with the static and
    candidate vectors through fully connected layers to one output (the target)."""

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(config.dynamic_size, config.hidden, batch_first=True)
        joined = config.hidden + config.static_size + config.candidate_size
        layers: list[torch.nn.Module] = []
        for width in config.fc:
            layers += [torch.nn.Linear(joined, width), torch.nn.ReLU()]
            joined = width
        layers.append(torch.nn.Linear(joined, 1))
        self.head = torch.nn.Sequential(*layers)

    def forward(
        self, series: torch.Tensor, static: torch.Tensor, candidate: torch.Tensor
    ) -> torch.Tensor:
        """``series`` ``[B, window, D]``, ``static`` ``[B, F]``, ``candidate`` ``[B, C]``
        -> ``[B]``. Rows of ``series`` may repeat (one per candidate of a decision)."""
        _, (h, _) = self.lstm(series)
        out: torch.Tensor = self.head(torch.cat([h[-1], static, candidate], dim=1))
        return out.squeeze(1)


@dataclass(frozen=True, slots=True)
class Encoded:
    """One observation with its candidates, encoded (see the module doc)."""

    series: Array  # [window, dynamic_size]
    static: Array  # [static_size]
    candidates: Array  # [N, candidate_size]
    scenario_s: npt.NDArray[np.float64]  # [N, len(SCENARIOS)] the simulator's seconds
    ref_s: float

    @property
    def analytical_s(self) -> npt.NDArray[np.float64]:
        """The analytical model's seconds: fed the window's median slowdowns."""
        return self.scenario_s[:, 0]

    @property
    def latest_s(self) -> npt.NDArray[np.float64]:
        """The simulator fed the last iteration's measured slowdowns."""
        return self.scenario_s[:, 1]

    def base_s(self, target: str) -> npt.NDArray[np.float64]:
        """What the network's output multiplies (see `to_seconds`)."""
        return base_seconds(self.scenario_s, self.ref_s, target)


def _ref_s(obs: Observation) -> float:
    work = sum(obs.layer_forward_s) + sum(obs.layer_backward_s)
    return work * obs.microbatches / obs.num_stages


def _check(obs: Observation, config: PredictorConfig) -> None:
    if (obs.num_layers, obs.num_stages) != (config.layers, config.stages):
        raise PlanError(
            f"predictor: trained for {config.layers} layers on {config.stages} stages, the "
            f"observation has {obs.num_layers} on {obs.num_stages}; train one for this "
            "pipeline with `adaptipe controllers train predictor`"
        )
    if not obs.measured_forward_s:
        raise PlanError("predictor: the observation has no measured iteration yet")


def _series(obs: Observation, config: PredictorConfig, ref: float) -> Array:
    profiled = np.add(obs.layer_forward_s, obs.layer_backward_s)
    measured = np.add(obs.measured_forward_s, obs.measured_backward_s)  # [T, L]
    per_layer = np.where(np.isfinite(measured), np.log(np.maximum(measured, 1e-12) / profiled), 0)
    stage = np.empty((len(measured), config.stages))
    for s in range(config.stages):
        lo, hi = obs.bounds[s], obs.bounds[s + 1]
        got = np.nansum(measured[:, lo:hi], axis=1)
        stage[:, s] = np.where(got > 0, np.log(np.maximum(got, 1e-12) / profiled[lo:hi].sum()), 0)
    iteration = np.log(np.maximum(np.asarray(obs.stage_iteration_s, dtype=np.float64), 1e-12) / ref)
    rows = np.concatenate([per_layer, stage, iteration], axis=1)
    if len(rows) < config.window:  # a short window: repeat its oldest row
        rows = np.concatenate([np.repeat(rows[:1], config.window - len(rows), axis=0), rows])
    return rows[-config.window :].astype(np.float32)


def _static(obs: Observation, config: PredictorConfig, ref: float) -> Array:
    fwd, bwd = np.asarray(obs.layer_forward_s), np.asarray(obs.layer_backward_s)
    work = float(fwd.sum() + bwd.sum())
    cut = np.maximum(np.asarray(obs.boundary_bytes, dtype=np.float64), 1.0)
    state = np.maximum(np.asarray(obs.state_bytes, dtype=np.float64), 1.0)
    stage_mb = ref / obs.microbatches  # a stage's ideal seconds per micro-batch
    links = [
        math.log1p(float(np.mean(cut)) / bw / stage_mb) if math.isfinite(bw) and bw > 0 else 0.0
        for bw in link_bandwidths(obs, config.stages)
    ]
    device = np.zeros((config.stages, len(FEATURES) if config.device else 0))
    for s, row in enumerate(obs.device[: config.stages] if config.device else ()):
        device[s, : len(row)] = row
    return np.concatenate(
        [
            fwd / work,
            bwd / work,
            np.log(cut / cut.mean()),
            np.log(state / state.mean()),
            links,
            device.ravel(),
        ]
    ).astype(np.float32)


def _scenarios(obs: Observation, series: Array, config: PredictorConfig) -> Array:
    """Per `SCENARIOS` row, per stage the slowdown the simulator is fed: the window's
    median (`stage_slowdowns`), the last iteration's, the mean of the last two and the
    median of the last three measured."""
    per_iteration = np.exp(series[:, config.layers : config.layers + config.stages])
    return np.stack(
        [
            np.asarray(stage_slowdowns(obs)),
            per_iteration[-1],
            per_iteration[-2:].mean(axis=0),
            np.median(per_iteration[-3:], axis=0),
        ]
    ).astype(np.float32)


def _simulate(
    obs: Observation, wanted: Sequence[tuple[int, ...]], slow: Array
) -> dict[tuple[int, ...], npt.NDArray[np.float64]]:
    """Each partition's simulated seconds per iteration under each row of ``slow``."""
    costs = layer_costs(obs)
    stages = slow.shape[1]
    bws = np.tile(np.asarray(link_bandwidths(obs, stages), dtype=np.float64), (len(slow), 1))
    return {b: iteration_times(costs, b, slow, bws) for b in dict.fromkeys(wanted)}


def _candidate(
    obs: Observation,
    bounds: Sequence[int],
    slow: Array,
    times: npt.NDArray[np.float64],
    now: float,
    ref: float,
) -> Array:
    layers, stages = obs.num_layers, len(bounds) - 1
    work = np.add(obs.layer_forward_s, obs.layer_backward_s)
    onehot = np.zeros((layers, stages))
    share = np.zeros(stages)
    for s in range(stages):
        onehot[bounds[s] : bounds[s + 1], s] = 1.0
        share[s] = work[bounds[s] : bounds[s + 1]].sum() / work.sum() * stages
    return np.concatenate(
        [
            onehot.ravel(),
            share * slow[0],
            share * slow[1],
            [math.log(times[0] / ref), math.log(times[0] / now)],
            np.log(times[1:] / times[0]),
        ]
    ).astype(np.float32)


def encode(
    obs: Observation, candidates: Sequence[Sequence[int]], config: PredictorConfig
) -> Encoded:
    """``obs`` and ``candidates`` (each a partition into the stages in force) as the
    network's inputs, with the simulator's seconds for each candidate under each of
    `SCENARIOS`."""
    _check(obs, config)
    for bounds in candidates:
        if len(bounds) != config.stages + 1 or bounds[0] != 0 or bounds[-1] != config.layers:
            raise PlanError(f"predictor: {list(bounds)} is not a partition of this pipeline")
    ref = _ref_s(obs)
    series = _series(obs, config, ref)
    slow = _scenarios(obs, series, config)
    wanted = [tuple(int(b) for b in c) for c in candidates]
    times = _simulate(obs, [*wanted, tuple(obs.bounds)], slow)
    now = float(times[tuple(obs.bounds)][0])
    cand = [_candidate(obs, c, slow, times[c], now, ref) for c in wanted]
    empty = np.zeros((0, len(SCENARIOS)))
    return Encoded(
        series=series,
        static=_static(obs, config, ref),
        candidates=np.stack(cand) if cand else np.zeros((0, config.candidate_size), np.float32),
        scenario_s=np.stack([times[c] for c in wanted]) if wanted else empty,
        ref_s=ref,
    )


def base_seconds(
    scenario_s: npt.NDArray[np.float64], ref_s: float | npt.NDArray[np.float64], target: str
) -> npt.NDArray[np.float64]:
    """Per candidate the seconds the target is relative to: the simulator on the last
    iteration's slowdowns (``latest-ratio``), on the window's median (``ratio``), or
    the quiet pipeline's ``ref`` (``log-time``)."""
    if target == "latest-ratio":
        return np.asarray(scenario_s[:, 1], dtype=np.float64)
    if target == "ratio":
        return np.asarray(scenario_s[:, 0], dtype=np.float64)
    return np.broadcast_to(np.asarray(ref_s, dtype=np.float64), scenario_s.shape[:1]).copy()


def to_seconds(
    output: npt.NDArray[np.float64], base_s: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """The network's outputs (``log(seconds / base)``) as seconds per iteration."""
    return np.asarray(base_s * np.exp(output), dtype=np.float64)


class Predictor:
    """A trained `SpeedPredictor` with its config: `predict` in seconds per iteration."""

    def __init__(self, network: SpeedPredictor, config: PredictorConfig, *, meta: Any = None):
        self.network, self.config = network.eval(), config
        self.meta: Mapping[str, Any] = meta or {}

    def predict(self, obs: Observation, candidates: Sequence[Sequence[int]]) -> list[float]:
        """The mean seconds per iteration of each candidate over the next K iterations."""
        return self.predict_encoded(obs, candidates)[0]

    def predict_encoded(
        self, obs: Observation, candidates: Sequence[Sequence[int]]
    ) -> tuple[list[float], Encoded]:
        """`predict`, and the inputs it encoded (what online fine-tuning learns from)."""
        enc = encode(obs, candidates, self.config)
        if not len(enc.candidates):
            return [], enc
        n = len(enc.candidates)
        network = self.network  # one network for the call: online tuning swaps it
        with torch.inference_mode():
            out = network(
                torch.from_numpy(enc.series).expand(n, -1, -1),
                torch.from_numpy(enc.static).expand(n, -1),
                torch.from_numpy(enc.candidates),
            )
        seconds = to_seconds(out.double().numpy(), enc.base_s(self.config.target))
        return [float(v) for v in seconds], enc


def load_predictor(path: str | Path | None = None) -> Predictor:
    """The predictor artifact in ``path`` (default: the shipped one), into a freshly
    built network; refused when missing, tampered or built for another config."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_tensors

    art = load_artifact(shipped(MODEL) if path is None else path, model=MODEL, format=FORMAT)
    where = f"{art.root}/config.json"
    config = PredictorConfig.from_json(art.json("config.json"), source=where)
    network = SpeedPredictor(config)
    try:
        state = load_tensors(art.files["weights.safetensors"])
        network.load_state_dict(state, strict=True)
    except KeyError:
        raise PlanError(f"{art.root}: the artifact has no weights.safetensors") from None
    except (RuntimeError, SafetensorError) as exc:
        raise PlanError(
            f"{art.root}: the weights do not fit {where} ({str(exc).splitlines()[0]}); retrain "
            "it with `adaptipe controllers train predictor`"
        ) from None
    return Predictor(network, config, meta={"training": art.training, "metrics": art.metrics})


def config_bytes(config: PredictorConfig) -> bytes:
    return (json.dumps(config.to_json(), indent=1, sort_keys=True) + "\n").encode()
