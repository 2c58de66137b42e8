"""Point-to-point transport between stage workers over ``torch.distributed``.

Every transfer is keyed by (iteration, job, micro-batch, boundary, direction) and
mapped to a gloo/NCCL tag, so any schedule the validator accepts can post its sends
and receives in its own order. Sends are non-blocking; a worker keeps the tensor alive
until the transfer completes. Receives are *pre-posted*: when an iteration starts, the
worker posts the first ``lookahead`` receives of its instruction list into buffers of
the negotiated shape, so data lands while the worker computes, and a `RecvActivation`
usually finds its tensor already there.

Shapes are negotiated along the pipeline at start-up, and again whenever the partition
changes (`adaptipe.runtime.handshake`): the worker holding virtual stage ``g`` receives
the input shape of ``g`` from its predecessor, infers its output shape with a forward
pass of its real layers, and sends that on. Nothing about shapes is hard-coded, and no
per-message header costs a round trip.

Tensors travel on the *wire device*: the GPU itself over NCCL, host memory over gloo
(whose transport reads host pointers only). A CUDA stage on gloo therefore copies each
activation or gradient to host memory before sending it and receives into pinned host
buffers that it copies to the GPU; that is what lets several stages share one GPU, which
NCCL refuses.

With ``measure_links`` (telemetry on), every send is also timed per peer link, from the
moment :meth:`P2PTransport.send` is called (so an injected throttle's delay counts) to
its completion, by a :class:`~adaptipe.monitor.linktimer.LinkTimer`; see
:meth:`P2PTransport.link_samples`. Without it nothing extra runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from adaptipe.monitor.linktimer import LinkTimer
from adaptipe.monitor.schema import LinkSample

__all__ = [
    "ACTIVATION",
    "GRADIENT",
    "PROBE_TAGS",
    "P2PTransport",
    "TensorSpec",
    "TransferKey",
    "Transport",
    "recv_spec",
    "send_spec",
    "wire_device",
]

ACTIVATION = 0
GRADIENT = 1
# Kept out of the transfers' tags: the live link probe's (`adaptipe.runtime.link_probe`)
PROBE_TAGS = (2**31 - 4, 2**31 - 3, 2**31 - 2, 2**31 - 1)  # size, ready, data, ack

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
_HEADER = 10  # ndim, dtype code, up to 8 dimensions
_POLL_S = 0.0005  # longest sleep between completion polls of a timed NCCL send


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of what crosses one pipeline boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class TransferKey:
    """What a transfer carries: ``boundary`` b sits between virtual stages b-1 and b."""

    job: int
    microbatch: int
    boundary: int
    direction: int  # ACTIVATION (forward, b-1 -> b) or GRADIENT (backward, b -> b-1)


def wire_device(device: torch.device, backend: str) -> torch.device:
    """Where tensors travel between stages: the GPU over NCCL, else host memory."""
    return device if backend == "nccl" else torch.device("cpu")


def send_spec(spec: TensorSpec, dst: int, *, wire: torch.device | None = None) -> None:
    header = torch.full((_HEADER,), -1, dtype=torch.int64)
    if len(spec.shape) > _HEADER - 2:
        raise ValueError(
            f"tensors of rank {len(spec.shape)} cannot cross a boundary (at most {_HEADER - 2})"
        )
    header[0] = len(spec.shape)
    header[1] = _DTYPES.index(spec.dtype)
    header[2 : 2 + len(spec.shape)] = torch.tensor(spec.shape, dtype=torch.int64)
    dist.send(header.to(wire or "cpu"), dst)


def recv_spec(src: int, *, wire: torch.device | None = None) -> TensorSpec:
    header = torch.empty((_HEADER,), dtype=torch.int64, device=wire or "cpu")
    dist.recv(header, src)
    header = header.cpu()
    ndim, code = int(header[0]), int(header[1])
    return TensorSpec(tuple(int(v) for v in header[2 : 2 + ndim]), _DTYPES[code])


@dataclass(slots=True)
class _PendingRecv:
    key: TransferKey
    src: int
    buffer: torch.Tensor
    work: Any


class Transport(Protocol):
    """What an executor needs of a transport (`P2PTransport` between processes,
    `adaptipe.runtime.local_transport.LocalTransport` between threads of one)."""

    def start_iteration(
        self,
        iteration: int,
        receives: list[tuple[TransferKey, int, TensorSpec]],
        *,
        hold: int | None = None,
    ) -> None: ...

    def hold_posts(self, limit: int | None) -> None: ...

    def drop_unposted(self, keep: Callable[[TransferKey], bool]) -> None: ...

    def recv(self, key: TransferKey) -> torch.Tensor: ...

    def send(self, tensor: torch.Tensor, dst: int, key: TransferKey) -> None: ...

    def flush(self) -> None: ...

    def take_times(self) -> tuple[float, float]: ...


class P2PTransport:
    """Tagged, non-blocking sends and pre-posted receives for one worker.

    Args:
        rank: this worker's rank (= stage index).
        device: where this stage computes; received tensors are handed out there.
        wire: where tensors travel (`wire_device`); defaults to ``device``. A CUDA
            ``device`` with a host ``wire`` copies through host memory (module doc).
        num_boundaries: virtual stages in the pipeline (boundaries are 1..G-1).
        num_microbatches: micro-batches per job per iteration.
        num_jobs: jobs in the array.
        lookahead: receives kept posted ahead of the instruction being executed.
        measure_links: time every send per peer link (see :meth:`link_samples`).
            On gloo a watcher thread per peer waits for the sends and :meth:`flush`
            waits for the watchers. On CUDA/NCCL the watchers poll, a send starts no
            earlier than the device reaches it (a CUDA event recorded at ``send()``),
            and one still in flight when an iteration's samples are taken counts in
            the next ones.
    """

    def __init__(
        self,
        *,
        rank: int,
        device: torch.device,
        num_boundaries: int,
        num_microbatches: int,
        num_jobs: int = 1,
        lookahead: int = 4,
        measure_links: bool = False,
        wire: torch.device | None = None,
    ) -> None:
        self.rank = rank
        self.device = device
        self.wire = device if wire is None else wire
        self._staged = self.wire.type != device.type
        self._g = num_boundaries
        self._m = num_microbatches
        self._j = num_jobs
        self._lookahead = max(1, lookahead)
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()
        self._inflight: deque[Any] = deque()  # every send's work, until it completes
        self._plan: list[tuple[TransferKey, int, TensorSpec]] = []
        self._next = 0
        self._limit = 0  # receives of the plan that may be posted (`hold_posts`)
        self._posted: dict[TransferKey, _PendingRecv] = {}
        self._epoch = 0
        self.wait_s = 0.0
        self.comm_s = 0.0
        self.bytes_sent = 0
        # Injected link throttle: (extra latency s, bandwidth B/s) applied to each send.
        self.throttle: tuple[float, float] | None = None
        self.bytes_received = 0
        self._links: LinkTimer | None = None
        # gloo's wait() blocks until the send is done; NCCL's only orders CUDA streams.
        self._watch_waits = self.wire.type != "cuda"
        if measure_links:
            self._links = LinkTimer(rank, poll_s=None if self._watch_waits else _POLL_S)
        if (4 * num_jobs * num_microbatches * max(num_boundaries, 1) * 2) >= min(PROBE_TAGS):
            raise ValueError("too many transfers per iteration to tag uniquely")

    def _tag(self, key: TransferKey) -> int:
        # The epoch bits keep consecutive iterations apart even if a fast worker runs ahead.
        slot = ((key.job * self._m + key.microbatch) * self._g + key.boundary) * 2 + key.direction
        return (self._epoch % 4) * (self._j * self._m * self._g * 2) + slot

    def start_iteration(
        self,
        epoch: int,
        receives: list[tuple[TransferKey, int, TensorSpec]],
        *,
        hold: int | None = None,
    ) -> None:
        """Begin an iteration whose receives, in execution order, are ``receives``; with
        ``hold``, post only the first ``hold`` of them until `hold_posts` says more (a
        job-array window's first round: a later round's receive posted now would stay
        posted if the window were cut before that round)."""
        if self._posted:
            raise RuntimeError(
                f"stage {self.rank}: {len(self._posted)} receives still posted from the last iteration"
            )
        self._epoch = epoch
        self._plan = receives
        self._next = 0
        self._limit = len(receives) if hold is None else min(hold, len(receives))
        self._post_ahead()

    def hold_posts(self, limit: int | None) -> None:
        """Post no more than the first ``limit`` receives of the iteration's plan (None:
        all) until told otherwise: the receives of a window's next round wait until the
        stages know that the round runs (`adaptipe.runtime.windowcut`)."""
        self._limit = len(self._plan) if limit is None else min(limit, len(self._plan))
        self._post_ahead()

    def drop_unposted(self, keep: Callable[[TransferKey], bool]) -> None:
        """Forget the planned receives not posted yet that ``keep`` rejects (a window cut
        short: nobody sends them), and post the rest as usual."""
        self._plan = self._plan[: self._next] + [r for r in self._plan[self._next :] if keep(r[0])]
        self._limit = len(self._plan)
        self._post_ahead()

    def _post_ahead(self) -> None:
        limit = min(self._limit, len(self._plan))
        while self._next < limit and len(self._posted) < self._lookahead:
            key, src, spec = self._plan[self._next]
            self._next += 1
            buf = torch.empty(
                spec.shape, dtype=spec.dtype, device=self.wire, pin_memory=self._staged
            )
            work = dist.irecv(buf, src, tag=self._tag(key))
            self._posted[key] = _PendingRecv(key, src, buf, work)

    def recv(self, key: TransferKey) -> torch.Tensor:
        """Wait for a pre-posted receive and return its tensor."""
        pending = self._posted.pop(key, None)
        if pending is None:
            raise RuntimeError(
                f"stage {self.rank}: receive {key} was not planned for this iteration"
            )
        t0 = time.perf_counter()
        pending.work.wait()
        self.wait_s += time.perf_counter() - t0
        self.bytes_received += pending.buffer.numel() * pending.buffer.element_size()
        self._post_ahead()
        if self._staged:  # pinned host -> GPU, queued on the compute stream
            return pending.buffer.to(self.device, non_blocking=True)
        return pending.buffer

    def send(self, tensor: torch.Tensor, dst: int, key: TransferKey) -> None:
        """Post a non-blocking send; the tensor is kept alive until it completes."""
        if self._staged:
            # Waits for the GPU to compute the tensor, then copies it: before t0, so the
            # link's busy time and comm_s do not count the producing block's compute.
            tensor = tensor.detach().to(self.wire)
        t0 = time.perf_counter()
        ready = None  # on CUDA: when the device has computed what was queued before
        if self._links is not None and not self._watch_waits:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
        self.throttled(tensor.numel() * tensor.element_size())
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        work = dist.isend(tensor, dst, tag=self._tag(key))
        if work is not None:
            self._inflight.append(work)
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_sent += nbytes
        if self._links is not None and work is not None:  # None only off the group
            self._links.submit(dst, work, t0, nbytes, tensor, ready)  # keeps the tensor alive
        if self._links is None or not self._watch_waits:  # on gloo the watcher alone waits
            self._sends.append((work, tensor))
            while self._sends and self._sends[0][0].is_completed():
                self._sends.popleft()
        self.comm_s += time.perf_counter() - t0

    def throttled(self, nbytes: int) -> None:
        """Hold a send of ``nbytes`` as the injected throttle says (none: at once)."""
        if self.throttle is not None:
            latency, bandwidth = self.throttle
            time.sleep(latency + nbytes / bandwidth)

    def sending(self) -> bool:
        """Whether an activation or gradient send of this stage is still in flight (what
        a low-priority state stream yields to, `adaptipe.runtime.statestream`)."""
        while self._inflight and self._inflight[0].is_completed():
            self._inflight.popleft()
        return bool(self._inflight)

    def flush(self) -> None:
        """Wait for every outstanding send (end of an iteration); raise a failed one's error."""
        t0 = time.perf_counter()
        if self._links is not None and self._watch_waits:
            self._links.drain()
        while self._sends:
            work, _ = self._sends.popleft()
            work.wait()
        self._inflight.clear()  # every one is done now
        self.comm_s += time.perf_counter() - t0

    def take_times(self) -> tuple[float, float]:
        """(wait_s, comm_s) since the last call."""
        out = (self.wait_s, self.comm_s)
        self.wait_s = self.comm_s = 0.0
        return out

    def link_samples(self) -> list[LinkSample]:
        """One record per peer sent to since the last call (none without ``measure_links``).

        Each holds the bytes sent, the link's busy seconds (the union of the sends'
        post-to-completion intervals) and the smoothed bandwidth.
        """
        return self._links.samples() if self._links is not None else []

    def bandwidth_Bps(self, dst: int) -> float:
        """The smoothed bandwidth measured to ``dst`` (0 when not measured)."""
        return self._links.bandwidth_Bps(dst) if self._links is not None else 0.0

    @property
    def measures_links(self) -> bool:
        """Whether every send is timed per link (``measure_links``)."""
        return self._links is not None

    def probe_bytes(self, dst: int) -> int:
        """How large a probe of the link to ``dst`` to send now (0: none; always 0
        without ``measure_links``; `adaptipe.runtime.link_probe`)."""
        return self._links.probe_bytes(dst) if self._links is not None else 0

    def probed(self, dst: int, nbytes: int, seconds: float) -> tuple[float | None, float | None]:
        """A probe's result for the link to ``dst`` (`LinkTimer.probed`)."""
        return self._links.probed(dst, nbytes, seconds) if self._links is not None else (None, None)

    def close(self) -> None:
        """Stop the link watchers (a watcher stuck in a dead peer's wait is a daemon)."""
        if self._links is not None:
            self._links.close(timeout_s=0.5)
