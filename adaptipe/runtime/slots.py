"""A layer slot: one model layer on a stage, with everything that belongs to the layer.

A stage holds an ordered list of slots per local chunk (docs/architecture.md, "Shape of
a stage"). A slot owns its module, its optimizer (so the state, step count included,
travels with the layer) and its random stream: a layer that draws random numbers in
training (dropout) draws them from a generator seeded by (run seed, layer, step, job,
micro-batch), never from a stage-wide stream, so its masks do not depend on which stage
holds it or which layers ran before it, and a recomputed forward draws the same mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from adaptipe.models.data import mix_seed
from adaptipe.models.spec import RNG_LOCK

__all__ = ["LayerSlot", "draws_random", "layer_seed"]

_DROPOUT = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


# The draws go through the process-wide generator (nn.Dropout takes no generator): stages
# run as threads of one process (`adaptipe.runtime.local_transport`) take turns, and so
# do layers being built on another thread (a streamed migration's copies).
_DRAW_LOCK = RNG_LOCK


def draws_random(module: nn.Module) -> list[str]:
    """The submodules of ``module`` that draw random numbers in training, described."""
    found = []
    for name, sub in module.named_modules():
        label = name or type(sub).__name__
        if isinstance(sub, _DROPOUT) and sub.p > 0:
            found.append(f"{label} ({type(sub).__name__} p={sub.p:g})")
        elif isinstance(sub, nn.MultiheadAttention) and sub.dropout > 0:
            found.append(f"{label} (MultiheadAttention dropout={sub.dropout:g})")
        elif isinstance(sub, nn.RReLU):
            found.append(f"{label} (RReLU)")
    return found


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer ``index``'s random stream in a run seeded ``seed``."""
    return mix_seed(seed, index, 0x5107)


@dataclass(slots=True)
class LayerSlot:
    """One model layer on this stage: its module, its optimizer and its random stream.

    ``seed`` is the layer's stream (`layer_seed`); ``random`` says whether the layer
    draws from it at all (layers that do not cost nothing extra).
    """

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer | None  # None for a layer without parameters
    seed: int = 0
    random: bool = field(default=False)

    @classmethod
    def build(
        cls, index: int, module: nn.Module, optimizer: torch.optim.Optimizer | None, *, seed: int
    ) -> LayerSlot:
        return cls(
            index,
            module,
            optimizer,
            seed=layer_seed(seed, index),
            random=bool(draws_random(module)),
        )

    @contextlib.contextmanager
    def draws(self, step: int, job: int, microbatch: int, device: torch.device) -> Iterator[None]:
        """Run the layer's forward on its own random stream for (step, job, micro-batch)."""
        if not self.random:
            yield
            return
        cuda = device.type == "cuda"
        index = (
            (device.index if device.index is not None else torch.cuda.current_device())
            if cuda
            else 0
        )
        with _DRAW_LOCK, torch.random.fork_rng(devices=[index] if cuda else []):
            draw_seed = mix_seed(self.seed, step, job, microbatch)
            torch.default_generator.manual_seed(draw_seed)
            if cuda:  # the generator of the device the layer runs on
                torch.cuda.default_generators[index].manual_seed(draw_seed)
            yield
