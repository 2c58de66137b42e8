"""The speed predictor's data, training and evaluation (`adaptipe.controllers.predictor`).

**Data** (`rollout`): an `Episode` per trace of the training families
(`adaptipe.envs.heldout.TRAINING_FAMILIES`, seeds below ``HELD_OUT_SEED``) on
`EpisodeSettings` (the zoo GPT on 4 stages by default). At every step after the first
(whose window is then full) the observation is encoded with the partition in force, the
analytical model's best three candidates (`top_k`) and two drawn at random from the
AutoPipe and DynPipe families; each one's label is the true mean seconds of the next K
iterations on it: the simulator (`iteration_times`) on the trace's next K rows of
slowdowns and bandwidths. Then the episode trains the step, on a random candidate with
probability ``switch_p`` so that partitions in force vary and windows straddle switches.
Preemption stalls are left out of the label: they do not depend on the partition and a
constant hazard cannot be predicted from any window.

**Training** (`train_predictor`): Adam on the L1 loss of the log target (the L1 of a
log-ratio is the relative error to first order, so the loss is the MAPE it is judged
by), mini-batches drawn from a seeded generator, one thread: two runs with one seed
give the same weights.

**Evaluation** (`evaluate`): MAPE per trace family of the predictor, the analytical
model, ``latest`` and persistence on the same (observation, candidate) pairs, and on
request the state oracle's (`adaptipe.envs.predictor_bound`); `noise_floor`: the MAPE
of predicting each K-iteration mean of the measured iteration seconds by the previous
one on a run with no interference. Real runs: `adaptipe.envs.predictor_eval`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from adaptipe.controllers.artifacts import save_artifact, shipped
from adaptipe.controllers.candidates import candidates, top_k
from adaptipe.controllers.predictor import (
    FORMAT,
    MODEL,
    Predictor,
    PredictorConfig,
    SpeedPredictor,
    base_seconds,
    config_bytes,
    encode,
    to_seconds,
)
from adaptipe.controllers.replan import stage_slowdowns
from adaptipe.envs.episode import Episode, EpisodeSettings
from adaptipe.envs.generators import generate
from adaptipe.envs.heldout import HELD_OUT_SEED, TRAINING_FAMILIES
from adaptipe.envs.trace import Trace
from adaptipe.errors import PlanError
from adaptipe.monitor.schema import StageStats
from adaptipe.sim.conditions import iteration_times

__all__ = ["Dataset", "TrainSizes", "evaluate", "noise_floor", "rollout", "train_predictor"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSizes:
    """How much data and training (``**sizes`` of `train_predictor`)."""

    episodes: int = 50  # per training family
    iterations: int = 200  # per trace (the held-out traces' length)
    epochs: int = 15  # more overfit: 30 and 80 epochs were worse on the held-out traces
    batch: int = 256
    lr: float = 3e-3
    hidden: int = 32
    fc: tuple[int, ...] = (64, 32)
    target: str = "latest-ratio"
    switch_p: float = 0.25
    # what a real run adds to the simulated iteration (waits, transfers, Python), drawn
    # log-uniformly per training trace: the measured iteration seconds tell it
    overhead: tuple[float, float] = (1.0, 1.0)
    families: tuple[str, ...] = TRAINING_FAMILIES


@dataclass(slots=True)
class Dataset:
    """Encoded samples: one series and static vector per decision, one candidate row
    per (decision, candidate) with its decision's index."""

    series: list[npt.NDArray[np.float32]] = field(default_factory=list)
    static: list[npt.NDArray[np.float32]] = field(default_factory=list)
    candidate: list[npt.NDArray[np.float32]] = field(default_factory=list)
    decision: list[int] = field(default_factory=list)
    scenario_s: list[npt.NDArray[np.float64]] = field(default_factory=list)  # [SCENARIOS]
    ref_s: list[float] = field(default_factory=list)
    true_s: list[float] = field(default_factory=list)
    persist_s: list[float] = field(default_factory=list)  # the last iteration's true conditions
    family: list[str] = field(default_factory=list)
    trace_seed: list[int] = field(default_factory=list)  # where each sample was taken:
    first: list[int] = field(default_factory=list)  # the label's first iteration
    bounds: list[tuple[int, ...]] = field(default_factory=list)  # the candidate

    def __len__(self) -> int:
        return len(self.true_s)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            torch.from_numpy(np.stack(self.series)),
            torch.from_numpy(np.stack(self.static)),
            torch.from_numpy(np.stack(self.candidate)),
            torch.tensor(self.decision),
        )

    def base_s(self, kind: str) -> npt.NDArray[np.float64]:
        return base_seconds(np.stack(self.scenario_s), np.asarray(self.ref_s), kind)

    def target(self, kind: str) -> torch.Tensor:
        true = np.asarray(self.true_s)
        return torch.from_numpy(np.log(true / self.base_s(kind)).astype(np.float32))


