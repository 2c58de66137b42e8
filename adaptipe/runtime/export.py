"""Load what a run trained as one ordinary model, whatever partition trained it."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError
from adaptipe.models import ModelSpec
from adaptipe.runtime.rundir import RunDir

__all__ = ["evaluate_jobs", "load_trained_model", "validation_loss"]


def load_trained_model(
    run_dir: str | Path,
    *,
    job: int | None = None,
    device: str = "cpu",
    checkpoint: str | Path | None = None,
) -> tuple[ModelSpec, nn.Sequential]:
    """The model declaration and its layers with the latest committed parameters.

    Checkpoint keys are global layer indices, so the stages' files assemble into one
    `nn.Sequential` regardless of how the run was partitioned. For a job-array pass
    ``job`` (its index in the sweep); a one-job run needs none. ``checkpoint`` picks a
    committed checkpoint folder other than the latest.
    """
    run = RunDir(run_dir)
    config = run.read_config()
    spec, tensors = _checkpoint_tensors(run, config, checkpoint)
    return spec, _job_model(run, config, spec, tensors, job, device)


def _checkpoint_tensors(
    run: RunDir, config: Any, checkpoint: str | Path | None
) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    found = Path(checkpoint) if checkpoint is not None else ckpt.latest(run.checkpoints)
    if found is None:
        raise PlanError(f"{run.root}: no committed checkpoint yet")
    spec = config.model.spec()
    tensors, _ = ckpt.load_compatible(
        found, model=spec.name, model_config=dict(spec.config), num_layers=spec.num_layers
    )
    return spec, tensors


def _job_model(
    run: RunDir,
    config: Any,
    spec: ModelSpec,
    tensors: dict[str, torch.Tensor],
    job: int | None,
    device: str,
) -> nn.Sequential:
    if config.sweep is not None:
        if job is None or not 0 <= job < len(config.jobs):
            raise PlanError(
                f"{run.root} trained a job-array: pass job=0..{len(config.jobs) - 1} (got {job})"
            )
        prefix = f"jobs.{job}."
        tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    model = spec.build_all(seed=config.jobs[job or 0].seed, device=device)
    for index, layer in enumerate(model):
        ckpt.load_layer_state(index, layer, None, tensors)
    model.eval()
    return model


def validation_loss(
    spec: ModelSpec, model: nn.Module, *, batch_size: int, max_batches: int = 50
) -> float:
    """Mean loss over (up to ``max_batches`` batches of) the validation split."""
    data = spec.dataset(split="val")
    if len(data) == 0:
        raise PlanError(f"the validation split of {spec.name!r} is empty")
    batch_size = min(batch_size, len(data))  # a small split is evaluated whole
    n = min(len(data) // batch_size, max_batches)
    total = 0.0
    with torch.no_grad():
        for b in range(n):
            x, y = data.batch(range(b * batch_size, (b + 1) * batch_size))
            total += float(spec.loss(model(x), y))
    return total / n


def evaluate_jobs(
    run_dir: str | Path,
    *,
    jobs: Iterable[int] | None = None,
    checkpoint: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Jobs of a run (all, or ``jobs``) with their validation loss, best first.

    The sweep's ranking, and successive halving's evidence at a rung (``checkpoint``).
    """
    run = RunDir(run_dir)
    config = run.read_config()
    spec, tensors = _checkpoint_tensors(run, config, checkpoint)
    wanted = set(jobs) if jobs is not None else None
    rows: list[dict[str, Any]] = []
    for job in config.jobs:
        if wanted is not None and job.index not in wanted:
            continue
        model = _job_model(
            run, config, spec, tensors, job.index if config.sweep is not None else None, "cpu"
        )
        rows.append(
            {
                "job": job.index,
                "name": job.name,
                "val_loss": validation_loss(spec, model, batch_size=job.batch_size),
            }
        )
    # A diverged job (NaN or infinite loss) ranks last; NaN would not sort at all.
    rows.sort(key=lambda r: (not math.isfinite(r["val_loss"]), r["val_loss"], r["job"]))
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
    return rows
