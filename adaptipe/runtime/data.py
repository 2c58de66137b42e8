"""The training data stream and the loss scaling shared by the pipeline runtime and the
single-process reference, so both see identical micro-batches and identical gradients.

"Numerics are sacred": a pipelined run is checked against `train_reference`, which is
only meaningful if both read mini-batch ``i`` from the same `BatchStream`, cut it with
the same `split_microbatches` and scale each micro-batch loss by the same `loss_scale`.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import torch
from torch import Tensor

from adaptipe.models.data import Dataset
from adaptipe.schedule.types import Schedule

__all__ = ["BatchStream", "loss_scale", "split_microbatches"]


def _check_int(what: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum} (got {value!r})")
    return value


class BatchStream:
    """An endless, deterministic stream of shuffled mini-batches.

    Iteration ``i`` is batch ``i % batches_per_epoch`` of epoch ``i // batches_per_epoch``
    in ``dataset.batches(batch_size, seed=seed, epoch=epoch, drop_last=True)``; each epoch
    is a fresh shuffle. The batch depends only on ``(dataset, batch_size, seed, i)``, so a
    stream resumed with ``start_iteration=i`` yields exactly the tail of one started at 0:
    earlier epochs are never read and the current one is only advanced to the position.

    Args:
        dataset: the samples (`ModelSpec.dataset`).
        batch_size: samples per mini-batch; the dataset must hold at least one batch.
        seed: the data-order seed (independent of the weight-initialisation seed).
        start_iteration: index of the first mini-batch to yield.
    """

    def __init__(
        self, dataset: Dataset, *, batch_size: int, seed: int, start_iteration: int = 0
    ) -> None:
        _check_int(f"{dataset.name}: batch_size", batch_size, 1)
        _check_int(f"{dataset.name}: start_iteration", start_iteration, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{dataset.name}: seed must be an int (got {seed!r})")
        if len(dataset) < batch_size:
            raise ValueError(
                f"{dataset.name}: has {len(dataset)} samples, fewer than one batch of "
                f"batch_size={batch_size}"
            )
        self._dataset = dataset
        self._batch_size = batch_size
        self._seed = seed
        self._per_epoch = dataset.num_batches(batch_size, drop_last=True)
        self._iteration = start_iteration
        self._batches: Iterator[tuple[Tensor, Tensor]] | None = None  # of self.epoch

    @property
    def iteration(self) -> int:
        """Index of the mini-batch the next `next` returns (= mini-batches consumed so far
        when the stream started at 0)."""
        return self._iteration

    @property
    def epoch(self) -> int:
        """Epoch of the mini-batch the next `next` returns."""
        return self._iteration // self._per_epoch

    @property
    def batches_per_epoch(self) -> int:
        return self._per_epoch

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        epoch, position = divmod(self._iteration, self._per_epoch)
        if position == 0 or self._batches is None:
            self._batches = self._dataset.batches(
                self._batch_size, seed=self._seed, epoch=epoch, drop_last=True
            )
            if position:  # resuming mid-epoch: skip to the position, once
                next(islice(self._batches, position, position), None)
        self._iteration += 1
        return next(self._batches)

    def __repr__(self) -> str:
        return (
            f"BatchStream({self._dataset.name!r}, batch_size={self._batch_size}, "
            f"seed={self._seed}, iteration={self._iteration})"
        )


def split_microbatches(x: Tensor, y: Tensor, microbatches: int) -> list[tuple[Tensor, Tensor]]:
    """Cut a mini-batch into ``microbatches`` equal, contiguous, in-order chunks along dim 0.

    Equal sizes make the mean of the micro-batch mean losses equal the mini-batch mean,
    which is what lets a synchronous pipeline match full-batch training.
    """
    _check_int("microbatches", microbatches, 1)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"inputs and targets differ in batch size ({x.shape[0]} vs {y.shape[0]})")
    size, rest = divmod(int(x.shape[0]), microbatches)
    if rest or size == 0:
        raise ValueError(
            f"a mini-batch of {x.shape[0]} samples cannot be split into {microbatches} "
            "equal non-empty micro-batches; batch_size must be a multiple of microbatches"
        )
    return list(zip(torch.split(x, size), torch.split(y, size), strict=True))


def loss_scale(schedule_or_update_every: Schedule | int) -> float:
    """Factor ``1 / update_every`` applied to each micro-batch's mean loss before backward.

    An optimizer step then applies the mean gradient over the samples of the
    ``update_every`` micro-batches it coalesces: ``1/M`` for flushing schedules (GPipe,
    1F1B, interleaved), ``1`` for PipeDream (one step per micro-batch, §2.3) and ``1/m``
    for PipeDream-2BW (gradients of ``m`` micro-batches coalesced, §3.2.1).
    """
    every = (
        schedule_or_update_every.update_every
        if isinstance(schedule_or_update_every, Schedule)
        else schedule_or_update_every
    )
    return 1.0 / _check_int("update_every", every, 1)
