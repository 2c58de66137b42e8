"""`MapDataset`: any map-style ``torch.utils.data.Dataset`` behind adaptipe's `Dataset`.

A user's dataset returns ``(input, target)`` per index (tensors, or numbers for the
target); adaptipe reads it in its own deterministic order, a permutation drawn from
``(seed, epoch)`` (`Dataset.batches`), so every stage that reads it sees the same
batches and a resumed run continues exactly. With ``workers > 0`` the batches come
through a ``DataLoader`` with that many worker processes, in the same order: the
loader is given the batches' indices, not a sampler of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from adaptipe.errors import PlanError
from adaptipe.models.data import Dataset, mix_seed

__all__ = ["MapDataset", "collate", "with_loader"]


def _as_tensor(value: Any, *, what: str, name: str) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, bool | int | float):
        return torch.as_tensor(value)
    raise PlanError(
        f"{name}: {what} is a {type(value).__name__}; an item must be (input, target) "
        "with tensors (or a number for the target)"
    )


def _split(item: Any, *, name: str, index: int) -> tuple[Tensor, Tensor]:
    if not isinstance(item, tuple | list) or len(item) != 2:
        got = f"a tuple of {len(item)}" if isinstance(item, tuple | list) else type(item).__name__
        raise PlanError(
            f"{name}: item {index} is {got}; adaptipe reads (input, target) pairs: return "
            "a tuple of two (the first stage takes the input, the loss takes the target)"
        )
    return (
        _as_tensor(item[0], what=f"item {index}'s input", name=name),
        _as_tensor(item[1], what=f"item {index}'s target", name=name),
    )


def collate(items: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Stack ``(input, target)`` pairs into one batch (the sample is the first dim)."""
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


class _Items:
    """Reads items by index and checks their shape; picklable for loader workers."""

    def __init__(self, data: Any, name: str) -> None:
        self.data, self.name = data, name

    def __call__(self, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
        return collate([_split(self.data[i], name=self.name, index=i) for i in indices])


class MapDataset(Dataset):
    """``data[i] -> (input, target)`` for i in ``[0, len(data))``, batched in adaptipe's
    order; ``workers`` loader processes read ahead when more than 0."""

    def __init__(self, data: Any, *, name: str = "dataset", workers: int = 0) -> None:
        if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
            raise PlanError(
                f"{name}: {type(data).__name__} is not a map-style dataset "
                "(it needs __getitem__ and __len__)"
            )
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise PlanError(f"{name}: workers must be an int >= 0 (got {workers!r})")
        self.data, self.name, self.workers = data, name, workers
        self._items = _Items(data, name)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"MapDataset({self.name!r}, n={len(self)}, {type(self.data).__name__})"

    def batch(self, indices: Sequence[int] | Tensor) -> tuple[Tensor, Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        if index.ndim != 1:
            raise ValueError(f"{self.name}: indices must be 1-D (got shape {tuple(index.shape)})")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(self)):
            raise IndexError(f"{self.name}: indices must lie in [0, {len(self)})")
        return self._items(index.tolist())

    def batches(
        self, batch_size: int, *, seed: int, epoch: int = 0, drop_last: bool = True
    ) -> Iterator[tuple[Tensor, Tensor]]:
        if self.workers == 0:
            yield from super().batches(batch_size, seed=seed, epoch=epoch, drop_last=drop_last)
            return
        count = self.num_batches(batch_size, drop_last=drop_last)
        generator = torch.Generator().manual_seed(mix_seed(seed, epoch))
        order = torch.randperm(len(self), generator=generator).tolist()
        plan = [order[n * batch_size : (n + 1) * batch_size] for n in range(count)]
        loader: DataLoader[Any] = DataLoader(
            plan,  # type: ignore[arg-type]  # the "dataset" is the list of batches
            batch_size=None,
            num_workers=self.workers,
            collate_fn=self._items,
        )
        yield from loader

    def sample_input(self, batch_size: int) -> Tensor:
        if len(self) == 0:
            raise ValueError(f"{self.name}: is empty, so it has no sample input")
        return self._items([i % len(self) for i in range(batch_size)])[0]


def with_loader(dataset: Dataset, workers: int) -> Dataset:
    """``dataset`` read through ``workers`` loader processes (``[data].loader_workers``):
    a user's `MapDataset` gets them; the zoo's in-memory datasets need none."""
    if workers and isinstance(dataset, MapDataset) and dataset.workers != workers:
        return MapDataset(dataset.data, name=dataset.name, workers=workers)
    return dataset
