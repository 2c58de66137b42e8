"""The random-forest interference model (`adaptipe.controllers.interference`): its inputs,
its artifact (round trip, tampering, untrusted types refused), seeded training that
reproduces the shipped artifact's data, and the forest ahead of linear regression on
scenario-grouped cross-validation. Small data: the whole file runs in seconds."""

from __future__ import annotations

import csv
import functools
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression

from adaptipe.controllers.artifacts import shipped
from adaptipe.controllers.interference import (
    FOREST_FILE,
    FOREST_PARAMS,
    INPUTS,
    InterferenceModel,
    StageInfo,
    features,
    load_interference,
    stage_info,
)
from adaptipe.envs.episode import load_profile
from adaptipe.envs.interference_cv import grouped_cv
from adaptipe.envs.interference_data import (
    MEASURED,
    Dataset,
    TraceSpec,
    build_dataset,
    csv_rows,
)
from adaptipe.envs.interference_train import train_interference
from adaptipe.errors import PlanError
from adaptipe.inject.dataset import COLUMNS
from adaptipe.monitor.features import FEATURES
from adaptipe.monitor.schema import DeviceSample

SMALL = TraceSpec(families=("poisson-heavy", "mixture"), seeds=3, iterations=40, stages=2)


@functools.cache
def _small() -> Dataset:
    return build_dataset(spec=SMALL)


@functools.cache
def _model() -> InterferenceModel:
    ds = _small()
    return InterferenceModel.fit(ds.x, ds.y, seed=0)


def test_features_have_the_documented_length_and_order() -> None:
    info = stage_info(load_profile("gpt"), (0, 5, 16), 1)
    sample = DeviceSample(stage=1, time_s=0.0, source="cpu", fields={"util_pct": 50.0})
    row = features(sample, info)
    assert row.shape == (len(INPUTS),) == (len(FEATURES) + len(StageInfo.NAMES),)
    assert INPUTS[: len(FEATURES)] == FEATURES and row[FEATURES.index("util")] == 0.5
    assert row[INPUTS.index("stage_layers")] == 11
    assert np.array_equal(features(row[: len(FEATURES)], info), row)  # an Observation.device row
    with pytest.raises(PlanError, match="device row has 18 values"):
        features([0.0, 1.0], info)


def test_packed_prediction_equals_the_forest_and_takes_one_row() -> None:
    ds, model = _small(), _model()
    # equal up to the order of the sum over trees
    packed = np.concatenate([model.predict(ds.x[i : i + 100]) for i in range(0, len(ds), 100)])
    np.testing.assert_allclose(packed, model.forest.predict(ds.x), rtol=1e-12, atol=0)
    assert model.predict(ds.x[3]).shape == (1,)


def test_an_artifact_round_trips_with_equal_predictions(tmp_path: Path) -> None:
    spec = TraceSpec(families=("poisson-heavy",), seeds=2, iterations=20, stages=2)
    ds = build_dataset(spec=spec, data=MEASURED)  # the shipped measured rows by default
    root = train_interference(seed=3, out=tmp_path / "a", spec=spec, folds=2)
    loaded = load_interference(root)
    fresh = InterferenceModel.fit(ds.x, ds.y, seed=3)
    assert np.array_equal(loaded.predict(ds.x), fresh.predict(ds.x))
    assert loaded.training["seed"] == 3 and loaded.training["rows"] == len(ds)
    assert set(loaded.metrics["models"]) == {"forest", "linear", "mlp", "stale"}
    held = loaded.metrics["measured_held_out"]
    assert held["rows"] == len(csv_rows(MEASURED[0])) and set(held["by_kind"]) == {"collect"}
    alone = train_interference(seed=3, out=tmp_path / "b", spec=spec, folds=2, measured=False)
    assert "measured_held_out" not in load_interference(alone).metrics


