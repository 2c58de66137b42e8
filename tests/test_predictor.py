"""The LSTM speed predictor (`adaptipe.controllers.predictor`): its encoding's shapes,
an artifact that round-trips and refuses tampering or a config it does not fit, seeded
training that reproduces itself, a trained model that beats a constant, the shipped
artifact's pinned metadata, the state oracle (`adaptipe.envs.predictor_bound`) and the
evaluation on recorded runs (`adaptipe.envs.predictor_eval`, ``tests/recorded/``)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from adaptipe.controllers.observation import Observation
from adaptipe.controllers.predictor import (
    SCENARIOS,
    PredictorConfig,
    encode,
    load_predictor,
)
from adaptipe.envs.episode import Episode, EpisodeSettings
from adaptipe.envs.generators import generate
from adaptipe.envs.predictor_bound import oracle_mape, process_of
from adaptipe.envs.predictor_eval import compact_run, recorded_report, recorded_samples
from adaptipe.envs.predictor_train import Dataset, rollout, train_predictor
from adaptipe.errors import PlanError

RECORDED = Path(__file__).parent / "recorded"

TINY: dict[str, Any] = {
    "episodes": 1,
    "iterations": 60,
    "epochs": 4,
    "families": ("poisson-heavy",),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return train_predictor(seed=3, out=tmp_path_factory.mktemp("p") / "a", **TINY)


def _observation() -> Observation:
    settings = EpisodeSettings()
    episode = Episode(generate("poisson-heavy", stages=4, iterations=40, seed=5), settings, seed=1)
    episode.run()
    return episode.observation()


def test_encoding_has_the_configs_shapes() -> None:
    obs = _observation()
    config = PredictorConfig()
    cands = [obs.bounds, (0, 3, 7, 11, 16), (0, 5, 9, 13, 16)]
    enc = encode(obs, cands, config)
    assert enc.series.shape == (config.window, config.dynamic_size) == (8, 16 + 8)
    assert enc.static.shape == (config.static_size,)
    assert enc.candidates.shape == (3, config.candidate_size)
    assert enc.analytical_s.shape == (3,) and np.all(enc.analytical_s > 0)
    assert enc.scenario_s.shape == (3, len(SCENARIOS)) and np.all(enc.latest_s > 0)
    # the analytical model is the one `score` gives, and the base is the latest's
    assert enc.base_s("latest-ratio").tolist() == enc.latest_s.tolist()
    assert np.isfinite(enc.series).all() and np.isfinite(enc.candidates).all()
    # the one-hot says which stage holds each layer
    onehot = enc.candidates[1, : 16 * 4].reshape(16, 4)
    assert onehot.sum(axis=1).tolist() == [1.0] * 16 and onehot[3].argmax() == 1


def test_an_observation_of_another_pipeline_is_refused() -> None:
    with pytest.raises(PlanError, match="trained for 16 layers on 3 stages"):
        encode(_observation(), [], PredictorConfig(stages=3))
    with pytest.raises(PlanError, match="is not a partition of this pipeline"):
        encode(_observation(), [(0, 8, 16)], PredictorConfig())


def test_the_artifact_round_trips_to_the_same_predictions(trained: Path) -> None:
    obs = _observation()
    cands = [obs.bounds, (0, 3, 7, 11, 16)]
    first, again = load_predictor(trained), load_predictor(trained)
    assert first.predict(obs, cands) == again.predict(obs, cands)
    assert all(v > 0 for v in first.predict(obs, cands))
    assert first.meta["training"]["seed"] == 3


def test_a_tampered_or_mismatched_artifact_is_refused(trained: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(trained, tmp_path / "tampered"))
    blob = bytearray((bad / "weights.safetensors").read_bytes())
    blob[-1] ^= 1
    (bad / "weights.safetensors").write_bytes(bytes(blob))
    with pytest.raises(PlanError, match="changed after training"):
        load_predictor(bad)
    # a config that the weights do not fit, with its digest made to match
    other = Path(shutil.copytree(trained, tmp_path / "mismatched"))
    config = json.loads((other / "config.json").read_text()) | {"hidden": 16}
    data = (json.dumps(config) + "\n").encode()
    (other / "config.json").write_bytes(data)
    manifest = json.loads((other / "artifact.json").read_text())
    manifest["files"]["config.json"] = hashlib.sha256(data).hexdigest()
    (other / "artifact.json").write_text(json.dumps(manifest))
    with pytest.raises(PlanError, match="the weights do not fit"):
        load_predictor(other)


def test_seeded_training_is_reproducible(trained: Path, tmp_path: Path) -> None:
    again = train_predictor(seed=3, out=tmp_path / "b", **TINY)
    a, b = (json.loads((p / "artifact.json").read_text()) for p in (trained, again))
    for m in (a, b):
        for key in ("seconds", "data_seconds"):
            m["training"].pop(key)
    assert a["training"] == b["training"] and a["metrics"] == b["metrics"]
    assert a["files"] == b["files"]  # same sha256: the same weights and config, byte for byte


def test_the_trained_model_beats_a_constant(trained: Path) -> None:
    predictor = load_predictor(trained)
    data = Dataset()
    trace = generate("poisson-heavy", stages=4, iterations=60, seed=999_000)
    rollout(trace, EpisodeSettings(), predictor.config, data, seed=7, switch_p=0.25)
    true = np.asarray(data.true_s)
    series, static, cand, decision = data.tensors()
    with torch.inference_mode():
        out = predictor.network(series[decision], static[decision], cand).double().numpy()
    pred = data.base_s(predictor.config.target) * np.exp(out)
    constant = np.full_like(true, np.median(true))  # the best constant, in hindsight
    assert np.mean(np.abs(pred / true - 1)) < np.mean(np.abs(constant / true - 1))


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 5 minutes of rollouts and training
def test_seeded_training_reproduces_the_shipped_artifact(tmp_path: Path) -> None:
    from adaptipe.controllers.artifacts import shipped

    again = train_predictor(seed=0, out=tmp_path / "shipped")
    a, b = (json.loads((p / "artifact.json").read_text()) for p in (shipped("predictor"), again))
    for m in (a, b):
        for key in ("seconds", "data_seconds"):
            m["training"].pop(key)
    assert a["training"] == b["training"] and a["metrics"] == b["metrics"]
    assert a["files"] == b["files"]


def test_the_shipped_artifact_is_the_documented_one() -> None:
    predictor = load_predictor()
    config, training = predictor.config, predictor.meta["training"]
    assert (config.layers, config.stages, config.window, config.horizon) == (16, 4, 8, 10)
    assert (config.target, config.device, config.hidden, config.fc) == (
        "latest-ratio",
        False,
        32,
        (64, 32),
    )
    assert (training["seed"], training["epochs"], training["sizes"]["episodes"]) == (0, 15, 50)
    assert training["seconds"] < 600  # the target: under 10 minutes on this CPU
    metrics = predictor.meta["metrics"]["train_mape"]
    assert metrics["predictor"] < metrics["latest"] < metrics["analytical"]


def test_the_state_oracle_knows_job_free_families_and_hedges_job_arrivals() -> None:
    assert process_of("bandwidth-steps") is None and process_of("preemption") is None
    heavy = process_of("poisson-heavy")
    assert heavy is not None and heavy.rate == pytest.approx(3 / 60)
    mix = process_of("mixture")
    assert mix is not None and mix.family == "poisson-light"
    settings = EpisodeSettings()
    traces = {}
    data = Dataset()
    for family in ("preemption", "poisson-heavy"):
        trace = generate(family, stages=4, iterations=60, seed=11)
        traces[family, 11] = trace
        rollout(trace, settings, PredictorConfig(), data, seed=1, switch_p=0.0)
    kwargs: dict[str, Any] = {
        "family": data.family,
        "trace_seed": data.trace_seed,
        "first": data.first,
    }
    kwargs |= {"bounds": data.bounds, "true_s": data.true_s}
    costs = settings.layer_costs()
    bound = oracle_mape(traces, costs, k=10, samples=64, **kwargs)
    persistence = np.mean(np.abs(np.asarray(data.persist_s) / np.asarray(data.true_s) - 1))
    assert 0 <= bound <= 1.5 * persistence + 1e-3
    quiet = [n for n, f in enumerate(data.family) if f == "preemption"]
    only: dict[str, Any] = {k: [v[n] for n in quiet] for k, v in kwargs.items()}
    assert oracle_mape(traces, costs, k=10, **only) == 0.0


def test_a_recorded_run_gives_one_sample_per_iteration_with_its_noise_floor() -> None:
    samples, meta = recorded_samples(RECORDED / "quiet")
    assert meta["iterations"] == 110 and meta["baseline"] == [1, 8] and meta["injections"] == 0
    assert len(samples) == 110 - 10 - 9  # from iteration 10 to the last full K
    assert all(s.obs.bounds == (0, 4, 8, 12, 16) and len(s.obs.iterations) == 8 for s in samples)
    floor = np.mean([abs(s.previous_s / s.true_s - 1) for s in samples])
    assert 0.01 < floor < 0.3  # a shared 2-core machine: far from a quiet one


def test_a_compacted_run_reads_as_the_run(tmp_path: Path) -> None:
    again = compact_run(RECORDED / "steps", tmp_path / "steps")
    (a, meta_a), (b, meta_b) = recorded_samples(RECORDED / "steps"), recorded_samples(again)
    assert meta_a == meta_b and meta_a["injections"] == 3
    assert [s.true_s for s in a] == pytest.approx([s.true_s for s in b], rel=1e-3)


def test_the_recorded_report_scores_the_predictor_beside_the_baselines(trained: Path) -> None:
    report = recorded_report(load_predictor(trained), [RECORDED / "quiet"])
    row = report["quiet"]
    assert row["samples"] == 91
    assert {"predictor", "analytical", "latest", "previous"} <= set(row)
    assert all(0 < row[k] < 1 for k in ("predictor", "analytical", "latest", "previous"))
