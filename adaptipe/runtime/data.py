"""The training data stream and the loss scaling shared by the pipeline runtime and the
single-process reference, so both see identical micro-batches and identical gradients.

"Numerics are sacred": a pipelined run is checked against `train_reference`, which is
only meaningful if both read mini-batch ``i`` from the same `BatchStream`, cut it with
the same `split_microbatches` and scale each micro-batch loss by the same `loss_scale`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice

import torch
from torch import Tensor

from adaptipe.models.data import Dataset
from adaptipe.schedule.types import Schedule

__all__ = ["BatchStream", "RoundFeed", "loss_scale", "split_microbatches"]


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


Pair = tuple[Tensor | None, Tensor | None]


class RoundFeed(Sequence[Pair]):
    """One job's micro-batches for ``rounds`` consecutive iterations, read on first use.

    Item ``r * per_round + i`` is micro-batch ``i`` of the job's mini-batch of round
    ``r``. A round's mini-batch is read from ``stream`` (and moved to ``device``) the
    first time one of its micro-batches is asked for, so a window of many iterations
    does not hold all its data at once. A stage asks for a job's rounds in order (its
    next forward follows its own backward and update), so reading round ``r`` drops the
    rounds before ``r - 1``: at most two rounds are held. Asking for a dropped round is
    a bug and raises. `finish` reads the rounds nobody asked for, so the stream ends
    ``rounds`` mini-batches further on whatever ran.

    ``keep_input`` / ``keep_target``: whether this stage needs the inputs (it holds the
    first layers) and the targets (the last); the other side comes back as ``None``.
    """

    def __init__(
        self,
        stream: Iterator[tuple[Tensor, Tensor]],
        *,
        rounds: int,
        per_round: int,
        device: torch.device | str = "cpu",
        keep_input: bool = True,
        keep_target: bool = True,
    ) -> None:
        self._stream = stream
        self._rounds = _check_int("rounds", rounds, 1)
        self._per_round = _check_int("per_round", per_round, 1)
        self._device = torch.device(device)
        self._keep = (keep_input, keep_target)
        self._held: dict[int, list[Pair]] = {}
        self._read = 0  # rounds read from the stream so far

    def __len__(self) -> int:
        return self._rounds * self._per_round

    def __getitem__(self, index: int) -> Pair:  # type: ignore[override]
        if not isinstance(index, int) or not 0 <= index < len(self):
            raise IndexError(f"micro-batch {index!r} outside 0..{len(self) - 1}")
        r, i = divmod(index, self._per_round)
        if r not in self._held:
            if r < self._read:
                raise IndexError(
                    f"round {r} was asked for after round {self._read - 1}: rounds are "
                    "read in order and dropped once two later ones are held"
                )
            while self._read <= r:
                self._load()
            for old in [k for k in self._held if k < r - 1]:
                del self._held[old]
        return self._held[r][i]

    def _load(self) -> None:
        x, y = next(self._stream)
        keep_input, keep_target = self._keep
        self._held[self._read] = [
            (self._move(xi) if keep_input else None, self._move(yi) if keep_target else None)
            for xi, yi in split_microbatches(x, y, self._per_round)
        ]
        self._read += 1

    def _move(self, t: Tensor) -> Tensor:
        if self._device.type != "cuda" or t.device.type != "cpu":
            return t.to(self._device)
        # From pageable memory the copy would wait for the GPU to finish its queue; from
        # pinned memory it is queued behind it (the allocator keeps the buffer until done).
        return t.pin_memory().to(self._device, non_blocking=True)

    @property
    def held_rounds(self) -> int:
        """Rounds whose tensors are held now."""
        return len(self._held)

    def finish(self, upto: int | None = None) -> None:
        """Read the rounds not asked for, up to round ``upto`` (None: all of them; fewer
        where a window was cut short), and drop everything held."""
        end = self._rounds if upto is None else upto
        if not 0 <= end <= self._rounds or self._read > end:
            raise ValueError(f"finish(upto={upto}): {self._read} of {self._rounds} rounds read")
        while self._read < end:
            next(self._stream)
            self._read += 1
        self._held.clear()


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
