"""Stages of one pipeline in one process, one thread each, exchanging through a mailbox.

`LocalTransport` has what `StageExecutor` needs of a transport, without
``torch.distributed``: tests and tools run several `Stage` objects side by side (for
instance to move a layer between two stages and compare against an unmoved run) with
the same executor code the stage processes run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from adaptipe.runtime.transport import TensorSpec, TransferKey

__all__ = ["LocalTransport", "Mailbox", "run_stages"]


class Mailbox:
    """Tensors in flight between the stages of one process, keyed by destination."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._box: dict[tuple[int, int, TransferKey], torch.Tensor] = {}

    def put(self, dst: int, epoch: int, key: TransferKey, tensor: torch.Tensor) -> None:
        with self._ready:
            self._box[(dst, epoch, key)] = tensor
            self._ready.notify_all()

    def take(self, dst: int, epoch: int, key: TransferKey, timeout_s: float) -> torch.Tensor:
        slot = (dst, epoch, key)
        with self._ready:
            if not self._ready.wait_for(lambda: slot in self._box, timeout=timeout_s):
                raise TimeoutError(f"stage {dst}: nothing arrived for {key} in {timeout_s:g} s")
            return self._box.pop(slot)


class LocalTransport:
    """One stage's end of a `Mailbox` (sends copy, so no storage is shared)."""

    def __init__(self, mailbox: Mailbox, rank: int, *, timeout_s: float = 60.0) -> None:
        self.mailbox = mailbox
        self.rank = rank
        self.timeout_s = timeout_s
        self._epoch = 0
        self.wait_s = 0.0

    def start_iteration(
        self,
        iteration: int,
        receives: list[tuple[TransferKey, int, TensorSpec]],
        *,
        hold: int | None = None,
    ) -> None:
        self._epoch = iteration  # nothing is posted ahead: ``hold`` has nothing to hold

    def hold_posts(self, limit: int | None) -> None:
        pass  # nothing is posted ahead: a mailbox holds what was sent

    def drop_unposted(self, keep: Callable[[TransferKey], bool]) -> None:
        pass

    def recv(self, key: TransferKey) -> torch.Tensor:
        t0 = time.perf_counter()
        tensor = self.mailbox.take(self.rank, self._epoch, key, self.timeout_s)
        self.wait_s += time.perf_counter() - t0
        return tensor

    def send(self, tensor: torch.Tensor, dst: int, key: TransferKey) -> None:
        self.mailbox.put(dst, self._epoch, key, tensor.detach().clone())

    def flush(self) -> None:
        pass

    def take_times(self) -> tuple[float, float]:
        out = (self.wait_s, 0.0)
        self.wait_s = 0.0
        return out


def run_stages(steps: Sequence[Callable[[], object]], *, timeout_s: float = 120.0) -> list[object]:
    """Run one callable per stage, each in its own thread; return their results in order.

    The first exception raised by any stage is raised here (after every thread ended or
    ``timeout_s`` passed).
    """
    results: list[object] = [None] * len(steps)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = steps[i]()
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(steps))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"stages still running after {timeout_s:g} s")
    return results
