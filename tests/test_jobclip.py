"""Clipping by the global norm in job-arrays (`adaptipe.runtime.jobclip`): each job of
an array ends bitwise as the same job trained alone by adaptipe with the same clip, with
windows of several rounds (steps waiting for the norms) and with offloaded job states
(steps at their place); the norm waits are walked for deadlocks before a window runs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from adaptipe.japsp import JapspInstance, solve
from adaptipe.japsp.window import best_window, window_schedule
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.jobclip import JobClip, check_waits, plan_waits
from adaptipe.schedule.types import (
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGradient,
    Schedule,
    SendActivation,
    SendGradient,
)
from tests.conftest import TINY_MLP, final_state
from tests.test_japsp_solvers import instances

CLIP = 0.05  # the tiny MLP's gradient norms are 0.1-0.3: every step clips


def _config(
    tmp_path: Path, name: str, sweep: dict[str, Any] | None = None, **over: Any
) -> RunConfig:
    data = copy.deepcopy(TINY_MLP)
    data["data"]["microbatches"] = 1  # a job-array runs each mini-batch as one block
    data["optimizer"]["clip_grad_norm"] = CLIP
    data["train"] |= {"iterations": 4, "run_dir": str(tmp_path / name)}
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value}
    if sweep is not None:
        data["sweep"] = sweep
    return RunConfig.from_dict(data, source=f"{name}.toml")


def _alone(tmp_path: Path, lr: float, clip: float) -> dict[str, Tensor]:
    cfg = _config(tmp_path, f"alone-{lr}-{clip}", optimizer={"lr": lr, "clip_grad_norm": clip})
    return final_state(train(cfg).run_dir, layers=True)


@pytest.mark.parametrize(
    "sweep",
    [
        pytest.param({"grid": {"lr": [0.05, 0.1]}, "solver": "1f1b", "window": 2}, id="deferred"),
        pytest.param(
            {"grid": {"lr": [0.05, 0.1, 0.2]}, "solver": "1f1b", "memory_budget": 2},
            id="eager-offloaded",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_each_clipped_job_of_an_array_ends_bitwise_as_alone(
    tmp_path: Path, sweep: dict[str, Any]
) -> None:
    cfg = _config(tmp_path, "array", sweep)
    summary = train(cfg)
    for job in cfg.jobs:
        want = _alone(tmp_path, job.optimizer.lr, CLIP)
        got = final_state(summary.run_dir, job.index, layers=True)
        assert want.keys() == got.keys() and want
        for name in want:
            assert torch.equal(got[name], want[name]), (job.name, name)
    free, got = (
        _alone(tmp_path, cfg.jobs[0].optimizer.lr, 0.0),
        final_state(summary.run_dir, 0, layers=True),
    )
    assert any(not torch.equal(free[name], got[name]) for name in free)  # it did clip


@pytest.mark.slow
def test_a_job_that_does_not_clip_beside_one_that_does_and_a_migration(tmp_path: Path) -> None:
    """Per-job ``clip_grad_norm`` (0: off) from [[sweep.jobs]], a layer moved mid-run."""
    sweep = {
        "jobs": [{"lr": 0.05, "clip_grad_norm": 0.0}, {"lr": 0.1, "clip_grad_norm": 0.02}],
        "solver": "1f1b",
        "window": 2,
    }
    cfg = _config(
        tmp_path, "mixed", sweep, adapt={"repartition": [{"iteration": 2, "bounds": [0, 2, 6]}]}
    )
    summary = train(cfg)
    for job, (lr, clip) in zip(cfg.jobs, [(0.05, 0.0), (0.1, 0.02)], strict=True):
        want, got = _alone(tmp_path, lr, clip), final_state(summary.run_dir, job.index, layers=True)
        for name in want:
            assert torch.equal(got[name], want[name]), (job.name, name)


def test_clip_grad_norm_is_a_grid_axis(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "grid", {"grid": {"clip_grad_norm": [0.0, 0.5]}})
    assert [j.optimizer.clip_grad_norm for j in cfg.jobs] == [0.0, 0.5]


def _two_stage(programs: list[list[Any]], jobs: int = 2) -> Schedule:
    return Schedule(name="hand", num_stages=2, num_microbatches=1, stages=programs, num_jobs=jobs)


def _job_blocks(j: int, s: int) -> list[Any]:
    if s == 0:
        return [Forward(j, 0), SendActivation(j, 0, 0, peer=1)]
    return [
        RecvActivation(j, 0, 0, peer=0),
        Forward(j, 0),
        Backward(j, 0),
        SendGradient(j, 0, 0, peer=0),
    ]


def test_norm_waits_that_would_deadlock_are_found() -> None:
    # stage 1 steps job 0 before it takes job 1's activation; stage 0 backwards job 1
    # before job 0: eager waits (at the step) deadlock, deferred ones (at the end) do not
    s0 = [*_job_blocks(0, 0), *_job_blocks(1, 0)]
    s0 += [RecvGradient(1, 0, 0, peer=1), Backward(1, 0), OptimizerStep(1)]
    s0 += [RecvGradient(0, 0, 0, peer=1), Backward(0, 0), OptimizerStep(0)]
    s1 = [*_job_blocks(0, 1), OptimizerStep(0), *_job_blocks(1, 1), OptimizerStep(1)]
    schedule = _two_stage([s0, s1])
    assert check_waits(schedule, {0, 1}, at_step=False) is None
    why = check_waits(schedule, {0, 1}, at_step=True)
    assert why is not None and "stage 1" in why
    assert check_waits(schedule, {1}, at_step=True) is None  # job 0 does not clip


def test_a_wait_that_would_deadlock_at_its_step_is_deferred_alone() -> None:
    s0 = [*_job_blocks(0, 0), *_job_blocks(1, 0)]
    s0 += [RecvGradient(1, 0, 0, peer=1), Backward(1, 0), OptimizerStep(1)]
    s0 += [RecvGradient(0, 0, 0, peer=1), Backward(0, 0), OptimizerStep(0)]
    s1 = [*_job_blocks(0, 1), OptimizerStep(0), *_job_blocks(1, 1), OptimizerStep(1)]
    here = plan_waits(_two_stage([s0, s1]), {0, 1}, at_step=True)
    assert here == [{(0, 0), (1, 0)}, {(1, 0)}]  # only stage 1's step of job 0 waits later
    assert plan_waits(_two_stage([s0, s1]), {0, 1}, at_step=False) == [set(), set()]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    inst=instances(max_jobs=4, max_stages=4),
    rounds=st.integers(1, 3),
    solver=st.sampled_from(["rr", "1f1b", "gpipe"]),
    budget=st.integers(0, 3),
)
def test_deferred_waits_never_deadlock_on_solver_windows(
    inst: JapspInstance, rounds: int, solver: str, budget: int
) -> None:
    orders = solve(inst, solver=solver).orders
    schedule = window_schedule(inst, best_window(inst, orders, rounds, budget=budget)[1])
    clipped = set(range(inst.num_jobs))
    assert check_waits(schedule, clipped, at_step=False) is None
    plan_waits(schedule, clipped, at_step=True)  # finds a placement


class _Loopback:
    """A two-stage exchange in one process: the other stage's vectors are given."""

    rank = 0

    def __init__(self, others: dict[tuple[int, int], Tensor]) -> None:
        self.others = others
        self.sent: list[tuple[int, int, int, Tensor]] = []

    def send(self, epoch: int, job: int, k: int, vector: Tensor) -> None:
        self.sent.append((epoch, job, k, vector.clone()))

    def gather(self, epoch: int, job: int, k: int, size: int) -> list[Tensor]:
        return [self.others[(job, k)]]

    def flush(self) -> None:
        pass


