"""Where the memory manager's copies run: a background thread on CPU, two CUDA streams
(one for offloads, one for loads, with pinned host buffers and events) on a GPU.

Both movers take and give ``{key: tensor}`` maps (`StateKey`): a job's parameters,
gradients and optimizer state on one stage (`adaptipe.runtime.memory`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["CpuMover", "CudaMover", "Pending", "StateKey"]

StateKey = tuple[str, int, str, str]  # (kind, layer, parameter name, optimizer state key)
_Key = StateKey


class Pending(Protocol):
    def wait(self) -> dict[_Key, Tensor]:
        """The loaded tensors, ready for the compute that follows."""
        ...


class ThreadLoad:
    def __init__(self, future: Future[dict[_Key, Tensor]]) -> None:
        self.future = future

    def wait(self) -> dict[_Key, Tensor]:
        return self.future.result()


class CpuMover:
    """Copies on one background thread; "device" and host are both CPU memory.

    A copy that fails raises where its result is next needed: in the load of the state
    it was writing, or at the next copy issued or `synchronize` (never silently: the
    host buffers of a failed offload hold no state).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adaptipe-memory")
        self._pending: list[Future[Any]] = []

    def host_buffer(self, t: Tensor) -> Tensor:
        return torch.empty_like(t, device="cpu")

    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if f not in done]
        for f in done:
            f.result()  # an earlier copy failed: say so now (once)
        future = self._pool.submit(fn, *args)
        self._pending.append(future)
        return future

    def offload(self, src: dict[_Key, Tensor], dst: dict[_Key, Tensor]) -> Future[Any]:
        return self._submit(copy_all, [(dst[k], t) for k, t in src.items()])

    def load(self, src: dict[_Key, Tensor], after: Any = None) -> Pending:
        device = self.device

        def copy() -> dict[_Key, Tensor]:
            if after is not None:  # the offload that wrote ``src`` (done: tasks run in order)
                after.result()
            return {k: torch.empty_like(t, device=device).copy_(t) for k, t in src.items()}

        return ThreadLoad(self._submit(copy))

    def synchronize(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def copy_all(pairs: list[tuple[Tensor, Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


class StreamLoad:
    """A host-to-device copy on the copy stream; ``event`` marks its end."""

    def __init__(
        self, tensors: dict[_Key, Tensor], event: torch.cuda.Event, device: torch.device
    ) -> None:
        self.tensors = tensors
        self.event = event
        self.device = device

    def wait(self) -> dict[_Key, Tensor]:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.event)
        for t in self.tensors.values():
            t.record_stream(compute)  # allocated on the copy stream, used on this one
        return self.tensors


class CudaMover:
    """Copies between pinned host buffers and the device on two streams of their own.

    Offloads wait for the compute queued before them (the job's step); loads wait only
    for the offload of the same state, if one is still copying. On one stream, a
    prefetch queued behind an offload would wait for the compute stream to reach that
    offload, and the blocks that need it would stall on the GPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.offloads = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.loads = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def host_buffer(self, t: Tensor) -> Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)

    def offload(self, src: dict[_Key, Tensor], dst: dict[_Key, Tensor]) -> torch.cuda.Event:
        self.offloads.wait_stream(torch.cuda.current_stream(self.device))  # the step is done
        with torch.cuda.stream(self.offloads):
            for k, t in src.items():
                dst[k].copy_(t, non_blocking=True)
                if t.is_cuda:
                    t.record_stream(self.offloads)  # keep the device memory until copied
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.offloads)
        return done

    def load(self, src: dict[_Key, Tensor], after: Any = None) -> Pending:
        if after is not None:  # the host copy of this state is still being written
            self.loads.wait_event(after)
        with torch.cuda.stream(self.loads):
            out = {k: torch.empty_like(t, device=self.device) for k, t in src.items()}
            for k, t in src.items():
                out[k].copy_(t, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.loads)
        return StreamLoad(out, event, self.device)

    def synchronize(self) -> None:
        self.offloads.synchronize()
        self.loads.synchronize()

    def close(self) -> None:
        self.synchronize()
