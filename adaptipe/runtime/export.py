"""Load what a run trained as one ordinary model, whatever partition trained it."""

from __future__ import annotations

from pathlib import Path

from torch import nn

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError
from adaptipe.models import ModelSpec, get_model
from adaptipe.runtime.rundir import RunDir

__all__ = ["load_trained_model"]


def load_trained_model(
    run_dir: str | Path, *, device: str = "cpu"
) -> tuple[ModelSpec, nn.Sequential]:
    """The model declaration and its layers with the latest committed parameters.

    Checkpoint keys are global layer indices, so the stages' files assemble into one
    `nn.Sequential` regardless of how the run was partitioned.
    """
    run = RunDir(run_dir)
    config = run.read_config()
    found = ckpt.latest(run.checkpoints)
    if found is None:
        raise PlanError(f"{run.root}: no committed checkpoint yet")
    tensors, meta = ckpt.load(found)
    spec = get_model(config.model.name, **config.model.config)
    ckpt.check_compatible(
        meta,
        model=spec.name,
        model_config=dict(spec.config),
        num_layers=spec.num_layers,
        source=str(found),
    )
    model = spec.build_all(seed=config.train.seed, device=device)
    for index, layer in enumerate(model):
        ckpt.load_layer_state(index, layer, None, tensors)
    model.eval()
    return spec, model
