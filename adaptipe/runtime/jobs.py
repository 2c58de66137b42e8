"""`JobSpec`: one sibling job of a job-array, as the stage executor and the config see it.

Kept apart from `adaptipe.runtime.sweep`, which parses ``[sweep]`` and sizes windows
with the JAPSP solvers: the executor needs the job, not the solvers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["JobSpec"]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """One sibling job: its hyper-parameters, weight-init ``seed`` and ``data_seed``."""

    index: int
    name: str
    optimizer: Any  # OptimizerSection (kept untyped here to avoid an import cycle)
    batch_size: int
    seed: int
    data_seed: int

    def to_dict(self) -> dict[str, Any]:
        opt = {f.name: getattr(self.optimizer, f.name) for f in fields(self.optimizer)}
        opt["betas"] = list(opt["betas"])
        opt["optimizer"] = opt.pop("name")  # a job's "name" is the job's
        return {
            **opt,
            "name": self.name,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "data_seed": self.data_seed,
        }