def test_a_deferred_step_is_applied_with_the_whole_model_norm_when_its_job_comes_back() -> None:
    layer = nn.Linear(2, 2)
    for p in layer.parameters():
        p.grad = torch.full_like(p, 1.0)  # squared norm 6
    other = torch.tensor([0.0, 10.0], dtype=torch.float64)  # layer 1 lives elsewhere
    exchange = _Loopback({(0, 0): other})
    clip = JobClip([1.0], 2, exchange)  # type: ignore[arg-type]
    applied: list[float | None] = []
    released: list[int] = []
    clip.step(0, [(0, list(layer.parameters()))], applied.append, lambda: released.append(0))
    assert applied == [] and released == [0]  # deferred: the state may go meanwhile
    assert exchange.sent[0][3].tolist() == [6.0, 0.0]
    clip.complete(0)
    assert clip.last_norm[0] == 4.0 and applied == [pytest.approx(1.0 / (4.0 + 1e-6))]
    clip.end_window()
    assert clip.epoch == 1
    clip.plan(_two_stage([[OptimizerStep(0)], [OptimizerStep(0)]], jobs=1), at_step=True)
    clip.step(0, [(0, list(layer.parameters()))], applied.append, lambda: released.append(1))
    assert len(applied) == 2 and released == [0]  # at its step: applied at once
