"""TensorBoard files: one run per job with its loss, lr and samples/s, validation losses
from halving rungs, and the pipeline's per-stage times; read back with TensorBoard's
own reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from adaptipe.monitor.tensorboard import TensorBoardSink, export, job_dir_name


def _scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _row(it: int) -> dict[str, object]:
    return {
        "iteration": it,
        "losses": {"0": 1.0 / (it + 1), "1": float("nan")},
        "iteration_s": 0.5,
        "samples_per_s": 96.0,
        "stages": [{"compute_s": 0.1 * it, "wait_s": 0.2, "comm_s": 0.01}, {"compute_s": 0.3}],
    }


def test_a_finished_run_is_written_per_job_and_per_stage(tmp_path: Path) -> None:
    metrics, control = tmp_path / "metrics.jsonl", tmp_path / "control.jsonl"
    metrics.write_text("".join(json.dumps(_row(i)) + "\n" for i in range(3)) + '{"torn')
    halving = {"event": "halving", "iteration": 2, "val_loss": {"0": 0.25, "1": None}}
    control.write_text(json.dumps(halving) + "\n")
    jobs = {"0": "lr=0.01,batch_size=16", "1": "lr=1/2"}
    count = export(
        metrics, control, tmp_path / "tb", jobs,
        batch_sizes={"0": 16, "1": 32}, lr_of=lambda job, it: 0.01 * (it + 1),
    )  # fmt: skip
    assert count == 3
    job0 = tmp_path / "tb" / "lr=0.01,batch_size=16"
    assert _scalars(job0, "loss") == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert [v for _, v in _scalars(job0, "lr")] == pytest.approx([0.01, 0.02, 0.03])
    assert _scalars(job0, "samples_per_s") == [(i, 32.0) for i in range(3)]
    assert _scalars(job0, "val_loss") == [(2, 0.25)]
    job1 = tmp_path / "tb" / job_dir_name("lr=1/2")
    assert job1.name == "lr=1_2"
    acc = EventAccumulator(str(job1))
    acc.Reload()
    assert "loss" not in acc.Tags()["scalars"]  # a diverged job's nan is left out
    pipeline = tmp_path / "tb" / "pipeline"
    assert [v for _, v in _scalars(pipeline, "stage0/compute_s")] == pytest.approx([0, 0.1, 0.2])
    assert _scalars(pipeline, "stage1/compute_s")[0] == (0, pytest.approx(0.3))


def test_a_missing_tensorboard_package_warns_and_gives_no_sink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.warns(UserWarning, match="tensorboard = false"):
        assert TensorBoardSink.open(tmp_path, {"0": "a"}) is None


def test_a_sweep_writes_one_run_per_job_with_its_schedule_and_validation(
    make_config: Any,
) -> None:
    """A real 2-job sweep: each job's loss every iteration, its scheduled learning rate,
    the validation loss at the halving rung and at the end; none with tensorboard off."""
    from adaptipe.runtime import train
    from adaptipe.runtime.config import RunConfig

    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9, "warmup": 4},
        train={"iterations": 6},
    )
    data = cfg.to_dict()
    data["sweep"] = {"grid": {"lr": [0.05, 0.1]}, "solver": "1f1b", "halving_every": 3}
    summary = train(RunConfig.from_dict(data, source="tb.toml"))
    root = Path(summary.run_dir) / "tensorboard"
    assert sorted(p.name for p in root.iterdir()) == ["lr=0.05", "lr=0.1", "pipeline"]
    for lr in (0.05, 0.1):  # the warm-up over 4 steps; one job stops at the rung
        job = root / f"lr={lr}"
        assert [step for step, _ in _scalars(job, "loss")][:3] == [0, 1, 2]
        got = [v for _, v in _scalars(job, "lr")][:3]
        assert got == pytest.approx([lr / 4, lr / 2, 3 * lr / 4], rel=1e-6)
        assert next(step for step, _ in _scalars(job, "val_loss")) == 3  # the halving rung
    ends = {step for lr in (0.05, 0.1) for step, _ in _scalars(root / f"lr={lr}", "val_loss")}
    assert 6 in ends  # the final ranking's validation, for the job that trained on
    assert _scalars(root / "pipeline", "samples_per_s")
    data["train"].update(tensorboard=False, run_dir=data["train"]["run_dir"] + "-off")
    off = train(RunConfig.from_dict(data, source="tb.toml"))
    assert not (Path(off.run_dir) / "tensorboard").exists()