def test_a_tampered_artifact_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "a"
    from adaptipe.controllers.artifacts import save_artifact

    save_artifact(root, model="interference", format=1,
                  files={FOREST_FILE: _model().to_bytes()}, training={})  # fmt: skip
    blob = bytearray((root / FOREST_FILE).read_bytes())
    blob[len(blob) // 2] ^= 1
    (root / FOREST_FILE).write_bytes(bytes(blob))
    with pytest.raises(
        PlanError,
        match="changed after training; retrain it with `adaptipe controllers train interference`",
    ):
        load_interference(root)
    with pytest.raises(PlanError, match=r"no artifact\.json"):
        load_interference(tmp_path / "nowhere")


class _Rogue(LinearRegression):
    """A type no trusted list names: what a crafted file would ask skops to build."""


def test_an_untrusted_type_in_the_skops_file_is_refused() -> None:
    import skops.io as sio

    rogue = _Rogue().fit(_small().x, _small().y)
    with pytest.raises(PlanError, match=r"not a loadable interference forest \(Untrusted.*_Rogue"):
        InterferenceModel.from_bytes(sio.dumps(rogue))
    # a type skops trusts by default, but not a forest
    plain = LinearRegression().fit(_small().x, _small().y)
    with pytest.raises(PlanError, match="holds a LinearRegression, not a RandomForestRegressor"):
        InterferenceModel.from_bytes(sio.dumps(plain))
    # and the shipped file holds no type outside the trusted list
    data = (shipped("interference") / FOREST_FILE).read_bytes()
    from adaptipe.controllers.interference import TRUSTED_TYPES

    assert set(sio.get_untrusted_types(data=data)) <= set(TRUSTED_TYPES)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert "schema.json" in z.namelist()


def test_seeded_training_reproduces_the_shipped_artifacts_metadata() -> None:
    shipped_model = load_interference()
    meta = shipped_model.training
    spec = TraceSpec(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in meta["traces"].items()}
    )
    assert spec == TraceSpec()
    assert meta["data"] == [
        f"synthetic traces {spec.to_json()}",
        *(f"collect-interference {p.name}" for p in MEASURED),
    ]
    ds = build_dataset(spec=spec, data=MEASURED)  # the whole shipped dataset: a few seconds
    assert (meta["rows"], meta["groups"], meta["dataset_sha256"]) == (
        len(ds),
        ds.num_groups,
        ds.digest(),
    )
    assert meta["seed"] == 0 and meta["inputs"] == list(INPUTS)
    assert meta["params"] == dict(FOREST_PARAMS, n_jobs=1, random_state=0)
    assert shipped_model.forest.get_params()["random_state"] == 0
    assert shipped_model.forest.n_estimators == 128


def test_the_forest_beats_linear_on_a_small_grouped_cv() -> None:
    result = grouped_cv(_small(), seed=0, folds=3, models=("forest", "linear"))
    scores = result["models"]
    assert result["groups"] == 6 and result["rows"] == len(_small())
    assert scores["forest"]["mae"] < scores["linear"]["mae"]


def test_the_measured_rows_are_shipped_small_and_described() -> None:
    for path in MEASURED:
        assert path.stat().st_size < 500_000
        ds = csv_rows(path)
        assert len(ds) >= 100 and ds.num_groups >= 10 and np.all(ds.y > 0)
        meta = json.loads(path.with_suffix(".json").read_text())
        assert meta["kind"] == "adaptipe-interference-dataset" and meta["data"] == path.name
        assert meta["run"]["status"] == "complete" and meta["run"]["rows"] == len(ds)


def test_held_out_cv_scores_only_that_kind_and_trains_on_the_rest_always() -> None:
    measured = csv_rows(MEASURED[0])
    ds = Dataset.join([_small(), measured])
    got = grouped_cv(ds, seed=0, folds=3, models=("linear", "stale"), held_out="collect")
    assert got["rows"] == len(measured) and got["groups"] == measured.num_groups
    assert got["trained_always"] == len(_small()) and set(got["by_kind"]) == {"collect"}
    whole = grouped_cv(ds, seed=0, folds=3, models=("stale",))
    assert whole["models"]["stale"]["mae"] != got["models"]["stale"]["mae"]
    assert whole["rows"] == len(ds) and whole["trained_always"] == 0
    with pytest.raises(PlanError, match=r"folds must be in 2\.\.3, the scenarios of kind"):
        grouped_cv(ds, folds=7, models=("stale",), held_out="trace:mixture")


def test_collect_csv_rows_are_grouped_by_stage_and_stale_by_level(tmp_path: Path) -> None:
    path = tmp_path / "interference.csv"
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        for n, (stage, level, slow) in enumerate(
            [(0, "none", 1.0), (0, "cpu-a", 2.0), (1, "cpu-a", 1.5), (1, "none", 1.1)]
        ):
            row = dict.fromkeys(COLUMNS, 0.0) | {"level": level, "slowdown": slow}
            row |= {"model": "mlp", "variant": "default", "layer_start": stage, "layer_stop": 3}
            row |= {"baseline_step_s": 0.01, "stage_layers": 3 - stage, "row": n}
            w.writerow(row)
    ds = csv_rows(path)
    assert ds.x.shape == (4, len(INPUTS)) and list(ds.y) == [1.0, 2.0, 1.5, 1.1]
    assert list(ds.stale) == [1.0, 1.0, 2.0, 1.0]
    assert len(set(ds.groups)) == 2 and ds.groups[0].startswith("collect:interference.csv:mlp")
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(PlanError, match="not a collect-interference CSV"):
        csv_rows(tmp_path / "bad.csv")
