"""`Dataset`: a fixed, in-memory set of (input, target) samples with deterministic batching.

Nothing here downloads or touches the global RNG: every shuffle uses a local
`torch.Generator` seeded from `mix_seed`, so two processes that agree on (seed, epoch)
see the same batches in the same order, which pipelined training relies on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["Dataset", "mix_seed"]

_MASK64 = (1 << 64) - 1
_SAMPLE_SALT = 0x5A3B1E  # keeps `sample_batch(seed=s)` apart from `batches(seed=s)`


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def mix_seed(*parts: int) -> int:
    """Hash integers (seed, index, epoch...) into one well-spread seed in [0, 2**63).

    Plain sums such as ``seed + index`` collide (seed 1 layer 0 == seed 0 layer 1);
    chaining splitmix64 over the parts does not.
    """
    state = 0
    for part in parts:
        state = _splitmix64(state ^ (int(part) & _MASK64))
    return state >> 1


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


class Dataset:
    """Samples ``inputs[i] -> targets[i]``; both tensors live on the CPU, first dim = sample.

    Treat the tensors as read-only: `batch` returns copies, but the attributes are shared.
    """

    def __init__(self, inputs: Tensor, targets: Tensor, *, name: str = "dataset") -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(
                f"{name}: inputs and targets differ in length "
                f"({inputs.shape[0]} vs {targets.shape[0]})"
            )
        self.inputs = inputs
        self.targets = targets
        self.name = name

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, n={len(self)}, "
            f"input={tuple(self.inputs.shape[1:])}:{self.inputs.dtype}, "
            f"target={tuple(self.targets.shape[1:])}:{self.targets.dtype})"
        )

    def batch(self, indices: Sequence[int] | Tensor) -> tuple[Tensor, Tensor]:
        """The samples at `indices` (each in ``[0, len)``), stacked in that order."""
        index = torch.as_tensor(indices, dtype=torch.long, device="cpu")
        if index.ndim != 1:
            raise ValueError(f"{self.name}: indices must be 1-D (got shape {tuple(index.shape)})")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(self)):
            raise IndexError(
                f"{self.name}: indices must lie in [0, {len(self)}) "
                f"(got min {int(index.min())}, max {int(index.max())})"
            )
        return self.inputs.index_select(0, index), self.targets.index_select(0, index)

    def num_batches(self, batch_size: int, *, drop_last: bool = True) -> int:
        """How many batches `batches` yields for these arguments."""
        _check_batch_size(self.name, batch_size)
        full, rest = divmod(len(self), batch_size)
        return full if drop_last or rest == 0 else full + 1

    def batches(
        self, batch_size: int, *, seed: int, epoch: int = 0, drop_last: bool = True
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """One epoch of shuffled batches; the order depends only on (seed, epoch)."""
        count = self.num_batches(batch_size, drop_last=drop_last)
        order = torch.randperm(len(self), generator=_generator(mix_seed(seed, epoch)))
        for number in range(count):
            yield self.batch(order[number * batch_size : (number + 1) * batch_size])

    def sample_input(self, batch_size: int) -> Tensor:
        """The first `batch_size` inputs (wrapping around if the dataset is smaller).

        Meant for profiling and shape inference, where only shape and dtype matter.
        """
        _check_batch_size(self.name, batch_size)
        if len(self) == 0:
            raise ValueError(f"{self.name}: is empty, so it has no sample input")
        return self.inputs.index_select(0, torch.arange(batch_size) % len(self))

    def sample_batch(self, batch_size: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """`batch_size` distinct samples drawn at random from `seed`."""
        _check_batch_size(self.name, batch_size)
        if batch_size > len(self):
            raise ValueError(
                f"{self.name}: batch_size must be <= {len(self)} samples (got {batch_size})"
            )
        order = torch.randperm(len(self), generator=_generator(mix_seed(_SAMPLE_SALT, seed)))
        return self.batch(order[:batch_size])


def _check_batch_size(name: str, batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{name}: batch_size must be an int >= 1 (got {batch_size!r})")
