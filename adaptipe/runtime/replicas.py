"""A worker's place among its stage's replicas (`adaptipe.schedule.replicate`).

Every worker of a run builds one `Replicas` (an unreplicated run too: one replica per
stage, nothing extra runs). A replicated stage's workers share a process group of their
own (gloo on CPU, NCCL on GPU); just before each optimizer step they all-reduce (sum)
their gradients in it, so each applies the one-process update, then step identically.

What reports the stage is replica 0 (rank ``s``): it writes ``stages/stage-s.jsonl``, the
checkpoint's copy of the stage's layers, telemetry, traces and takes injected
interference; the other replicas write ``stages/stage-s.replica-k.jsonl``, which the
manager does not merge. On a replicated last stage the replicas all-reduce the
micro-batch losses too, so replica 0's record carries the iteration's loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adaptipe.runtime.iteration_stats import IterationStats
from adaptipe.runtime.recipe import GlobalClip
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.slots import LayerSlot
from adaptipe.runtime.transport import wire_device
from adaptipe.schedule.replicate import ReplicaLayout, replica_view
from adaptipe.schedule.types import Schedule

__all__ = ["Replicas"]

StepHook = Callable[[list[LayerSlot]], None]


@dataclass(kw_only=True, slots=True)
class Replicas:
    """This worker's ``stage`` and ``replica`` in ``layout``, and its stage's group."""

    layout: ReplicaLayout
    rank: int
    stage: int
    replica: int
    wire: torch.device  # where tensors travel (`wire_device`), all-reduces included
    group: Any = None  # the stage's replicas' process group (None: one replica)

    @classmethod
    def join(
        cls, layout: ReplicaLayout, rank: int, *, backend: str, device: torch.device
    ) -> Replicas:
        """Every worker calls this at the same point: each replicated stage's group is
        made by all of them, in stage order (`torch.distributed.new_group`)."""
        stage, replica = layout.place(rank)
        group = None
        for s, r in enumerate(layout.replicas):
            if r > 1:
                made = dist.new_group(ranks=list(layout.ranks(s)), backend=backend)
                group = made if s == stage else group
        wire = wire_device(device, backend)
        return cls(layout=layout, rank=rank, stage=stage, replica=replica, group=group, wire=wire)

    @property
    def primary(self) -> bool:
        """Replica 0: the one that reports the stage."""
        return self.replica == 0

    @property
    def count(self) -> int:
        return self.layout.replicas[self.stage]

    def view(self, schedule: Schedule) -> Schedule:
        """``schedule`` with this worker's list in its stage's place (peers are ranks)."""
        return (
            replica_view(schedule, self.layout, self.rank) if self.layout.replicated else schedule
        )

    def metrics_path(self, run: RunDir) -> Path:
        """Where this worker reports (replica 0: the stage's file the manager merges)."""
        if self.primary:
            return run.stage_metrics(self.stage)
        path = run.stage_metrics(self.stage).with_name(
            f"stage-{self.stage}.replica-{self.replica}.jsonl"
        )
        return path

    def step_hook(self, clip: GlobalClip | None) -> StepHook | None:
        """What runs just before each optimizer step: the gradient all-reduce, then
        ``clip`` (the global-norm clipper, which counts each stage once: replicas other
        than 0 send zeros, as their sums equal replica 0's)."""
        if clip is not None and not self.primary:
            exchange = clip.exchange
            clip.exchange = lambda local: exchange(local.zero_())
        if self.count == 1:
            return clip

        def hook(slots: list[LayerSlot]) -> None:
            self.reduce_gradients(slots)
            if clip is not None:
                clip(slots)

        return hook

    def reduce_gradients(self, slots: Sequence[LayerSlot]) -> None:
        """Sum the replicas' gradients in place (one flat all-reduce per step).

        Every replica runs the same layers on at least one micro-batch, so the same
        parameters hold a gradient on each of them.
        """
        grads = [p.grad for slot in slots for p in slot.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.wire)
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n

    def merge_losses(self, stats: IterationStats, *, last: bool, microbatches: int) -> None:
        """On a replicated last stage: every micro-batch's loss into every replica's
        ``stats`` (replica 0 reports the iteration's loss)."""
        if self.count == 1 or not last:
            return
        values = torch.zeros((1, microbatches), dtype=torch.float64)
        for (job, mb), value in stats.microbatch_losses.items():
            values[job, mb] = value
        values = values.to(self.wire)
        dist.all_reduce(values, group=self.group)
        summed = values.cpu()[0].tolist()
        stats.microbatch_losses = {(0, mb): v for mb, v in enumerate(summed)}
        stats.losses = {0: sum(summed)}
        stats.loss = stats.losses[0] / microbatches
