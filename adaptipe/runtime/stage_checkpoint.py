"""Checkpoints of a running pipeline: every stage saves its own layers, rank 0 commits.

Each stage writes its layers' tensors under global keys (`Stage.tensors`), so the
checkpoint loads under any partition; rank 0 seals it once every stage has saved, with
the plan history up to that iteration (`plan_history`: each version the workers
switched to, and where), which a resume puts back where the run directory lost it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.models import ModelSpec
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.planversion import plan_history, restore_history
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.stagestate import Stage

__all__ = ["load_latest", "save_checkpoint"]


def save_checkpoint(
    run: RunDir,
    stage: Stage,
    *,
    iteration: int,
    steps: int,
    rank: int,
    world: int,
    config: RunConfig,
    num_layers: int,
    primary: bool = True,
) -> None:
    """Save this stage's layers and, on rank 0, commit the checkpoint; every worker calls
    it. Of a replicated stage only replica 0 (``primary``) writes: one copy per stage."""
    if stage.memory is not None:
        stage.memory.synchronize()  # offloaded states are complete before they are saved
    meta: dict[str, Any] = {"iteration": iteration, "stage": rank, "layers": stage.layers()}
    if primary:
        ckpt.save_stage(
            run.checkpoint_dir(iteration), stage=rank, tensors=stage.tensors(), meta=meta
        )
    dist.barrier()
    if rank == 0 and primary:
        ckpt.commit(
            run.checkpoints,
            iteration=iteration,
            num_stages=world,
            meta={
                "model": config.model.name,
                "model_config": dict(config.model.config),
                "num_layers": num_layers,
                "jobs": [job.name for job in config.jobs],
                "steps": steps,
                # the plan versions in force so far: a resume replays the switches
                "plans": plan_history(run, iteration),
            },
        )
        if config.train.keep_checkpoints > 0:
            ckpt.prune(run.checkpoints, keep=config.train.keep_checkpoints)
    dist.barrier()


def load_latest(run: RunDir, spec: ModelSpec, stage: Stage, *, restore: bool) -> int:
    """Load the latest checkpoint into ``stage``; return its iteration (0: none).
    ``restore``: put the checkpoint's plan history back into the run's control folder
    where it is missing (one worker does)."""
    found = ckpt.latest(run.checkpoints)
    if found is None:
        return 0
    tensors, meta = ckpt.load_compatible(
        found, model=spec.name, model_config=dict(spec.config), num_layers=spec.num_layers
    )
    stage.load(tensors)
    stage.resume_steps(int(meta.get("meta", {}).get("steps", 0)))
    history = meta.get("meta", {}).get("plans", [])  # absent in older checkpoints
    if restore and history:
        restore_history(run, history, source=str(found / ckpt.COMMITTED))
    return int(meta["iteration"])
