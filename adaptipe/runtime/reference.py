"""`train_reference`: single-process training with a schedule's exact numerics.

The pipeline runtime is checked against this ("numerics are sacred"). It reads the same
`BatchStream`, cuts the same micro-batches and scales losses by the same `loss_scale`,
then runs the micro-batches one after the other in one process:

- ``weights="sync"`` (GPipe, 1F1B, interleaved 1F1B, with or without recomputation):
  every micro-batch sees the weights of the iteration; gradients accumulate and one
  optimizer step follows the flush. This is plain mini-batch training.
- asynchronous schedules (PipeDream weight stashing or vertical sync, dissertation
  ch. 2 §2.3.2 / §2.4; PipeDream-2BW, ch. 3 §3.2.1, ``W(t+1) = W(t) - lr * grad
  f(W(t-1))``): the schedule's `Forward` instructions say which weight version micro-batch
  ``m`` uses on each virtual stage. Its forward and backward through that stage use that
  version (kept as a snapshot), while the optimizer updates the newest weights after
  every ``update_every`` micro-batches.

Micro-batches are processed in order ``k = 0, 1, 2...`` (``k = iteration * M + m``).
That is exact because a micro-batch only ever uses versions made by the steps of
earlier micro-batches, which is checked. Each iteration is one window that starts after
the previous one drained, so local version ``v`` of iteration ``i`` is global version
``i * (M // update_every) + v``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from adaptipe.errors import PlanError, ScheduleError
from adaptipe.models.spec import ModelSpec, Split
from adaptipe.plan.partition import Partition
from adaptipe.runtime.data import BatchStream, loss_scale, split_microbatches
from adaptipe.schedule.types import Forward, Schedule
from adaptipe.schedule.validate import validate

__all__ = ["ReferenceResult", "reference_param_names", "train_reference"]

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
# One weight version of a virtual stage: per layer of the stage, its tensors by name.
_Version = list[dict[str, Tensor]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceResult:
    """What `train_reference` ends with.

    Attributes:
        params: final parameters, ``layers.{global layer index}.{name in the layer}``
            (detached clones), in `reference_param_names` order.
        losses: per iteration, the mean over its micro-batches of their (unscaled) mean
            loss, i.e. the mini-batch mean loss.
        versions: ``versions[k][g]``: the global weight version micro-batch ``k``
            (``iteration * M + m``) used on virtual stage ``g``.
    """

    params: dict[str, Tensor]
    losses: list[float]
    versions: list[list[int]]


def _param_key(layer: int, name: str) -> str:
    return f"layers.{layer}.{name}"


def reference_param_names(spec: ModelSpec) -> list[str]:
    """The keys of `ReferenceResult.params` for ``spec``, in layer order (built on meta)."""
    return [
        _param_key(i, name)
        for i in range(spec.num_layers)
        for name, _ in spec.build_layer(i, seed=0, device="meta").named_parameters()
    ]


def _forward_versions(schedule: Schedule) -> list[list[int]]:
    """``table[g][m]``: the window-local version `Forward` of micro-batch ``m`` uses on
    virtual stage ``g``; raises `ScheduleError` unless it is made by earlier micro-batches."""
    where = f"schedule {schedule.name!r}"
    g_count, m_count, every = (
        schedule.num_virtual_stages,
        schedule.num_microbatches,
        schedule.update_every,
    )
    table: list[list[int | None]] = [[None] * m_count for _ in range(g_count)]
    for s, program in enumerate(schedule.stages):
        for i, ins in enumerate(program):
            if not isinstance(ins, Forward):
                continue
            g = schedule.vstage(s, ins.chunk)
            if table[g][ins.microbatch] is not None:
                raise ScheduleError(
                    f"{where}: stage {s}, instruction {i} {ins!r}: second Forward of "
                    f"micro-batch {ins.microbatch} on virtual stage {g}"
                )
            # Version v exists once the steps after micro-batches < v * update_every ran;
            # processing micro-batches in order is only exact if they all precede m.
            if ins.version > ins.microbatch // every:
                raise ScheduleError(
                    f"{where}: stage {s}, instruction {i} {ins!r}: micro-batch "
                    f"{ins.microbatch} would use weight version {ins.version}, which the "
                    f"optimizer step after micro-batch {ins.version * every - 1} makes; "
                    f"a micro-batch may only use versions <= {ins.microbatch // every} "
                    f"(made by earlier micro-batches, update_every={every})"
                )
            # 'sync' names no versions: a forward computes with the live weights, which
            # the validator guarantees are the ones after microbatch // update_every steps
            # (several flushes in one window, as job-array windows have).
            sync = schedule.weights == "sync"
            table[g][ins.microbatch] = ins.microbatch // every if sync else ins.version
    out: list[list[int]] = []
    for g, row in enumerate(table):
        missing = [m for m, v in enumerate(row) if v is None]
        if missing:
            raise ScheduleError(
                f"{where}: no Forward of micro-batch {missing[0]} on virtual stage {g}"
            )
        out.append([v for v in row if v is not None])
    return out


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _snapshot(layers: list[nn.Module]) -> _Version:
    return [{n: p.detach().clone() for n, p in layer.named_parameters()} for layer in layers]


def _forward_backward(
    spec: ModelSpec,
    stage_layers: list[list[nn.Module]],
    stage_versions: list[_Version],
    x: Tensor,
    target: Tensor,
    scale: float,
) -> float:
    """One micro-batch through every virtual stage, each with its own weight version;
    the gradients computed on those versions are added into the live parameters'
    ``.grad`` (the pending update, applied to the newest weights). Returns the loss."""
    leaves: list[_Version] = []
    h = x
    for modules, version in zip(stage_layers, stage_versions, strict=True):
        tensors = [{n: t.detach().requires_grad_(True) for n, t in v.items()} for v in version]
        leaves.append(tensors)
        for module, own in zip(modules, tensors, strict=True):
            h = functional_call(module, own, (h,))
    loss = spec.loss(h, target)
    torch.autograd.backward(loss * scale)
    for modules, tensors in zip(stage_layers, leaves, strict=True):
        for module, own in zip(modules, tensors, strict=True):
            for name, p in module.named_parameters():
                grad = own[name].grad
                if grad is not None:
                    p.grad = grad if p.grad is None else p.grad.add_(grad)
    return float(loss.detach())


def _check_args(
    spec: ModelSpec, schedule: Schedule, partition: Partition, batch_size: int, iterations: int
) -> None:
    partition.check_model(model=spec.name, num_layers=spec.num_layers)
    if partition.num_stages != schedule.num_virtual_stages:
        raise PlanError(
            f"partition has {partition.num_stages} stages but schedule {schedule.name!r} has "
            f"{schedule.num_virtual_stages} virtual stages ({schedule.num_stages} workers x "
            f"{schedule.num_chunks} chunks)"
        )
    if schedule.num_jobs != 1:
        raise PlanError(
            f"train_reference trains one job; schedule {schedule.name!r} has "
            f"num_jobs={schedule.num_jobs}"
        )
    for what, value, low in (("batch_size", batch_size, 1), ("iterations", iterations, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what} must be an int >= {low} (got {value!r})")
    if batch_size % schedule.num_microbatches:
        raise ValueError(
            f"batch_size={batch_size} must be a multiple of the schedule's "
            f"num_microbatches={schedule.num_microbatches}"
        )


def train_reference(
    *,
    spec: ModelSpec,
    schedule: Schedule,
    partition: Partition,
    make_optimizer: MakeOptimizer,
    batch_size: int,
    iterations: int,
    seed: int,
    data_seed: int,
    split: Split = "train",
) -> ReferenceResult:
    """Train ``spec`` for ``iterations`` mini-batches in one process, as ``schedule`` would.

    Args:
        spec: the model; layer ``i`` is ``spec.build_layer(i, seed=seed)``.
        schedule: a single-job schedule (validated here); its ``weights`` and `Forward`
            versions define the numerics (module doc).
        partition: virtual stage ``g`` owns layers ``partition.layers(g)`` and they share
            its weight version.
        make_optimizer: called once per layer that has parameters, with that layer's
            parameters (as the runtime does; for elementwise optimizers this equals one
            optimizer over the whole model).
        batch_size: samples per mini-batch, a multiple of ``schedule.num_microbatches``.
        iterations: mini-batches (one schedule window each) to train on.
        seed: weight-initialisation seed.
        data_seed: `BatchStream` seed.
        split: dataset split to read.
    """
    _check_args(spec, schedule, partition, batch_size, iterations)
    validate(schedule)
    local = _forward_versions(schedule)
    g_count, m_count, every = (
        schedule.num_virtual_stages,
        schedule.num_microbatches,
        schedule.update_every,
    )
    per_window = m_count // every
    # Per stage, the smallest local version micro-batches m' > m still use (per_window
    # past the window's end, i.e. the next window's first version): older ones are dropped.
    still_needed = [
        [min(row[m + 1 :], default=per_window) for m in range(m_count)] for row in local
    ]

    layers = [spec.build_layer(i, seed=seed) for i in range(spec.num_layers)]
    optimizers = [
        make_optimizer(list(layer.parameters())) if _has_params(layer) else None for layer in layers
    ]
    stage_layers = [[layers[i] for i in partition.layers(g)] for g in range(g_count)]
    history: list[dict[int, _Version]] = [{0: _snapshot(s)} for s in stage_layers]
    latest = 0
    scale = loss_scale(schedule)
    stream = BatchStream(spec.dataset(split=split), batch_size=batch_size, seed=data_seed)
    losses: list[float] = []
    versions: list[list[int]] = []

    for iteration in range(iterations):
        x, y = next(stream)
        base = iteration * per_window
        loss_sum = 0.0
        for m, (x_mb, target) in enumerate(split_microbatches(x, y, m_count)):
            used = [base + local[g][m] for g in range(g_count)]
            versions.append(used)
            stage_versions = [history[g][used[g]] for g in range(g_count)]
            loss_sum += _forward_backward(spec, stage_layers, stage_versions, x_mb, target, scale)
            if (m + 1) % every == 0:
                for optimizer in optimizers:
                    if optimizer is not None:
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                latest += 1
                for g, modules in enumerate(stage_layers):
                    history[g][latest] = _snapshot(modules)
            for g in range(g_count):
                keep = min(base + still_needed[g][m], latest)
                for old in [v for v in history[g] if v < keep]:
                    del history[g][old]
        losses.append(loss_sum / m_count)

    params = {
        _param_key(i, name): p.detach().clone()
        for i, layer in enumerate(layers)
        for name, p in layer.named_parameters()
    }
    return ReferenceResult(params=params, losses=losses, versions=versions)
