"""Plan versions: a new partition committed by hand while two real stage processes train
is adopted by both at one iteration boundary, recorded, replayed on resume, and the run
ends bitwise equal to one that never switched."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError
from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import StageFailed, prepare, train
from adaptipe.runtime.planversion import (
    PlanVersion,
    adoptions,
    commit_plan,
    current_version,
    plan_history,
    read_active,
    record_adoption,
    restore_history,
)
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.worker import FAULT_ENV
from adaptipe.schedule.build import build_schedule

ITERATIONS = 200  # long enough that the manager's commit (at 5) lands mid-run
NEW_BOUNDS = (0, 2, 6)  # layer 2 moves from stage 0 to stage 1 (the even split is 0, 3, 6)


def _config(make_config: Callable[..., RunConfig], run_dir: Path) -> RunConfig:
    return make_config(
        optimizer={"name": "adam", "lr": 0.01, "momentum": 0.0},
        train={"iterations": ITERATIONS, "checkpoint_every": 50, "run_dir": str(run_dir)},
    )


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    found = ckpt.latest(run_dir / "checkpoints")
    assert found is not None
    tensors, meta = ckpt.load(found)
    assert meta["iteration"] == ITERATIONS
    return tensors


def _commit_at(run_dir: Path, iteration: int) -> Callable[[dict[str, Any], int], None]:
    """An ``on_iteration`` callback that commits the new partition once the manager has
    seen ``iteration`` (the workers may be ahead by then: they adopt at their next
    boundary)."""
    committed: list[PlanVersion] = []

    def on_iteration(record: dict[str, Any], total: int) -> None:
        if committed or record["iteration"] < iteration:
            return
        run = RunDir(run_dir)
        current = read_active(run, 0)
        partition = Partition(model="mlp", num_layers=6, bounds=NEW_BOUNDS)
        committed.append(
            commit_plan(
                run,
                PlanVersion(
                    version=0, jobs=current.jobs, schedule=current.schedule, partition=partition
                ),
            )
        )

    return on_iteration


def _plan_events(run_dir: Path) -> list[list[dict[str, Any]]]:
    run = RunDir(run_dir)
    out = []
    for stage in range(2):
        lines = run.stage_metrics(stage).read_text().splitlines()
        out.append([r for r in map(json.loads, lines) if r.get("event") == "plan"])
    return out


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert any(k.startswith("optim.") and k.endswith(".exp_avg_sq") for k in want)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the unswitched run"


@pytest.fixture
def unswitched(make_config: Callable[..., RunConfig], tmp_path: Path) -> dict[str, torch.Tensor]:
    train(_config(make_config, tmp_path / "straight"))
    return _final_state(tmp_path / "straight")


def test_a_partition_committed_mid_run_is_adopted_at_one_boundary_bitwise(
    make_config: Callable[..., RunConfig],
    tmp_path: Path,
    unswitched: dict[str, torch.Tensor],
) -> None:
    run_dir = tmp_path / "switched"
    train(_config(make_config, run_dir), on_iteration=_commit_at(run_dir, 5))
    adopted = adoptions(RunDir(run_dir))
    assert list(adopted) == [1]
    at = adopted[1]
    assert 5 < at < ITERATIONS
    events = _plan_events(run_dir)
    assert [[e["iteration"] for e in stage] for stage in events] == [[at], [at]]
    assert [stage[0]["layers"] for stage in events] == [[0, 1], [2, 3, 4, 5]]
    assert all(stage[0]["bounds"] == list(NEW_BOUNDS) for stage in events)
    final = ckpt.latest(run_dir / "checkpoints")
    assert final is not None
    stage_meta = json.loads((final / "stage-1.json").read_text())
    assert stage_meta["layers"] == [2, 3, 4, 5]
    _assert_bitwise(_final_state(run_dir), unswitched)


def test_a_resumed_run_replays_the_switch_bitwise(
    make_config: Callable[..., RunConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    unswitched: dict[str, torch.Tensor],
) -> None:
    run_dir = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, "1:150")
    with pytest.raises(StageFailed, match="InjectedFault"):
        train(_config(make_config, run_dir), on_iteration=_commit_at(run_dir, 5))
    monkeypatch.delenv(FAULT_ENV)
    at = adoptions(RunDir(run_dir))[1]
    assert at <= 150  # the switch happened before the fault (the manager saw iteration 5)
    assert [[e["iteration"] for e in stage] for stage in _plan_events(run_dir)] == [[at], [at]]
    train(_config(make_config, run_dir), run_dir=run_dir, resume=True)
    # the resumed workers start on the run's partition and take the recorded one at once
    resumed = [[e["iteration"] for e in stage] for stage in _plan_events(run_dir)]
    assert resumed == [[150], [150]]
    assert adoptions(RunDir(run_dir)) == {1: at}  # replayed, not adopted anew
    _assert_bitwise(_final_state(run_dir), unswitched)


def test_commit_plan_refuses_partitions_that_cannot_run(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    run, _ = prepare(_config(make_config, tmp_path / "run"))
    current = read_active(run, 0)
    wrong_layers = Partition(model="mlp", num_layers=7, bounds=(0, 3, 7))
    with pytest.raises(PlanError, match="covers 7 layers, the model has 6"):
        commit_plan(
            run,
            PlanVersion(version=0, jobs=(0,), schedule=current.schedule, partition=wrong_layers),
        )
    three = Partition(model="mlp", num_layers=6, bounds=(0, 2, 4, 6))
    with pytest.raises(PlanError, match="3 stages, the schedule 2"):
        commit_plan(
            run, PlanVersion(version=0, jobs=(0,), schedule=current.schedule, partition=three)
        )
    async_schedule = build_schedule("pipedream", stages=2, microbatches=4)
    with pytest.raises(PlanError, match="asynchronous schedule"):
        commit_plan(
            run,
            PlanVersion(
                version=0,
                jobs=(0,),
                schedule=async_schedule,
                partition=Partition(model="mlp", num_layers=6, bounds=NEW_BOUNDS),
            ),
        )
    assert adoptions(run) == {} and not (run.root / "control" / "active.json").exists()


def test_a_checkpoints_plan_history_restores_what_the_run_lost(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    run, _ = prepare(_config(make_config, tmp_path / "run"))
    moved = Partition(model="mlp", num_layers=6, bounds=NEW_BOUNDS)
    first = commit_plan(run, lambda newest: replace(newest, partition=moved))
    record_adoption(run, first.version, 3)
    later = commit_plan(run, lambda newest: replace(newest, partition=None))
    record_adoption(run, later.version, 12)
    history = plan_history(run, 10)  # what a checkpoint of iteration 10 records
    assert [(h["version"], h["iteration"]) for h in history] == [(1, 3)]
    assert restore_history(run, history, source="ckpt") == []  # nothing was lost
    for path in (run.root / "control").glob("*.json"):
        path.unlink()
    assert restore_history(run, history, source="ckpt") == [1]
    assert adoptions(run) == {1: 3} and read_active(run, 1).partition == moved
    assert current_version(run) == 1
    record_adoption(run, 1, 4)  # another run's record
    with pytest.raises(PlanError, match=r"came into force at iteration 3, but .* says 4"):
        restore_history(run, history, source="ckpt")
    other = [{**history[0], "plan": {**history[0]["plan"], "partition": None}}]
    with pytest.raises(PlanError, match="plan version 1 differs from"):
        restore_history(run, other, source="ckpt")
