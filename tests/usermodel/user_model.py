"""A user's model outside the package (tests/test_user_model.py): a layer type the zoo
does not have (a residual block), a plain map-style Dataset of tuples."""

from __future__ import annotations

import torch
from torch import nn


class Residual(nn.Module):
    """x + MLP(x): a layer the zoo does not have."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class Points(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Items are (features, class) tuples; the class is a plain int."""

    def __init__(self, n: int, width: int, *, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, width, generator=g)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def build(width: int = 8, blocks: int = 2) -> dict[str, object]:
    layers = nn.Sequential()
    layers.add_module("embed", nn.Linear(width, width))
    for b in range(blocks):
        layers.add_module(f"res{b}", Residual(width))
    layers.add_module("head", nn.Linear(width, 2))
    return {
        "layers": layers,
        "loss": nn.functional.cross_entropy,
        "dataset": Points(256, width, seed=1),
        "val_dataset": Points(64, width, seed=2),
    }


def build_factories(width: int = 8) -> tuple[object, object, object]:
    layers = [
        ("embed", lambda: nn.Linear(width, width)),
        ("res0", lambda: Residual(width)),
        ("head", lambda: nn.Linear(width, 2)),
    ]
    return layers, nn.functional.cross_entropy, Points(128, width, seed=1)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


def build_unresettable() -> tuple[object, object, object]:
    return nn.Sequential(nn.Linear(8, 8), Scale()), nn.functional.mse_loss, Points(16, 8, seed=0)


def build_shared() -> tuple[object, object, object]:
    first = nn.Linear(8, 8)
    second = nn.Linear(8, 8)
    second.weight = first.weight
    return nn.Sequential(first, second), nn.functional.mse_loss, Points(16, 8, seed=0)


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def build_tuple_output() -> tuple[object, object, object]:
    return nn.Sequential(nn.Linear(8, 8), Pair()), nn.functional.mse_loss, Points(16, 8, seed=0)


def build_wrong_type() -> int:
    return 3


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * mask


def build_two_inputs() -> tuple[object, object, object]:
    return (
        nn.Sequential(nn.Linear(8, 8), TwoInputs()),
        nn.functional.mse_loss,
        Points(16, 8, seed=0),
    )


class Words(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[str, int]:
        return "word", i


def build_words() -> tuple[object, object, object]:
    return nn.Sequential(nn.Linear(8, 8)), nn.functional.mse_loss, Words()
