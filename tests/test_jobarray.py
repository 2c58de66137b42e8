"""Job-arrays: sibling jobs trained concurrently through one pipeline each end with the
parameters they would have trained alone (same seed, data order and hyper-parameters)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.models import get_model
from adaptipe.plan.partition import Partition
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.reference import train_reference
from adaptipe.runtime.sweep import JobSpec
from adaptipe.schedule.build import build_schedule

SWEEP: dict[str, Any] = {"grid": {"lr": [0.05, 0.2], "batch_size": [8, 16]}, "solver": "1f1b"}


def _alone(cfg: RunConfig, job: JobSpec) -> dict[str, torch.Tensor]:
    """What the job trains alone: one process, its whole mini-batch at once."""
    spec = get_model(cfg.model.name, **cfg.model.config)
    result = train_reference(
        spec=spec,
        schedule=build_schedule("gpipe", stages=1, microbatches=1),
        partition=Partition.even(model=spec.name, num_layers=spec.num_layers, num_stages=1),
        make_optimizer=job.optimizer.build,
        batch_size=job.batch_size,
        iterations=cfg.train.iterations or 0,
        seed=job.seed,
        data_seed=job.seed,
    )
    return result.params


def _job_params(run_dir: str, job: int) -> dict[str, torch.Tensor]:
    found = ckpt.latest(Path(run_dir) / "checkpoints")
    assert found is not None
    tensors, _ = ckpt.load(found)
    prefix = f"jobs.{job}."
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix + "layers.")}


@pytest.mark.parametrize(
    ("solver", "budget"),
    [
        pytest.param("1f1b", 0, id="1f1b-all-resident"),
        pytest.param("auto", 0, id="auto-all-resident"),
        pytest.param("1f1b", 2, id="1f1b-budget-2-of-4"),
    ],
)
def test_every_job_of_the_array_ends_as_if_trained_alone(
    make_config: Callable[..., RunConfig], solver: str, budget: int
) -> None:
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"iterations": 4},
    )
    data = cfg.to_dict()
    data["sweep"] = dict(SWEEP, solver=solver, memory_budget=budget)
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
