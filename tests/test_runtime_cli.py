"""`adaptipe train` and `adaptipe prepare` end to end, and the worker under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import adaptipe
import adaptipe.runtime.checkpoint as ckpt
from adaptipe.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = """
[model]
name = "mlp"
[model.config]
in_features = 8
hidden = 16
depth = 4
out_features = 4
num_samples = 128
[data]
batch_size = 16
microbatches = 4
[optimizer]
name = "sgd"
lr = 0.05
[pipeline]
stages = 2
schedule = "gpipe"
recompute = true
[train]
iterations = 4
checkpoint_every = 2
threads_per_stage = 1
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(adaptipe.__file__).parent.parent)
    return env


def test_train_command_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    code = main(["train", str(config), "--run-dir", str(tmp_path / "run"), "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["iterations"] == 4 and summary["final_loss"] > 0
    assert (tmp_path / "run" / "config.toml").read_text() == TINY
    metrics = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["iteration"] for m in metrics] == [0, 1, 2, 3]
    assert all(len(m["stages"]) == 2 and m["stages"][0]["compute_s"] > 0 for m in metrics)


def test_train_needs_a_config_or_a_run_to_resume(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train"]) == 2
    assert "CONFIG.toml" in capsys.readouterr().err


def test_bad_config_is_refused_with_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(TINY.replace("lr = 0.05", "lr = -0.1"))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}: [optimizer].lr must be > 0 (got -0.1)" in err


def test_worker_runs_under_torchrun_after_prepare(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    run_dir = tmp_path / "run"
    assert main(["prepare", str(config), "--run-dir", str(run_dir)]) == 0
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "adaptipe.runtime.worker",
            "--run-dir",
            str(run_dir),
        ],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = ckpt.latest(run_dir / "checkpoints")
    assert found is not None and found.name == "iter-000004"


def test_a_diverged_loss_is_null_in_the_summary_json() -> None:
    import json as _json
    import math as _math

    from adaptipe.runtime.launch import TrainSummary

    summary = TrainSummary(
        run_dir="r",
        iterations=3,
        start_iteration=0,
        final_loss=_math.nan,
        samples_per_s=1.0,
        wall_s=1.0,
        jobs=[{"job": 1, "val_loss": _math.inf, "train_loss": 0.5}],
    )
    text = _json.dumps(summary.to_json(), allow_nan=False)  # strict JSON: no NaN, Infinity
    back = _json.loads(text)
    assert back["final_loss"] is None and back["jobs"][0]["val_loss"] is None
    assert back["jobs"][0]["train_loss"] == 0.5


def test_a_batch_bigger_than_the_dataset_is_a_config_error(make_config: Any) -> None:
    # Said before profiling (which would draw it) and before any worker starts.
    from adaptipe.errors import PlanError
    from adaptipe.runtime.config import RunConfig
    from adaptipe.runtime.launch import resolve_plans

    with pytest.raises(PlanError, match=r"\[data\] batch_size = 512 is more than the 256 samples"):
        resolve_plans(make_config(data={"batch_size": 512, "microbatches": 1}))
    data = make_config(data={"microbatches": 1}).to_dict()
    data["sweep"] = {"grid": {"batch_size": [16, 1024]}, "solver": "1f1b"}
    swept = RunConfig.from_dict(data, source="grid.toml")
    with pytest.raises(
        PlanError, match=r"grid.toml: \[sweep\] job 'batch_size=1024' batch_size = 1024 .*1\.\.256"
    ):
        resolve_plans(swept)


def test_prepare_names_the_japsp_order_of_a_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sweep.toml"
    config.write_text(
        TINY.replace("microbatches = 4", "microbatches = 1")
        + '\n[sweep]\nsolver = "1f1b"\nwindow = 2\n[sweep.grid]\nlr = [0.05, 0.1]\n'
    )
    assert main(["prepare", str(config), "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "2 jobs in JAPSP windows of 2 iteration(s) ([sweep].solver 1f1b) over 2 stage(s)" in out
    config.write_text(config.read_text().replace("window = 2\n", ""))
    assert main(["prepare", str(config), "--run-dir", str(tmp_path / "auto")]) == 0
    assert "windows of 25 iteration(s) (auto) ([sweep].solver 1f1b)" in capsys.readouterr().out


def test_the_summary_tables_show_whole_names_and_how_each_job_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from adaptipe.runtime.launch import TrainSummary

    long = "lr=0.001,batch_size=32,weight_decay=0.0001,momentum=0.9,seed=3,data_seed=7"
    halved = {"reason": "successive halving at iteration 40", "decided_at": 40, "iteration": 40}
    jobs = [
        {"rank": 1, "job": 0, "name": long, "val_loss": 0.5, "train_loss": 0.4},
        {"rank": 2, "job": 1, "name": "b", "val_loss": 0.6, "train_loss": 0.5, "stopped": halved},
        {
            "rank": 3,
            "job": 2,
            "name": "c",
            "val_loss": 0.7,
            "train_loss": 0.6,
            "stopped": {"reason": "user", "decided_at": None, "iteration": 12},
        },
        {
            "rank": 4,
            "job": 3,
            "name": "d",
            "val_loss": 0.8,
            "train_loss": None,
            "stopped": {"reason": "looks bad", "decided_at": None, "iteration": 7},
        },
    ]
    window = {"rounds": 13, "round_order": "1f1b-ahead"}
    solution = {"solver": "ga", "optimal": False, "gap": 0.012, "window": window}
    (tmp_path / "japsp-solution.json").write_text(json.dumps(solution))
    control = tmp_path / "control"  # two switches after stops, as the workers record them
    control.mkdir()
    for version, iteration, active, meta in (
        (2, 52, [0], {}),  # an older run's meta: windows of 1, the solver's order
        (1, 40, [0, 1], {"window": 25, "round_order": "1f1b-ahead"}),
    ):
        (control / f"adopted-{version:04d}.json").write_text(
            json.dumps({"version": version, "iteration": iteration})
        )
        (control / f"active-{version:04d}.json").write_text(
            json.dumps({"jobs": active, "schedule": {"meta": meta}})
        )
    summary = TrainSummary(
        run_dir=str(tmp_path),
        iterations=80,
        start_iteration=0,
        final_loss=0.4,
        samples_per_s=1.0,
        wall_s=1.0,
        jobs=jobs,
        stages=[
            {"compute_s": 0.1, "wait_s": 0.0, "comm_s": 0.0, "resident_jobs": 4, "state_wait_s": 0}
        ],
    )
    monkeypatch.setattr("adaptipe.runtime.train", lambda *a, **kw: summary)
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "80")  # a log file: rich would cut names at 80 columns
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    assert main(["train", str(config), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "communication ms" in out and "state wait ms (host)" in out  # headers whole
    assert "each job's below), 1 samples/s (steady state)" in out  # the sentence unbroken
    assert (
        "job-array: 4 jobs, block order by the ga solver (within 1.2% of its lower bound), "
        "windows of 13 iteration(s) with all jobs, in the 1F1B-one-step-ahead round order "
        "(see japsp-solution.json)" in out
    )
    assert (
        "after stops: from iteration 40, windows of 25 with 2 jobs (1F1B-one-step-ahead round "
        "order); from iteration 52, windows of 1 with 1 job (the solver's own round order)"
    ) in out
    rows = {line.split()[1]: line for line in out.splitlines() if "│" in line}
    assert long in rows["1"]  # on one line, in full
    assert "│ -" in rows["1"]  # trained to the end
    assert "halving @ 40 " in rows["2"] and "successive halving" not in rows["2"]
    assert "by hand @ 12 " in rows["3"]
    assert "by hand @ 7: looks bad" in rows["4"]
