"""What both kinds of streamed move share (`adaptipe.runtime.streamed`, in threads of the
stage; `adaptipe.runtime.courier_move`, in the worker's helper process): the answers
the workers agree on at a boundary and the collectives that agree, the exchange of
receiving addresses (with CURVE keys off loopback), stream ids, the settings, the pace of
the base copy, the report filled at the switch and the fault drill."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from adaptipe.runtime.migration import MIGRATION_FAULT_ENV, MigrationReport
from adaptipe.runtime.stagestate import Stage

__all__ = [
    "FAILED",
    "LAGGED",
    "LAG_CAUSE",
    "LAG_STEPS",
    "PER_STEP",
    "READY",
    "WAIT",
    "StreamKeys",
    "StreamSettings",
    "agree",
    "base_pace",
    "base_stream",
    "exchange",
    "finish_report",
    "local_host",
    "state_buffers",
    "stream_fault",
    "wait_until",
]

# What the workers agree on at a boundary (the minimum wins): switch now, stream on, the
# link could not carry the gradient log (the move goes by stop-and-copy at once), failed.
READY, WAIT, LAGGED, FAILED = 1, 0, -1, -2
PER_STEP = 64  # stream ids per step: one per move (as stop-and-copy's limit)
_BASE = 1 << 62  # the base copy's stream ids: _BASE + move * PER_LAYER + its layer's place
PER_LAYER = 1 << 20
_ADDRESS_BYTES = 192
# Logged steps a sender may hold unsent; one more and the link counts as unable to carry
# the log (and memory stays bounded). On the bed's throttled link 8 took 10 iterations to
# fill (4 took 6), but at 4 a helper-process streamer on loopback, on this 2-core
# machine under the test suite, fell behind and copied a move it could have streamed
# (tests/test_streamed_migration.py, session 25): 8 it stays.
LAG_STEPS = 8
LAG_CAUSE = (
    f"the gradient log fell {LAG_STEPS} steps behind the link; the move goes by stop-and-copy"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamSettings:
    """``chunk_bytes``: the state channel's chunk; ``prioritise``: yield to the stage's
    sends, TOS 0x08, idle I/O thread (off only to measure what it buys); ``timeout_s``:
    the whole move, from the first boundary to the switch; ``idle_cpu``: whether the
    stage's CPU has idle time for the I/O thread at ``SCHED_IDLE``; ``pace_Bps``: the
    base copy's pace (0: as fast as the stage's sends let it; see `base_pace`)."""

    chunk_bytes: int = 256 << 10
    prioritise: bool = True
    timeout_s: float = 60.0
    idle_cpu: bool = True  # the channel's I/O thread at SCHED_IDLE (stages on a GPU)
    pace_Bps: float = 0.0


def base_stream(move: int, place: int) -> int:
    """The stream id of the base copy of the ``place``-th layer of move ``move``."""
    return _BASE + move * PER_LAYER + place


def base_pace(state_bytes: int, iteration_s: float, iterations: int) -> float:
    """The pace (bytes a second) that sends ``state_bytes`` of base copy over
    ``iterations`` iterations of ``iteration_s`` (0: unpaced, when either is unknown)."""
    if iterations <= 0 or iteration_s <= 0 or state_bytes <= 0:
        return 0.0
    return state_bytes / (iterations * iteration_s)


def wait_until(progress: threading.Condition, done: Callable[[], bool], deadline: float) -> bool:
    """Wait on ``progress`` (notified as things advance) until ``done()`` (read under
    it) or the monotonic ``deadline``; whether it is done."""
    with progress:
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            progress.wait(min(left, 0.05))
        return True


def finish_report(
    report: MigrationReport,
    stage: Stage,
    sent: Mapping[str, float],
    received: int,
    *,
    t0: float,
    boundaries: int,
    started: float,
    pace_Bps: float,
) -> MigrationReport:
    """Fill a streamed move's ``report`` at its switch (begun at ``t0``, perf counter):
    bytes, the layers held now, the stall, and how long and how much it streamed."""
    report.bytes_sent, report.bytes_received = int(sent["bytes"]), received
    report.layers = [[slot.index for slot in chunk] for chunk in stage.chunks]
    report.seconds = time.perf_counter() - t0
    report.streamed_iterations = boundaries
    report.streamed_s = time.monotonic() - started
    report.log_bytes = int(sent["log_bytes"])
    report.chunks = int(sent["chunks"])
    report.yielded_s = sent["yielded_s"]
    report.paced_s = sent["paced_s"]
    report.pace_Bps = pace_Bps
    report.base_s = sent["base_s"]
    return report


def agree(mine: int, *, group: Any, device: torch.device) -> int:
    """The minimum of every worker's ``mine`` (READY, WAIT, LAGGED, FAILED) on ``group``."""
    box = torch.tensor([mine], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group)
    return int(box.item())


