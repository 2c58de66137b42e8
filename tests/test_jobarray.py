"""Job-arrays: sibling jobs trained concurrently through one pipeline each end with the
parameters they would have trained alone (same seed, data order and hyper-parameters)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptipe.monitor.runlog import load_run
from adaptipe.monitor.schema import StageStats
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import StageFailed
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.sweep import JobSpec
from adaptipe.runtime.worker import FAULT_ENV
from adaptipe.schedule.types import Recompute
from tests._solo import alone_params
from tests.conftest import final_state

SWEEP: dict[str, Any] = {"grid": {"lr": [0.05, 0.2], "batch_size": [8, 16]}, "solver": "1f1b"}


def _alone(cfg: RunConfig, job: JobSpec) -> dict[str, torch.Tensor]:
    """What the job trains alone: one process, its whole mini-batch at once (`cfg` was
    read from a resolved dict, so its ``[data].seed`` is set)."""
    return alone_params(cfg.to_dict(), job)


def _job_params(run_dir: str, job: int) -> dict[str, torch.Tensor]:
    return final_state(run_dir, job, layers=True)


@pytest.mark.parametrize(
    ("solver", "budget", "window"),
    [
        pytest.param("1f1b", 0, 4, id="1f1b-all-resident"),
        pytest.param("auto", 0, 4, id="auto-all-resident"),
        pytest.param("auto", 0, 1, id="auto-no-window"),
        pytest.param("1f1b", 2, 4, id="1f1b-budget-2-of-4"),
        pytest.param("auto", 2, 4, id="auto-recompute-budget-2-of-4"),
    ],
)
def test_every_job_of_the_array_ends_as_if_trained_alone(
    make_config: Callable[..., RunConfig], solver: str, budget: int, window: int, request: Any
) -> None:
    recompute = "recompute" in request.node.callspec.id
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        pipeline={"recompute": recompute},
        train={"iterations": 4},
    )
    data = cfg.to_dict()
    data["sweep"] = dict(SWEEP, solver=solver, memory_budget=budget, window=window)
    cfg = RunConfig.from_dict(data, source="test.toml")
    assert len(cfg.jobs) == 4
    summary = train(cfg)
    for job in cfg.jobs:
        got, want = _job_params(summary.run_dir, job.index), _alone(cfg, job)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{job.name} {name}"
            )
    run = Path(summary.run_dir)
    assert (run / "japsp-instance.json").exists() and (run / "japsp-solution.json").exists()
    instance = json.loads((run / "japsp-instance.json").read_text())
    for job in instance["jobs"]:  # recomputation re-runs the forward: it costs as much
        assert job.get("recompute", [0.0] * 2) == (job["forward"] if recompute else [0.0] * 2)
    # The summary shows each stage's job states on the device at most and its waits.
    for stage in summary.stages:
        assert stage["resident_jobs"] == (budget or 4) and stage["state_wait_s"] >= 0
    if budget:
        done = [json.loads(line) for line in RunDir(run).stage_metrics(0).read_text().splitlines()]
        memory = next(r["memory"] for r in done if r.get("event") == "done")
        assert memory["budget"] == budget and memory["peak_resident"] <= budget
        # 4 jobs through 2 places: states did leave and come back
        assert memory["evictions"] > 0 and memory["prefetches"] + memory["misses"] > 0
    schedule = RunDir(run).read_schedule()
    assert schedule.recompute == recompute
    assert any(isinstance(ins, Recompute) for ins in schedule.stages[0]) == recompute


@pytest.mark.parametrize("data_seed", [None, 3], ids=["data-order-per-job", "data-seed-3"])
def test_jobs_with_own_seeds_and_optimizers_end_as_if_trained_alone(
    make_config: Callable[..., RunConfig], data_seed: int | None
) -> None:
    # Seeds and optimizers differ between jobs; the reference is each job's own config
    # run alone, whose data order follows [data].seed when set and its seed otherwise.
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"iterations": 3},
    )
    raw = cfg.to_dict()
    if data_seed is None:
        del raw["data"]["seed"]
    else:
        raw["data"]["seed"] = data_seed
    raw["sweep"] = {
        "jobs": [
            {"name": "sgd-7", "seed": 7},
            {"name": "sgd-11", "seed": 11},
            {"name": "adam-5", "seed": 5, "optimizer": "adam", "lr": 0.01},
        ],
        "memory_budget": 2,
    }
    cfg = RunConfig.from_dict(raw, source="test.toml")
    assert [j.data_seed for j in cfg.jobs] == ([7, 11, 5] if data_seed is None else [3, 3, 3])
    summary = train(cfg)
    params = [_job_params(summary.run_dir, job.index) for job in cfg.jobs]
    for job, got in zip(cfg.jobs, params, strict=True):
        want = alone_params(raw, job)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{job.name} {name}"
            )
    # The seeds matter: the two SGD jobs differ only in their seeds and end apart.
    assert any(not torch.allclose(params[0][k], params[1][k]) for k in params[0])


def test_windows_end_at_checkpoints_and_keep_every_job_exact(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"iterations": 7, "checkpoint_every": 3, "keep_checkpoints": 0},
    )
    data = cfg.to_dict()
    data["sweep"] = dict(SWEEP, solver="auto", window=4, memory_budget=3)
    cfg = RunConfig.from_dict(data, source="test.toml")
    summary = train(cfg)
    run = Path(summary.run_dir)
    # Windows of 4 cut at the checkpoints after iterations 3 and 6: [0,3) [3,6) [6,7).
    for stage in range(2):
        lines = RunDir(run).stage_metrics(stage).read_text().splitlines()
        records = [r for r in map(json.loads, lines) if "iteration" in r and "event" not in r]
        assert [r["iteration"] for r in records] == list(range(7))
        assert [r.get("window", 1) for r in records] == [3, 3, 3, 3, 3, 3, 1]
        if stage == 1:  # the last stage logs each job's loss for every iteration
            assert all(sorted(r["losses"]) == ["0", "1", "2", "3"] for r in records)
    assert sorted(p.name for p in (run / "checkpoints").glob("iter-*")) == [
        "iter-000003",
        "iter-000006",
        "iter-000007",
    ]
    solution = json.loads((run / "japsp-solution.json").read_text())
    assert solution["window"]["rounds"] == 4
    assert solution["window"]["per_iteration"] <= solution["makespan"] + 1e-12
    # Telemetry has one record per iteration with its window's means: the loss is the
    # mean over jobs and the window's rounds of what the metrics log per iteration.
    metrics = {m["iteration"]: m["loss"] for m in RunDir(run).read_metrics()}
    telemetry = [r for r in load_run(run).records if isinstance(r, StageStats) and r.stage == 1]
    assert telemetry
    for r in telemetry:
        lo, hi = next((a, b) for a, b in ((0, 3), (3, 6), (6, 7)) if a <= r.iteration < b)
        want = sum(metrics[i] for i in range(lo, hi)) / (hi - lo)
        assert r.loss == pytest.approx(want), r.iteration
    for job in cfg.jobs:
        got, want = _job_params(summary.run_dir, job.index), _alone(cfg, job)
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{job.name} {name}"
            )


def test_a_failed_array_resumes_from_its_checkpoint_and_ends_as_if_alone(
    make_config: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stage 1 fails at iteration 5, inside the window [4, 7); the last checkpoint is
    # after iteration 4. The resumed run cuts its windows the same way on both stages.
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"iterations": 7, "checkpoint_every": 4},
    )
    data = cfg.to_dict()
    data["sweep"] = dict(SWEEP, solver="auto", window=3)
    cfg = RunConfig.from_dict(data, source="test.toml")
    monkeypatch.setenv(FAULT_ENV, "1:5")
    with pytest.raises(StageFailed, match="InjectedFault"):
        train(cfg)
    monkeypatch.delenv(FAULT_ENV)
    run_dir = cfg.train.run_dir
    with RunDir(run_dir).metrics.open("a") as fh:  # as if the manager died mid-write
        fh.write('{"iteration": 5, "loss": 0.')
    resumed = train(cfg, run_dir=run_dir, resume=True)
    assert resumed.start_iteration == 4 and resumed.iterations == 3
    metrics = RunDir(run_dir).read_metrics()  # every line whole again
    assert [r["iteration"] for r in metrics][-3:] == [4, 5, 6]
    assert all(row["train_loss"] is not None for row in resumed.jobs)
    for job in cfg.jobs:
        got, want = _job_params(resumed.run_dir, job.index), _alone(cfg, job)
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{job.name} {name}"
            )


def test_a_diverging_job_does_not_stop_its_siblings(make_config: Callable[..., RunConfig]) -> None:
    # lr=1e4 drives one job to NaN within a few iterations; the run (telemetry on) goes
    # on, its sibling ends as if alone, and the summary ranks the diverged job last.
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"iterations": 6, "telemetry": True},
    )
    data = cfg.to_dict()
    data["sweep"] = {"grid": {"lr": [1e4, 0.05]}, "solver": "1f1b"}
    cfg = RunConfig.from_dict(data, source="test.toml")
    summary = train(cfg)
    run = RunDir(summary.run_dir)
    losses = [r["losses"]["0"] for r in run.read_metrics()]
    assert losses[-1] is None, losses  # diverged: strict JSON has no NaN, so null
    logs = [run.metrics, run.telemetry, run.stage_metrics(0), run.stage_metrics(1)]
    bad = [  # every JSON-lines log parses as strict JSON (no NaN or Infinity)
        (path.name, line)
        for path in logs
        for line in path.read_text().splitlines()
        if any(word in line for word in ("NaN", "Infinity"))
    ]
    assert not bad, bad[:3]
    assert all(json.loads(line) for path in logs for line in path.read_text().splitlines())
    got, want = _job_params(summary.run_dir, 1), _alone(cfg, cfg.jobs[1])
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert [row["job"] for row in summary.jobs] == [1, 0]
