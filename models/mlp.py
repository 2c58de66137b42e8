""" "mlp": a deep ReLU MLP regressing a fixed random teacher network (synthetic data)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaptipe.models.data import Dataset
from adaptipe.models.spec import LayerSpec, ModelSpec, Split, check_min, check_types

__all__ = ["MLPConfig", "mlp_spec"]

NAME = "mlp"
_DATA_SEED = 20240601  # the data never depends on the training seed
_TEACHER_HIDDEN = 64
_NOISE_STD = 0.01


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """``depth`` counts every layer: input, ``depth - 2`` hidden, output.

    ``num_samples`` is the training-set size; the validation set has an eighth of it.
    """

    in_features: int = 64
    hidden: int = 256
    depth: int = 8
    out_features: int = 8
    num_samples: int = 4096

    def __post_init__(self) -> None:
        check_types(NAME, self)
        for name in ("in_features", "hidden", "out_features", "num_samples"):
            check_min(NAME, name, getattr(self, name), 1)
        check_min(NAME, "depth", self.depth, 2)


class Dense(nn.Module):
    """Linear, optionally followed by ReLU (He-initialised so deep stacks keep their scale)."""

    def __init__(self, in_features: int, out_features: int, *, relu: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.relu = relu
        nn.init.kaiming_normal_(self.linear.weight, nonlinearity="relu" if relu else "linear")
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        return torch.relu(y) if self.relu else y

    def extra_repr(self) -> str:
        return f"relu={self.relu}"


def _layer_names(depth: int) -> list[str]:
    return ["input", *(f"hidden{i}" for i in range(1, depth - 1)), "output"]


def _make_layer(config: MLPConfig, index: int) -> nn.Module:
    last = config.depth - 1
    in_features = config.in_features if index == 0 else config.hidden
    out_features = config.out_features if index == last else config.hidden
    return Dense(in_features, out_features, relu=index != last)


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


def _make_dataset(config: MLPConfig, split: Split) -> Dataset:
    """x ~ N(0, 1); y = tanh(x W1) W2 + noise with a fixed teacher (W1, W2) for all splits."""
    generator = torch.Generator().manual_seed(_DATA_SEED)
    w1 = torch.randn(config.in_features, _TEACHER_HIDDEN, generator=generator)
    w2 = torch.randn(_TEACHER_HIDDEN, config.out_features, generator=generator)
    w1 /= math.sqrt(config.in_features)
    w2 /= math.sqrt(_TEACHER_HIDDEN)
    num_val = max(1, config.num_samples // 8)
    if split == "val":  # an independent stream, so validation never repeats training samples
        generator.manual_seed(_DATA_SEED + 1)
    count = config.num_samples if split == "train" else num_val
    x = torch.randn(count, config.in_features, generator=generator)
    noise = torch.randn(count, config.out_features, generator=generator)
    y = torch.tanh(x @ w1) @ w2 + _NOISE_STD * noise
    return Dataset(x, y, name=f"{NAME}/{split}")


def mlp_spec(config: MLPConfig) -> ModelSpec:
    return ModelSpec(
        name=NAME,
        config=asdict(config),
        layers=tuple(
            LayerSpec(name=name, kind="Linear", make=partial(_make_layer, config, index))
            for index, name in enumerate(_layer_names(config.depth))
        ),
        loss_fn=_mse,
        dataset_fn=partial(_make_dataset, config),
    )
