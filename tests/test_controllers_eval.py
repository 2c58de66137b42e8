"""``adaptipe controllers eval`` and the baselines' tuning: the tuned settings come from
the training traces alone, and the evaluation writes its table, JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptipe.cli import main
from adaptipe.envs.episode import EpisodeSettings
from adaptipe.envs.generators import generate
from adaptipe.envs.heldout import HELD_OUT_SEED
from adaptipe.envs.tuning import GRIDS, training_traces, tune_baselines


def test_tuning_uses_training_traces_and_picks_a_grid_point() -> None:
    traces = training_traces(stages=2, iterations=60, seeds=1, families=("poisson-heavy",))
    assert all((t.seed or 0) < HELD_OUT_SEED for t in traces)
    tuned = tune_baselines(traces, EpisodeSettings(model="cnn", stages=2, microbatches=4))
    assert set(tuned) == set(GRIDS)
    for name, t in tuned.items():
        assert t.params in GRIDS[name] and t.samples_per_s > 0
        assert t.factory().name == name


def test_eval_on_a_folder_of_traces_writes_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "traces"
    for seed in (1, 2):
        generate("colocated", stages=2, iterations=60, seed=seed).save(folder / f"c{seed}.jsonl")
    out = tmp_path / "eval"
    args = ["controllers", "eval", "--traces", str(folder), "--model", "cnn", "--no-tune"]
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "oracle" in printed and "threshold" in printed and "colocated" in printed
    data = json.loads((out / "eval.json").read_text())
    rows = {r["controller"]: r for r in data["table"]}
    assert rows["oracle"]["mean"] == 1.0 and rows["oracle"]["traces"] == 2
    assert all(0 < r["mean"] <= 1.0 + 1e-9 for r in rows.values())
    assert (out / "eval.png").stat().st_size > 0


def test_eval_refuses_an_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["controllers", "eval", "--traces", str(tmp_path), "--no-tune"]) != 0
    assert "no *.jsonl trace files" in capsys.readouterr().err


def test_train_switch_from_the_command_line_writes_a_loadable_artifact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from adaptipe.controllers.switch_policy import load_switch

    out = tmp_path / "switch"
    assert main(["controllers", "train", "switch", "--timesteps", "256", "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    policy = load_switch(out, stages=4)
    assert policy.config.stages == 4