def rollout(
    trace: Trace,
    settings: EpisodeSettings,
    config: PredictorConfig,
    data: Dataset,
    *,
    seed: int,
    switch_p: float,
    overhead: float = 1.0,
) -> None:
    """Append one episode's samples on ``trace`` to ``data`` (see the module doc);
    ``overhead`` multiplies the measured iteration seconds and the labels."""
    rng = np.random.default_rng(seed)
    episode = Episode(trace, settings, seed=seed)
    slow_true, bws_true = trace.slowdowns(), trace.bandwidths()
    k = settings.iterations_per_step
    episode.run()
    while episode.iteration + k <= trace.iterations:
        first = episode.iteration
        obs = episode.observation()
        if overhead != 1.0:
            iteration_s = tuple(tuple(v * overhead for v in row) for row in obs.stage_iteration_s)
            obs = dataclasses.replace(obs, stage_iteration_s=iteration_s)
        slow = stage_slowdowns(obs)
        pool = sorted(set(candidates(obs, slow)) - {tuple(obs.bounds)})
        chosen = [tuple(obs.bounds), *(b for b, _ in top_k(obs, slow, 3))]
        for i in rng.permutation(len(pool))[:2]:
            chosen.append(pool[int(i)])
        chosen = list(dict.fromkeys(chosen))
        enc = encode(obs, chosen, config)
        data.series.append(enc.series)
        data.static.append(enc.static)
        for n, bounds in enumerate(chosen):
            times = iteration_times(
                episode.costs, bounds, slow_true[first : first + k], bws_true[first : first + k]
            )
            data.candidate.append(enc.candidates[n])
            data.decision.append(len(data.series) - 1)
            data.scenario_s.append(enc.scenario_s[n])
            data.ref_s.append(enc.ref_s)
            data.true_s.append(float(np.mean(times)) * overhead)
            now = iteration_times(
                episode.costs, bounds, slow_true[first - 1 : first], bws_true[first - 1 : first]
            )
            data.persist_s.append(float(now[0]) * overhead)
            data.family.append(trace.family)
            data.trace_seed.append(_seed_of(trace))
            data.first.append(first)
            data.bounds.append(bounds)
        move = pool[int(rng.integers(len(pool)))] if pool and rng.random() < switch_p else None
        episode.run(move)


def _seed_of(trace: Trace) -> int:
    return -1 if trace.seed is None else trace.seed  # a recorded trace has none


def _settings(settings: EpisodeSettings | None) -> EpisodeSettings:
    return settings if settings is not None else EpisodeSettings()


def _config(settings: EpisodeSettings, sizes: TrainSizes) -> PredictorConfig:
    return PredictorConfig(
        layers=len(settings.profile.layers),
        stages=settings.stages,
        window=settings.window,
        horizon=settings.iterations_per_step,
        hidden=sizes.hidden,
        fc=tuple(sizes.fc),
        target=sizes.target,
    )


