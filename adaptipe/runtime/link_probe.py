"""Probing a throttled link live: does it carry more now than it did as the bottleneck?

A link that was a partition's bottleneck under a throttle is remembered at the rate it
carried then (`adaptipe.monitor.capacity`), and after a controller moved the partition
to a cut that sends little over it, nothing the stages send shows when the throttle
ends: a light send completes as soon as the kernel takes it. A probe does: a payload
timed from the receiver's word that it waits to the receiver's word that it has it all,
so neither the socket buffers nor the two stages' arrival at the boundary count.

Every ``[train] link_probe_every`` iterations (with ``link_telemetry``), at the first
boundary from then on, each link the schedule uses is asked, in a fixed order, in both
directions: the sender says how large a probe it wants (0: none, the usual answer;
`LinkCapacity.probe_bytes`: only where a remembered rate bounds the link and its traffic
is light, about 10 ms of payload at that rate), then::

    sender                                receiver
    send SIZE [n] ----------------------> recv SIZE
    if n:                                 if n:
      recv READY <-------------------------- send READY
      t0; the injected throttle, if any
      send n bytes ----------------------> recv n bytes
      recv ACK   <-------------------------- send ACK
      rate = n / (now - t0) -> LinkCapacity.probed

A rate above 1.5x the remembered one forgets it (the link reports what it carries
again, and a controller may move back); one above it, but less, becomes the limit; a
lower one changes nothing (`adaptipe.monitor.capacity`). Each probe is
logged (``link_probe`` in the stage's log). Links go in the order of their lower, then
higher worker, the lower end's direction first: every worker takes its own in that
order, so the blocking exchanges form chains, never a cycle. What it costs: a 1-element
exchange per link direction each ``link_probe_every`` iterations (the two ends meet),
and while a throttle is remembered, about 10 ms of payload each way at its rate.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from adaptipe.runtime.config_sections import TrainSection
from adaptipe.runtime.hooks import BaseHook
from adaptipe.runtime.transport import PROBE_TAGS
from adaptipe.schedule.types import Schedule

__all__ = ["LinkProbe", "probe_hook", "probe_links"]

_SIZE, _READY, _DATA, _ACK = PROBE_TAGS


class Probed(Protocol):
    """What the probe uses of the transport (`adaptipe.runtime.transport.P2PTransport`)."""

    wire: torch.device

    @property
    def measures_links(self) -> bool: ...

    def throttled(self, nbytes: int) -> None: ...

    def probe_bytes(self, dst: int) -> int: ...

    def probed(
        self, dst: int, nbytes: int, seconds: float
    ) -> tuple[float | None, float | None]: ...


def probe_hook(
    train: TrainSection,
    schedule: Schedule,
    transport: Probed,
    log: Callable[[dict[str, Any]], None],
) -> list[LinkProbe]:
    """This worker's probe, where its links are measured (``[train] link_telemetry`` and
    telemetry on) and ``link_probe_every`` > 0, one process a stage (replicated stages
    are not probed); else none."""
    if not (train.link_probe_every > 0 and transport.measures_links):
        return []
    if not dist.is_initialized() or dist.get_world_size() != schedule.num_stages:
        return []
    links = probe_links(schedule)
    return [LinkProbe(dist.get_rank(), links, transport, every=train.link_probe_every, log=log)]


def probe_links(schedule: Schedule) -> list[tuple[int, int]]:
    """The worker pairs ``(lower, higher)`` that the schedule sends between, in order."""
    workers = [schedule.place(g)[0] for g in range(schedule.num_virtual_stages)]
    pairs = {(min(a, b), max(a, b)) for a, b in itertools.pairwise(workers) if a != b}
    return sorted(pairs)


class LinkProbe(BaseHook):
    """A worker hook (`adaptipe.runtime.hooks.WorkerHook`) that probes its links."""

    def __init__(
        self,
        rank: int,
        links: list[tuple[int, int]],
        transport: Probed,
        *,
        every: int,
        log: Callable[[dict[str, Any]], None],
    ) -> None:
        self.rank, self.transport, self.every, self.log = rank, transport, every, log
        self.links = [pair for pair in links if rank in pair]
        self._next: int | None = None  # every worker starts at the same boundary

    def before_boundary(self, iteration: int) -> None:
        if self._next is None:
            self._next = iteration + self.every
        if iteration < self._next or not self.links:
            return
        self._next = iteration + self.every
        for low, high in self.links:
            for src, dst in ((low, high), (high, low)):
                if src == self.rank:
                    self._send(dst, iteration)
                else:
                    self._answer(src)

    def _tensor(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, device=self.transport.wire)

    def _send(self, dst: int, iteration: int) -> None:
        n = self.transport.probe_bytes(dst)
        size = torch.tensor([n], dtype=torch.int64, device=self.transport.wire)
        dist.send(size, dst, tag=_SIZE)
        if n == 0:
            return
        dist.recv(self._tensor(1), dst, tag=_READY)
        t0 = time.perf_counter()
        self.transport.throttled(n)
        dist.send(self._tensor(n), dst, tag=_DATA)
        dist.recv(self._tensor(1), dst, tag=_ACK)
        seconds = time.perf_counter() - t0
        before, after = self.transport.probed(dst, n, seconds)
        self.log(
            {
                "event": "link_probe",
                "stage": self.rank,
                "iteration": iteration,
                "dst": dst,
                "bytes": n,
                "seconds": round(seconds, 6),
                "rate_Bps": round(n / seconds, 1) if seconds > 0 else None,
                "limit_before_Bps": before,
                "limit_after_Bps": after,
            }
        )

    def _answer(self, src: int) -> None:
        size = torch.zeros(1, dtype=torch.int64, device=self.transport.wire)
        dist.recv(size, src, tag=_SIZE)
        n = int(size.item())
        if n == 0:
            return
        dist.send(self._tensor(1), src, tag=_READY)
        dist.recv(self._tensor(n), src, tag=_DATA)
        dist.send(self._tensor(1), src, tag=_ACK)