def exchange(
    address: str, keys: StreamKeys | None, *, failed: bool, group: Any, device: torch.device
) -> dict[int, tuple[str, str, bool]]:
    """Every worker's receiving address, server key and whether its end failed."""
    mine = json.dumps({"a": address, "k": keys.server_public if keys else "", "f": failed}).encode()
    if len(mine) > _ADDRESS_BYTES:
        raise ValueError(f"state channel address too long: {address!r}")
    box = torch.zeros(_ADDRESS_BYTES, dtype=torch.uint8, device=device)
    box[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    if dist.is_initialized() and dist.get_world_size() > 1:
        boxes = [torch.empty_like(box) for _ in range(dist.get_world_size(group))]
        dist.all_gather(boxes, box, group=group)
    else:
        boxes = [box]
    out = {}
    for rank, got in enumerate(boxes):
        entry = json.loads(bytes(got.cpu().tolist()).rstrip(b"\0"))
        out[rank] = (str(entry["a"]), str(entry["k"]), bool(entry["f"]))
    return out


def state_buffers(module: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """The buffers a layer's state holds (running statistics; not constant masks)."""
    kept = module.state_dict(keep_vars=True)
    return [(name, b) for name, b in module.named_buffers() if name in kept]


def stream_fault(rank: int) -> str | None:
    """``ADAPTIPE_INJECT_MIGRATION_FAULT`` for this worker's end of a streamed move:
    ``raise`` or ``corrupt`` (sending), ``open`` (opening the channel), ``die`` (its
    streaming helper exits mid-move; moves through a helper only), ``lag`` (its gradient
    log falls behind at the first step it logs, as over a link too slow to carry it)."""
    kind, _, target = os.environ.get(MIGRATION_FAULT_ENV, "").partition(":")
    return kind if target.isdigit() and int(target) == rank else None


def local_host() -> str:
    """This worker's address towards the others: the one it reaches the rendezvous
    host from (loopback when that is loopback)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        if ipaddress.ip_address(master).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass  # a host name
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as probe:
        probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
        return str(probe.getsockname()[0])


@dataclass(frozen=True, slots=True)
class StreamKeys:
    """One migration's CURVE keys off loopback: each receiver is a server with a fresh
    key pair; senders connect with a fresh client pair of their own (the channel is
    encrypted and the receiver authenticated, like the process group beside it, which
    authenticates nobody)."""

    server_public: str
    server_secret: str

    @classmethod
    def generate(cls) -> StreamKeys:
        import zmq

        public, secret = zmq.curve_keypair()
        return cls(public.decode(), secret.decode())

    def server(self) -> Any:
        import zmq

        from adaptipe.monitor.publisher import CurveKeys

        client_public, _ = zmq.curve_keypair()
        return CurveKeys(
            self.server_public.encode(), self.server_secret.encode(), client_public, None
        )

    @staticmethod
    def client_of(server_public: str) -> Any:
        import zmq

        from adaptipe.monitor.publisher import CurveKeys

        public, secret = zmq.curve_keypair()
        return CurveKeys(server_public.encode(), None, public, secret)
