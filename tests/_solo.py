"""What a job of an array trains alone: the yardstick of the job-array numerics tests.

The reference is built from a *run config*, not from the job's parsed seeds: the array's
config without its sweep, with the job's optimizer, batch size and ``[train].seed``, as
a user would write it to train that job by itself. So the config's own rules (the data
order follows ``[data].seed`` when the config sets it, else ``[train].seed``) decide the
reference's data order, independently of how a sweep resolves a job's data seed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch

from adaptipe.models import get_model
from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.reference import train_reference
from adaptipe.runtime.sweep import JobSpec
from adaptipe.schedule.build import build_schedule


def solo_config(raw: Mapping[str, Any], job: JobSpec) -> RunConfig:
    """The config that trains ``job`` alone; ``raw``: the array's config as a dict."""
    data = copy.deepcopy(dict(raw))
    data.pop("sweep", None)
    opt = {f.name: getattr(job.optimizer, f.name) for f in fields(job.optimizer)}
    opt["betas"] = list(opt["betas"])
    data["optimizer"] = opt
    data.setdefault("data", {}).update(batch_size=job.batch_size, microbatches=1)
    data.setdefault("train", {})["seed"] = job.seed
    return RunConfig.from_dict(data, source=f"solo {job.name}")


def alone_params(
    raw: Mapping[str, Any], job: JobSpec, iterations: int | None = None
) -> dict[str, torch.Tensor]:
    """The parameters ``job`` ends with trained alone (one process, whole mini-batches)."""
    solo = solo_config(raw, job)
    spec = get_model(solo.model.name, **solo.model.config)
    return train_reference(
        spec=spec,
        schedule=build_schedule("gpipe", stages=1, microbatches=1),
        partition=Partition.even(model=spec.name, num_layers=spec.num_layers, num_stages=1),
        make_optimizer=solo.optimizer.build,
        batch_size=solo.data.batch_size,
        iterations=iterations if iterations is not None else solo.train.iterations or 0,
        seed=solo.train.seed,
        data_seed=solo.data.seed,
    ).params
