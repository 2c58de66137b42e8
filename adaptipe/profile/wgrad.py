"""Batched weight gradients: ``nn.Linear`` backward without its weight gradient.

A Linear layer's backward is two GEMMs: the input gradient ``dX = dY W`` and the weight
gradient ``dW = dY^T X``. Pipelining cuts a batch into micro-batches of ``b`` rows, which
leaves the inner dimension of ``dW`` at ``b`` and makes it the least efficient GEMM of
the step. Zero-bubble pipelining splits backward into B (``dX``) and W (``dW``) to move W
into bubbles (Qi et al., 2023, "Zero Bubble Pipeline Parallelism", §2); here W is instead
postponed to the optimizer step and done once for all ``M`` micro-batches::

    dW = sum_m dY_m^T X_m = cat_m(dY_m)^T cat_m(X_m)      (one GEMM, inner dim M*b)
    db = sum over all rows of cat_m(dY_m)

Inside `defer_weight_grads`, a micro-batch's backward through a Linear computes only
``dX`` and appends ``(X, dY)`` to a `WeightGradStash`; `WeightGradStash.flush` then
writes ``dW`` (and ``db``) into ``.grad``. Other layers keep ordinary autograd. ``X`` is
what autograd keeps for backward anyway, but it now lives until the flush, and ``dY`` is
kept too: a stage holds both for every micro-batch of the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = ["WeightGradStash", "defer_weight_grads", "deferred_linear"]


@dataclass(slots=True)
class _Pending:
    weight: Tensor
    bias: Tensor | None
    inputs: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)


class WeightGradStash:
    """The ``(X, dY)`` pairs of every deferred Linear since the last `flush`.

    Pairs are kept per ``(weight, bias)`` so a weight shared by two Linear layers gets
    one GEMM over both layers' rows.
    """

    def __init__(self) -> None:
        self._pending: dict[tuple[int, int], _Pending] = {}

    def __len__(self) -> int:
        """The number of ``(X, dY)`` pairs waiting."""
        return sum(len(p.inputs) for p in self._pending.values())

    @property
    def num_weights(self) -> int:
        """How many weight gradients (one GEMM each over all their rows) `flush` computes."""
        return len(self._pending)

    def add(self, weight: Tensor, bias: Tensor | None, x: Tensor, dy: Tensor) -> None:
        key = (id(weight), id(bias))
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(weight, bias)
        pending.inputs.append(x.detach())
        pending.grads.append(dy.detach())

    def pairs(self) -> list[tuple[Tensor, Tensor | None, Tensor, Tensor]]:
        """Every stashed ``(weight, bias, X, dY)``, as `add` would take them again."""
        return [
            (p.weight, p.bias, x, dy)
            for p in self._pending.values()
            for x, dy in zip(p.inputs, p.grads, strict=True)
        ]

    def flush(self) -> None:
        """Add the weight (and bias) gradients of everything stashed into ``.grad``."""
        with torch.no_grad():
            for p in self._pending.values():
                x = _rows(p.inputs)
                dy = _rows(p.grads)
                if p.weight.requires_grad:
                    _accumulate(p.weight, dy.t().mm(x))
                if p.bias is not None and p.bias.requires_grad:
                    _accumulate(p.bias, dy.sum(0))
        self._pending.clear()

    def clear(self) -> None:
        """Drop everything stashed without computing it."""
        self._pending.clear()


def _rows(tensors: list[Tensor]) -> Tensor:
    """Concatenate ``(..., features)`` tensors into one ``(rows, features)`` matrix."""
    flat = [t.reshape(-1, t.shape[-1]) for t in tensors]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def _accumulate(param: Tensor, grad: Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns only the input gradient and stashes ``(X, dY)``."""

    # The combined forward(ctx, ...) form: with a separate setup_context, every apply()
    # binds its arguments through inspect.signature, which costs more than a small GEMM.
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, stash: WeightGradStash
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias = bias  # a parameter: kept alive by its module anyway
        ctx.stash = stash
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        grad_x = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            ctx.stash.add(weight, ctx.bias, x, dy)
        return grad_x, None, None, None


def deferred_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, stash: WeightGradStash
) -> Tensor:
    """``F.linear(x, weight, bias)`` whose weight and bias gradients go to ``stash``.

    ``weight`` and ``bias`` must be leaves (parameters): their ``.grad`` is written by
    ``stash.flush()``, not by autograd. Without grad mode this is plain ``F.linear``.
    """
    if not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    out: Tensor = _DeferredLinear.apply(x, weight, bias, stash)  # type: ignore[no-untyped-call]
    return out


def _uses_linear_forward(linear: nn.Linear) -> bool:
    # Subclasses with their own forward, and modules already patched, are left alone.
    return type(linear).forward is nn.Linear.forward and "forward" not in linear.__dict__


@contextmanager
def defer_weight_grads(modules: Iterable[nn.Module], stash: WeightGradStash) -> Iterator[int]:
    """Within the block, every ``nn.Linear`` inside ``modules`` runs `deferred_linear`.

    Works through ``torch.func.functional_call`` too (the forward reads the module's
    current ``weight`` and ``bias``). Yields how many Linear layers were switched.
    """
    found: dict[int, nn.Linear] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, nn.Linear) and _uses_linear_forward(m):
                found[id(m)] = m
    linears = list(found.values())
    for linear in linears:
        linear.forward = _make_forward(linear, stash)  # type: ignore[method-assign]
    try:
        yield len(linears)
    finally:
        for linear in linears:
            del linear.forward


def _make_forward(linear: nn.Linear, stash: WeightGradStash) -> Any:
    def forward(x: Tensor) -> Tensor:
        return deferred_linear(x, linear.weight, linear.bias, stash)

    return forward