def training_data(
    sizes: TrainSizes, settings: EpisodeSettings, config: PredictorConfig, *, seed: int
) -> Dataset:
    """Rollouts on ``sizes.episodes`` traces of each training family, trace seeds
    ``seed * 10_000 + n`` (all below ``HELD_OUT_SEED``)."""
    if seed < 0 or seed * 10_000 + sizes.episodes * len(sizes.families) >= HELD_OUT_SEED:
        raise PlanError(f"train_predictor: seed must be in 0..{HELD_OUT_SEED // 10_000 - 1}")
    bad = [f for f in sizes.families if f not in TRAINING_FAMILIES]
    if bad:
        raise PlanError(f"train_predictor: {bad} are not training families {TRAINING_FAMILIES}")
    data = Dataset()
    n = seed * 10_000
    for family in sizes.families:
        for _ in range(sizes.episodes):
            trace = generate(family, stages=settings.stages, iterations=sizes.iterations, seed=n)
            low, high = np.log(sizes.overhead)
            overhead = float(np.exp(np.random.default_rng([n, 1]).uniform(low, high)))
            rollout(
                trace, settings, config, data, seed=n, switch_p=sizes.switch_p, overhead=overhead
            )
            n += 1
    return data


def _fit(network: SpeedPredictor, data: Dataset, sizes: TrainSizes, *, seed: int) -> list[float]:
    series, static, cand, decision = data.tensors()
    target = data.target(sizes.target)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(network.parameters(), lr=sizes.lr)
    steps = sizes.epochs * math.ceil(len(target) / sizes.batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
    losses = []
    network.train()
    for _ in range(sizes.epochs):
        total = 0.0
        for idx in torch.split(torch.randperm(len(target), generator=gen), sizes.batch):
            d = decision[idx]
            loss = torch.nn.functional.l1_loss(
                network(series[d], static[d], cand[idx]), target[idx]
            )
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        losses.append(total / len(target))
    network.eval()
    return losses


def train_predictor(
    *,
    seed: int = 0,
    out: Path | None = None,
    progress: Callable[[str], None] | None = None,
    settings: EpisodeSettings | None = None,
    **sizes: Any,
) -> Path:
    """Generate the rollouts, train, and save the artifact (model ``predictor``) in
    ``out`` (default: the shipped ``controllers/artifacts/predictor``); ``sizes``:
    fields of `TrainSizes`. Seeded: one seed gives the same weights and metadata."""
    from safetensors.torch import save as save_tensors

    say = progress or (lambda _msg: None)
    try:
        chosen = TrainSizes(**sizes)
    except TypeError as exc:
        raise PlanError(f"train_predictor: {exc}") from None
    settings = _settings(settings)
    config = _config(settings, chosen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        data = training_data(chosen, settings, config, seed=seed)
        made = time.perf_counter() - start
        say(f"predictor: {len(data)} samples from {len(data.series)} decisions in {made:.1f} s")
        torch.manual_seed(seed)
        network = SpeedPredictor(config)
        losses = _fit(network, data, chosen, seed=seed)
        seconds = time.perf_counter() - start
        say(f"predictor: trained {chosen.epochs} epochs, loss {losses[-1]:.4f}, {seconds:.1f} s")
        predictor = Predictor(network, config)
        fit = _mape_on(predictor, data)
    finally:
        torch.set_num_threads(threads)
    training = {
        "seed": seed,
        "samples": len(data),
        "decisions": len(data.series),
        "epochs": chosen.epochs,
        "seconds": round(seconds, 1),
        "data_seconds": round(made, 1),
        "data": (
            f"rollouts of {chosen.episodes} traces x {list(chosen.families)} "
            f"({chosen.iterations} iterations, seeds {seed * 10_000}.."
            f"{seed * 10_000 + chosen.episodes * len(chosen.families) - 1}) on "
            f"{settings.model}, {settings.stages} stages, {settings.microbatches} micro-batches"
        ),
        "sizes": _jsonable(dataclasses.asdict(chosen)),
        "final_loss": round(losses[-1], 6),
    }
    state = {k: v.contiguous() for k, v in network.state_dict().items()}
    return save_artifact(
        shipped(MODEL) if out is None else out,
        model=MODEL,
        format=FORMAT,
        files={"weights.safetensors": save_tensors(state), "config.json": config_bytes(config)},
        training=training,
        metrics={"train_mape": fit},
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _mape_on(predictor: Predictor, data: Dataset) -> dict[str, float]:
    """MAPE on ``data``'s samples, all families together, of the predictor, the
    analytical model, and persistence: the simulator fed the true conditions of the last
    observed iteration (no measurement noise; what is left is the conditions changing
    within the next K iterations)."""
    series, static, cand, decision = data.tensors()
    with torch.inference_mode():
        out = predictor.network(series[decision], static[decision], cand).double().numpy()
    scenario = np.stack(data.scenario_s)
    pred = to_seconds(out, data.base_s(predictor.config.target))
    true = np.asarray(data.true_s)

    def mape(guess: npt.NDArray[np.float64]) -> float:
        return round(float(np.mean(np.abs(guess / true - 1))), 5)

    return {
        "predictor": mape(pred),
        "analytical": mape(scenario[:, 0]),
        "latest": mape(scenario[:, 1]),
        "persistence": mape(np.asarray(data.persist_s)),
    }


def _rollouts(
    traces: Sequence[Trace], settings: EpisodeSettings, config: PredictorConfig, *, seed: int
) -> dict[str, Dataset]:
    by_family: dict[str, Dataset] = {}
    for n, trace in enumerate(traces):
        data = by_family.setdefault(trace.family, Dataset())
        rollout(trace, settings, config, data, seed=seed + n, switch_p=0.25)
    return by_family


def evaluate(
    predictor: Predictor,
    traces: Sequence[Trace],
    *,
    settings: EpisodeSettings | None = None,
    seed: int = 0,
    bound: bool = False,
) -> dict[str, dict[str, float]]:
    """Per trace family: the MAPE of the predictor, the analytical model, ``latest``
    (the simulator fed the last iteration's measured slowdowns) and persistence on the
    rollouts' (observation, candidate) pairs, and how many pairs; with ``bound`` the
    state oracle's (`adaptipe.envs.predictor_bound`)."""
    from adaptipe.envs.predictor_bound import oracle_mape

    settings = _settings(settings)
    by_family = _rollouts(traces, settings, predictor.config, seed=seed)
    by_key = {(t.family, _seed_of(t)): t for t in traces}
    out = {}
    for family, data in by_family.items():
        out[family] = _mape_on(predictor, data) | {"pairs": len(data)}
        if bound:
            out[family]["state_oracle"] = round(
                oracle_mape(
                    by_key,
                    settings.layer_costs(),
                    family=data.family,
                    trace_seed=data.trace_seed,
                    first=data.first,
                    bounds=data.bounds,
                    true_s=data.true_s,
                    k=settings.iterations_per_step,
                ),
                5,
            )
    return out


def noise_floor(*, settings: EpisodeSettings | None = None, iterations: int = 400) -> float:
    """MAPE of predicting each K-iteration mean of the measured iteration seconds (the
    stages' mean) by the previous one, on a run with no interference (one 100 Gbit/s
    link step: nothing changes but the measurement noise)."""
    settings = _settings(settings)
    trace = generate(
        "bandwidth-steps", stages=settings.stages, iterations=iterations, seed=0, steps_gbit=[100.0]
    )
    episode = Episode(trace, settings, seed=0)
    means = []
    while not episode.done:
        first = episode.iteration
        episode.run()
        rows = [r for r in episode.records if isinstance(r, StageStats) and r.iteration >= first]
        means.append(float(np.mean([r.iteration_s for r in rows])))
    m = np.asarray(means)
    return float(np.mean(np.abs(m[:-1] / m[1:] - 1)))


def heldout_report(
    predictor: Predictor, *, settings: EpisodeSettings | None = None, bound: bool = False
) -> dict[str, Any]:
    """`evaluate` on the held-out manifest's traces, with the noise floor."""
    from adaptipe.envs.heldout import heldout_traces

    traces = heldout_traces()
    return {
        "families": evaluate(predictor, traces, settings=settings, seed=HELD_OUT_SEED, bound=bound),
        "noise_floor": round(noise_floor(settings=settings), 5),
    }
