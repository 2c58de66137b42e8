"""A model of your own for adaptipe: a small residual CNN on scikit-learn's digits.

`adaptipe train examples/user-model/sweep.toml` trains it as a 4-job sweep. The factory
returns the layers in pipeline order (each takes one tensor and returns one), the loss
and the datasets; adaptipe cuts the list into stages. GroupNorm instead of BatchNorm
because a job-array holds per-job parameters only, not buffers.
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch import nn


class ResidualBlock(nn.Module):
    """conv-norm-relu-conv-norm, plus the input: a layer type the zoo does not have."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.GroupNorm(4, channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.GroupNorm(4, channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class Digits(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """8x8 handwritten digits as (1x8x8 image in [0, 1], label): the first 1500 train,
    the other 297 validate."""

    def __init__(self, split: str) -> None:
        images, labels = load_digits(return_X_y=True)
        part = slice(0, 1500) if split == "train" else slice(1500, None)
        self.x = torch.tensor(images[part], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        self.y = torch.tensor(labels[part], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def build(channels: int = 16, blocks: int = 4) -> dict[str, object]:
    layers = nn.Sequential()
    layers.add_module("stem", nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU()))
    for b in range(blocks):
        layers.add_module(f"res{b}", ResidualBlock(channels))
    layers.add_module(
        "head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))
    )
    return {
        "layers": layers,
        "loss": nn.functional.cross_entropy,
        "dataset": Digits("train"),
        "val_dataset": Digits("val"),
    }
