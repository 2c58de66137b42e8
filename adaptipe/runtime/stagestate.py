"""A worker's layer state: building it, and saving/loading it under global keys.

One job keeps its parameters in the slots' modules (keys ``layers.{i}.*``). A job-array
keeps one public structure per layer and per-job states in a `Binder` (keys
``jobs.{j}.layers.{i}.*``). Keys name global layer indices, so a checkpoint loads under
any partition.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.models import ModelSpec
from adaptipe.plan.partition import Partition
from adaptipe.runtime.binder import Binder
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.memory import MemoryManager
from adaptipe.runtime.stage import LayerSlot
from adaptipe.schedule.types import Schedule

__all__ = ["StageState", "build_stage"]


class StageState:
    """The slots of each local chunk and, for a job-array, the binder behind them."""

    def __init__(self, chunks: list[list[LayerSlot]], binder: Binder | None) -> None:
        self.chunks = chunks
        self.binder = binder
        self.memory: MemoryManager | None = None  # set when job states are offloaded

    def layers(self) -> list[int]:
        return [slot.index for chunk in self.chunks for slot in chunk]

    def tensors(self) -> dict[str, Tensor]:
        """Every parameter and optimizer state of this stage, under global keys."""
        out: dict[str, Tensor] = {}
        if self.binder is None:
            for chunk in self.chunks:
                for slot in chunk:
                    out.update(ckpt.layer_state(slot.index, slot.module, slot.optimizer))
            return out
        for job in range(self.binder.num_jobs):
            for index in self.layers():
                module, opt = self.binder.state(job, index)
                out.update(
                    {f"jobs.{job}.{k}": v for k, v in ckpt.layer_state(index, module, opt).items()}
                )
        return out

    def load(self, tensors: Mapping[str, Tensor]) -> None:
        """Restore this stage's layers (and optimizer states) from global keys."""
        if self.binder is None:
            for chunk in self.chunks:
                for slot in chunk:
                    ckpt.load_layer_state(slot.index, slot.module, slot.optimizer, tensors)
            return
        for job in range(self.binder.num_jobs):
            prefix = f"jobs.{job}."
            mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            for index in self.layers():
                module, opt = self.binder.state(job, index)
                ckpt.load_layer_state(index, module, opt, mine)


def build_stage(
    spec: ModelSpec,
    partition: Partition,
    schedule: Schedule,
    rank: int,
    config: RunConfig,
    device: torch.device,
) -> StageState:
    """Build this worker's layers as training each job alone would build them."""
    layer_lists = [
        list(partition.layers(schedule.vstage(rank, c))) for c in range(schedule.num_chunks)
    ]
    if config.sweep is None:
        chunks: list[list[LayerSlot]] = []
        for layers in layer_lists:
            slots = []
            for i in layers:
                module = spec.build_layer(i, seed=config.train.seed, device=device)
                params = list(module.parameters())
                slots.append(
                    LayerSlot(i, module, config.optimizer.build(params) if params else None)
                )
            chunks.append(slots)
        return StageState(chunks, None)
    # With a memory budget below the job count the job states start in host memory (the
    # memory manager brings the first ones to the device): all of them on the device at
    # once is what the budget is there to avoid. Layers are initialised on the CPU either
    # way, so where they are built changes no value.
    budget = config.sweep.memory_budget
    host_first = device.type != "cpu" and 0 < budget < len(config.jobs)
    binder = Binder(
        layers=[i for layers in layer_lists for i in layers],
        jobs=config.jobs,
        build_layer=lambda i, seed: spec.build_layer(
            i, seed=seed, device="cpu" if host_first else device
        ),
        make_optimizer=lambda job, params: job.optimizer.build(params),
    )
    if host_first:  # the structures' constant buffers (a causal mask) run on the device
        for structure in binder.structures.values():
            for module in structure.modules():
                for name, buf in list(module.named_buffers(recurse=False)):
                    setattr(module, name, buf.to(device))
    chunks = [[LayerSlot(i, binder.structures[i], None) for i in layers] for layers in layer_lists]
    return StageState(chunks, binder)
