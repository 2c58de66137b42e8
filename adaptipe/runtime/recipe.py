"""The training recipe's two partition-free parts: learning-rate schedules and gradient
clipping by global norm.

**Schedules** are functions of the iteration number alone (`LrSchedule.factor`): they
hold no state, so a resumed run, a migrated layer and a job of a job-array all see the
same rate at the same step, and a sweep can vary them like ``lr``. A linear warm-up
(from ``lr / warmup`` up to ``lr`` over ``warmup`` iterations) comes first; then
``constant``, ``cosine`` (down to ``min_lr_ratio * lr`` at ``total`` iterations) or
``step`` (times ``gamma`` every ``step_every`` iterations), counted from the end of the
warm-up.

**Clipping.** The global norm is the square root of the sum over layers, in global layer
order, of each layer's squared gradient norm (each in float64, its parameters in
registration order). A stage computes its own layers' terms, the stages exchange them
(one small message), and every stage sums them in layer order, so the norm, and the
clipped step, do not depend on where the cuts are or on a migration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from adaptipe.errors import PlanError

__all__ = [
    "SCHEDULES",
    "STEP_KEY",
    "GlobalClip",
    "LrSchedule",
    "attach_schedule",
    "clip_coefficient",
    "global_clip",
    "global_norm",
    "layer_sq_norm",
    "params_sq_norm",
    "scale_gradients",
    "scale_params",
]

Schedule = Literal["constant", "cosine", "step"]
SCHEDULES: tuple[Schedule, ...] = ("constant", "cosine", "step")


@dataclass(frozen=True, slots=True, kw_only=True)
class LrSchedule:
    """The learning rate at an iteration, as a factor of the job's ``lr``."""

    kind: Schedule = "constant"
    warmup: int = 0
    total: int = 0  # cosine: iterations from the start to the end of the decay
    min_lr_ratio: float = 0.0
    step_every: int = 0
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise PlanError(f"schedule {self.kind!r} (allowed: {', '.join(SCHEDULES)})")
        if self.warmup < 0:
            raise PlanError(f"warmup must be >= 0 (got {self.warmup})")
        if self.kind == "cosine" and self.total <= self.warmup:
            raise PlanError(
                f"cosine schedule: total ({self.total}) must exceed warmup ({self.warmup})"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise PlanError(f"min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        if self.kind == "step" and self.step_every < 1:
            raise PlanError(f"step schedule: step_every must be >= 1 (got {self.step_every})")
        if not 0.0 < self.gamma <= 1.0:
            raise PlanError(f"gamma must be in (0, 1] (got {self.gamma})")

    def factor(self, iteration: int) -> float:
        """The factor at ``iteration`` (0-based, the optimizer step it comes before)."""
        if iteration < self.warmup:
            return (iteration + 1) / self.warmup
        after = iteration - self.warmup
        if self.kind == "cosine":
            span = self.total - self.warmup
            progress = min(after / span, 1.0)
            cos = 0.5 * (1.0 + math.cos(math.pi * progress))
            return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cos
        if self.kind == "step":
            return float(self.gamma ** (after // self.step_every))
        return 1.0

    def lr(self, base: float, iteration: int) -> float:
        return base * self.factor(iteration)


STEP_KEY = "schedule_step"
"""The optimizer-state key of a scheduled optimizer's step count: a CPU tensor in the
state of each group's first parameter, so checkpoints, migrations and job-state moves
carry it like any other state (and it stays on the CPU, as torch keeps ``step``)."""


def attach_schedule(
    optimizer: torch.optim.Optimizer, schedule: LrSchedule, *, base_lr: float
) -> None:
    """Set every group's rate to ``base_lr * schedule.factor(n)`` before each step, n
    being the steps this optimizer has taken (kept in its state under `STEP_KEY`)."""

    def counter(group: dict[str, Any]) -> Tensor | None:
        params = group["params"]
        return optimizer.state[params[0]].get(STEP_KEY) if params else None

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            done = counter(group)
            group["lr"] = schedule.lr(base_lr, int(done) if done is not None else 0)

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            if group["params"]:
                state = opt.state[group["params"][0]]
                done = state.get(STEP_KEY)
                state[STEP_KEY] = torch.tensor(int(done) + 1 if done is not None else 1)

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
    for group in optimizer.param_groups:  # what the first step will use
        group["lr"] = schedule.lr(base_lr, 0)


def layer_sq_norm(layer: nn.Module) -> float:
    """The squared norm of ``layer``'s gradients in float64 (parameters without a
    gradient count 0), summed in registration order."""
    return params_sq_norm(layer.parameters())


def params_sq_norm(params: Iterable[Tensor]) -> float:
    """`layer_sq_norm` of parameters given in their layer's registration order."""
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(torch.sum(p.grad.detach().double() ** 2))
    return total


def global_norm(terms: Mapping[int, float], num_layers: int) -> float:
    """The global gradient norm from every layer's squared norm (`layer_sq_norm`), keyed
    by global layer index, summed in layer order."""
    missing = [i for i in range(num_layers) if i not in terms]
    if missing:
        raise ValueError(f"global_norm: no squared norm for layers {missing}")
    return math.sqrt(math.fsum(terms[i] for i in range(num_layers)))


def clip_coefficient(norm: float, max_norm: float, *, eps: float = 1e-6) -> float | None:
    """The factor to scale gradients by (None: leave them), as
    ``torch.nn.utils.clip_grad_norm_`` computes it."""
    coef = max_norm / (norm + eps)
    return coef if coef < 1.0 else None


def scale_gradients(layers: Iterable[nn.Module], coef: float) -> None:
    scale_params((p for layer in layers for p in layer.parameters()), coef)


def scale_params(params: Iterable[Tensor], coef: float) -> None:
    """Multiply every gradient of ``params`` by ``coef`` in place."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


class GlobalClip:
    """Clip a stage's gradients by the whole model's norm, just before its step.

    ``exchange`` sums a float64 vector over the stages (an all-reduce); each stage
    fills only its own layers' entries, so every entry is one stage's value plus zeros,
    exact in any order, and every stage then sums the same vector in layer order. The
    norm, and so the clipped step, is the same for any partition and across migrations.
    ``last_norm`` keeps the latest global norm (before clipping) for the metrics."""

    def __init__(
        self, max_norm: float, num_layers: int, exchange: Callable[[Tensor], Tensor]
    ) -> None:
        self.max_norm, self.num_layers, self.exchange = max_norm, num_layers, exchange
        self.last_norm: float | None = None

    def __call__(self, slots: Sequence[Any]) -> None:
        """``slots``: this stage's `LayerSlot`s (``index``, ``module``)."""
        local = torch.zeros(self.num_layers, dtype=torch.float64)
        for slot in slots:
            local[slot.index] = layer_sq_norm(slot.module)
        summed = self.exchange(local)
        norm = global_norm(dict(enumerate(summed.tolist())), self.num_layers)
        self.last_norm = norm
        coef = clip_coefficient(norm, self.max_norm)
        if coef is not None:
            scale_gradients((slot.module for slot in slots), coef)


def global_clip(max_norm: float, num_layers: int) -> GlobalClip | None:
    """``[optimizer] clip_grad_norm``'s clipper over every stage process (None: off);
    the norms travel on a gloo group of their own. Every stage calls it once, in the
    same order as its other groups."""
    if not max_norm:
        return None
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")

    def exchange(local: Tensor) -> Tensor:
        dist.all_reduce(local, group=group)
        return local

    return GlobalClip(max_norm, num_layers, exchange)
