""" "cnn": a small VGG-style CNN on scikit-learn's bundled 8x8 digits (no download)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cache, partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaptipe.models.data import Dataset
from adaptipe.models.spec import LayerSpec, ModelSpec, Split, check_min, check_types

__all__ = ["CNNConfig", "cnn_spec"]

NAME = "cnn"
NUM_CLASSES = 10
IMAGE_SIZE = 8
TRAIN_FRACTION = 0.8
_SPLIT_SEED = 0  # the fixed shuffle before the train/val split


@dataclass(frozen=True, kw_only=True)
class CNNConfig:
    """``width`` multiplies every channel count (32, 64) and the classifier's 128 units."""

    width: int = 1

    def __post_init__(self) -> None:
        check_types(NAME, self)
        check_min(NAME, "width", self.width, 1)


def _he_init(layer: nn.Conv2d | nn.Linear) -> None:
    """He (Kaiming) normal weights for ReLU layers and zero bias: trains faster than the default."""
    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class Conv(nn.Module):
    """3x3 same-padding convolution + ReLU, optionally followed by 2x2 max-pooling."""

    def __init__(self, in_channels: int, out_channels: int, *, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.pool = pool
        _he_init(self.conv)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.conv(x))
        return F.max_pool2d(y, 2) if self.pool else y

    def extra_repr(self) -> str:
        return f"pool={self.pool}"


class Classifier(nn.Module):
    """Flatten (B, C, 2, 2) and map to hidden units with ReLU."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        _he_init(self.linear)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.linear(x.flatten(1)))


_LAYERS = (  # name, kind
    ("conv1", "Conv"),
    ("conv2", "Conv"),
    ("conv3", "Conv"),
    ("conv4", "Conv"),
    ("classifier", "Classifier"),
    ("output", "Linear"),
)


def _make_layer(config: CNNConfig, index: int) -> nn.Module:
    narrow, wide, hidden = 32 * config.width, 64 * config.width, 128 * config.width
    pooled_size = IMAGE_SIZE // 4  # two 2x2 poolings: 8 -> 4 -> 2
    match index:
        case 0:
            return Conv(1, narrow, pool=False)
        case 1:
            return Conv(narrow, narrow, pool=True)
        case 2:
            return Conv(narrow, wide, pool=False)
        case 3:
            return Conv(wide, wide, pool=True)
        case 4:
            return Classifier(wide * pooled_size * pooled_size, hidden)
        case _:
            return nn.Linear(hidden, NUM_CLASSES)


@cache
def _digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train_x, train_y, val_x, val_y), standardised with the training split's statistics."""
    from sklearn.datasets import load_digits  # imported late: sklearn is slow to import

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.as_tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    images, labels = images[order], labels[order]
    cut = int(len(labels) * TRAIN_FRACTION)
    mean, std = images[:cut].mean(), images[:cut].std()
    images = (images - mean) / std
    return images[:cut], labels[:cut], images[cut:], labels[cut:]


def _make_dataset(split: Split) -> Dataset:
    train_x, train_y, val_x, val_y = _digits()
    if split == "train":
        return Dataset(train_x, train_y, name=f"{NAME}/train")
    return Dataset(val_x, val_y, name=f"{NAME}/val")


def _cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def cnn_spec(config: CNNConfig) -> ModelSpec:
    return ModelSpec(
        name=NAME,
        config=asdict(config),
        layers=tuple(
            LayerSpec(name=name, kind=kind, make=partial(_make_layer, config, index))
            for index, (name, kind) in enumerate(_LAYERS)
        ),
        loss_fn=_cross_entropy,
        dataset_fn=_make_dataset,
    )
