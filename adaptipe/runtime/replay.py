"""A receiving helper's copy of moving layers (`adaptipe.runtime.courier_main`): built
from the base snapshot, stepped with each logged step's gradients by the optimizer the
stage builds, written back for the stage to adopt. The same tensors and the same
optimizer steps as the stage's own update: the copy follows the sender bit for bit."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import safetensors.torch
import torch
from torch import Tensor

from adaptipe.runtime import checkpoint as ckpt
from adaptipe.runtime.config_sections import OptimizerSection
from adaptipe.runtime.courier import layout

__all__ = ["Copy", "optimizer_section", "save_copy", "warm"]


class Copy:
    """Parameters, buffers and optimizer state of ``layers`` on ``device``."""

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        layers: Sequence[int],
        entries: list[list[Any]],
        optimizer: Mapping[str, Any],
        device: str,
    ) -> None:
        self.device = torch.device(device)
        self.layers, self.entries = list(layers), entries
        self.slot_bytes, self.groups = layout(entries)
        self.state = {k: v.to(self.device) for k, v in tensors.items() if k.startswith("layers.")}
        self.params: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        self.buffers: dict[int, list[str]] = {}
        self.optimizers: dict[int, torch.optim.Optimizer | None] = {}
        section = optimizer_section(optimizer)
        for i in self.layers:
            names = [e[0].split("/", 2)[2] for e in entries if e[0].startswith(f"{i}/grad/")]
            self.buffers[i] = [
                e[0].split("/", 2)[2] for e in entries if e[0].startswith(f"{i}/buffer/")
            ]
            params = []
            for name in names:
                p = torch.nn.Parameter(self.state[f"layers.{i}.{name}"])
                self.state[f"layers.{i}.{name}"] = p
                params.append((name, p))
            self.params[i] = params
            opt = section.build([p for _, p in params]) if params else None
            self.optimizers[i] = opt
            if opt is not None:
                ckpt.load_optimizer_state(i, dict(params), opt, tensors, f"layer {i}")

    @classmethod
    def from_base(
        cls,
        body: bytes,
        layers: Sequence[int],
        optimizer: Mapping[str, Any],
        device: str,
    ) -> Copy:
        from adaptipe.runtime.courier_main import header

        meta = json.loads(header(body)["__metadata__"]["adaptipe_stream"])
        if list(meta["layers"]) != list(layers):
            raise ValueError(f"the base holds layers {meta['layers']}, not {list(layers)}")
        return cls(safetensors.torch.load(body), layers, meta["log"], optimizer, device)

    def replay(self, body: bytes) -> None:
        """One optimizer step with a logged step's gradients, then its buffers."""
        if len(body) != self.slot_bytes:
            raise ValueError(f"a logged step of {len(body)} bytes, not {self.slot_bytes}")
        raw = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        logged: dict[str, Tensor | None] = {}
        for group in self.groups:
            size = torch.empty((), dtype=group.dtype).element_size()
            flat = raw[group.offset : group.offset + group.numel * size].view(group.dtype)
            at = 0
            for m in group.members:
                key, _, shape = self.entries[m]
                n = _numel(shape)
                present = bool(raw[m])
                logged[key] = flat[at : at + n].view(shape) if present else None
                at += n
        for i in self.layers:
            for name, p in self.params[i]:
                grad = logged[f"{i}/grad/{name}"]
                p.grad = grad.to(self.device) if grad is not None else None
            opt = self.optimizers[i]
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for name in self.buffers[i]:
                    buf = logged[f"{i}/buffer/{name}"]
                    assert buf is not None
                    self.state[f"layers.{i}.{name}"].copy_(buf)

    def tensors(self) -> dict[str, Tensor]:
        """The copy's state under `adaptipe.runtime.checkpoint.layer_state`'s keys."""
        out = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.state.items()}
        for i in self.layers:
            opt = self.optimizers[i]
            if opt is not None:
                out.update(ckpt.optimizer_state(i, self.params[i], opt))
        return out


def optimizer_section(fields: Mapping[str, Any]) -> OptimizerSection:
    """The stage's ``[optimizer]`` from its JSON form (`dataclasses.asdict`)."""
    values = dict(fields)
    values["betas"] = tuple(values["betas"])
    return OptimizerSection(**values)


def warm(device: str) -> None:
    """Import what a first optimizer step imports lazily (torch._dynamo: seconds) and,
    for a GPU stage, create the CUDA context and load the optimizers' kernels (seconds
    more): a move must not wait for either."""
    where = torch.device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    for kind in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        p = torch.nn.Parameter(torch.zeros(4, device=where))
        opt = kind([p], lr=0.1, foreach=False)
        p.grad = torch.ones(4, device=where)
        opt.step()
    if where.type == "cuda":
        torch.cuda.synchronize(where)


def save_copy(copy: Copy, path: str) -> None:
    safetensors.torch.save_file(copy.tensors(), path)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
