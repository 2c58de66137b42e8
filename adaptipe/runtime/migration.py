"""Live layer migration, stop-and-copy: layers change owner at one iteration boundary.

Every worker calls `migrate` at the same boundary (the one where it adopts a plan version
with another partition). Each layer that changes worker goes directly from its old
worker to its new one over the process group, adjacent or not (AutoPipe's moves between
two workers): its parameters, its optimizer state with the step count, for every job of
a job-array, as one safetensors payload per move with a SHA-256 digest. Its random
stream needs no bytes: it is derived from (seed, layer), so it comes with the layer.

The old partition stays intact until every worker has what it needs: senders keep their
layers while they send, receivers check each payload's digest and parse it, then all
workers agree (an all-reduce of "ready") and only then drop and add slots. A failure
anywhere before that point (a digest mismatch, an exception on either side, a message
that does not come within ``timeout_s``) is a non-event: nobody changes anything, the
report says why, and training goes on on the old partition.

Stop-and-copy puts the transfer on the critical path (the boundary waits for it); the
base-copy-plus-gradient-log variant that takes it off comes with migration part 2.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import Tensor

from adaptipe.plan.partition import Partition
from adaptipe.runtime.stagestate import Stage, payload_layers
from adaptipe.schedule.types import Schedule

__all__ = [
    "MIGRATION_FAULT_ENV",
    "MigrationReport",
    "Move",
    "layers_of",
    "migrate",
    "plan_moves",
]

MIGRATION_FAULT_ENV = "ADAPTIPE_INJECT_MIGRATION_FAULT"
"""``KIND:RANK`` makes that worker's side of the next migrations fail on purpose (a drill
for tests): ``raise`` (the sender fails before sending), ``corrupt`` (a payload byte is
flipped after its digest is taken), ``late`` (the payload leaves only after the receiver's
timeout), ``refuse`` (the receiver fails while it reads a payload); streamed moves also
take ``open`` (the worker's end of the state channel fails to open), ``die`` (the
worker's streaming helper process exits in the middle of a move) and ``lag`` (the
sender's gradient log falls behind, as over a link too slow to carry it)."""

_FAULTS = ("raise", "corrupt", "late", "refuse")
_STREAMED_FAULTS = ("open", "die", "lag")
_TAG = 0x40000000  # above the transport's tags at these sizes
_MOVES = 64  # tags per migration (two per move)


@dataclass(frozen=True, slots=True)
class Move:
    """Consecutive ``layers`` that go from worker ``src`` to worker ``dst``."""

    layers: tuple[int, ...]
    src: int
    dst: int


@dataclass(slots=True)
class MigrationReport:
    """What one worker's side of a migration did."""

    ok: bool
    moves: list[Move]
    cause: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    layers: list[list[int]] = field(default_factory=list)  # per chunk, after
    transfer: str = "stop_and_copy"  # or "streamed" (`adaptipe.runtime.streamed`)
    # streamed only: boundaries and seconds from the first boundary to the switch, the
    # gradient log's share of the bytes, chunks sent, seconds spent yielding to the
    # stage's own sends and held back by the base copy's pace (``seconds`` is then the
    # stall at the switch), that pace (bytes a second; 0: unpaced) and, paced, the
    # seconds from the base copy's first chunk to its last
    streamed_iterations: int = 0
    streamed_s: float = 0.0
    log_bytes: int = 0
    chunks: int = 0
    yielded_s: float = 0.0
    paced_s: float = 0.0
    pace_Bps: float = 0.0
    base_s: float = 0.0
    streamer: str = ""  # streamed only: "thread" or "process" (the worker's helper)
    # streamed only: failed because the link could not carry the gradient log (the
    # workers then move by stop-and-copy at the same boundary; `PlanSwitch.move`)
    lagged: bool = False
    instead_of: str = ""  # stop-and-copy only: the cause of the streamed move it replaced

    def to_json(self) -> dict[str, Any]:
        return {
            "transfer": self.transfer,
            "streamer": self.streamer,
            "lagged": self.lagged,
            "instead_of": self.instead_of,
            "streamed_iterations": self.streamed_iterations,
            "streamed_s": self.streamed_s,
            "log_bytes": self.log_bytes,
            "chunks": self.chunks,
            "yielded_s": self.yielded_s,
            "paced_s": self.paced_s,
            "pace_Bps": self.pace_Bps,
            "base_s": self.base_s,
            "ok": self.ok,
            "moves": [{"layers": list(m.layers), "src": m.src, "dst": m.dst} for m in self.moves],
            "cause": self.cause,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "seconds": self.seconds,
            "layers": self.layers,
        }


def layers_of(partition: Partition, schedule: Schedule, rank: int) -> list[list[int]]:
    """Worker ``rank``'s layers under ``partition``, per local chunk."""
    return [list(partition.layers(schedule.vstage(rank, c))) for c in range(schedule.num_chunks)]


def plan_moves(old: Partition, new: Partition, schedule: Schedule) -> list[Move]:
    """The layers that change worker from ``old`` to ``new``, grouped into moves of
    consecutive layers with one source and one destination (a layer that only changes
    local chunk stays in its process)."""
    moves: list[Move] = []
    for layer in range(old.num_layers):
        src = schedule.place(old.stage_of(layer))[0]
        dst = schedule.place(new.stage_of(layer))[0]
        if src == dst:
            continue
        last = moves[-1] if moves else None
        if last is not None and (last.src, last.dst) == (src, dst) and last.layers[-1] == layer - 1:
            moves[-1] = Move((*last.layers, layer), src, dst)
        else:
            moves.append(Move((layer,), src, dst))
    return moves


def migrate(
    stage: Stage,
    *,
    old: Partition,
    new: Partition,
    schedule: Schedule,
    wire: torch.device,
    timeout_s: float,
    seq: int = 0,
) -> MigrationReport:
    """Take on ``new`` (every worker calls this at the same boundary); see the module doc.

    ``seq`` numbers the migration (the plan version): its messages carry tags of their
    own, so a message that never came cannot be taken for one of a later migration.

    Returns this worker's report; ``ok`` is False (and nothing changed) when any worker's
    side failed before the switch.
    """
    t0 = time.perf_counter()
    moves = plan_moves(old, new, schedule)
    report = MigrationReport(ok=True, moves=moves)
    received: dict[str, Tensor] = {}
    try:
        if 2 * len(moves) > _MOVES:
            raise ValueError(f"{len(moves)} moves in one migration (at most {_MOVES // 2})")
        base = _TAG + (seq % 4096) * _MOVES
        _exchange(stage, moves, wire, timeout_s, base, report, received)
    except Exception as exc:  # any failure before the agreement is a non-event
        report.ok, report.cause = False, f"{type(exc).__name__}: {exc}"
    ready = torch.tensor([1 if report.ok else 0], dtype=torch.int64, device=wire)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    if int(ready.item()) == 1:
        stage.reshape(layers_of(new, schedule, stage.rank), received)
    elif report.ok:
        report.ok, report.cause = False, "another worker's side failed"
    report.layers = [[slot.index for slot in chunk] for chunk in stage.chunks]
    report.seconds = time.perf_counter() - t0
    return report


def _fault() -> tuple[str, int] | None:
    value = os.environ.get(MIGRATION_FAULT_ENV, "")
    kind, _, rank = value.partition(":")
    if not value:
        return None
    if kind not in (*_FAULTS, *_STREAMED_FAULTS) or not rank.isdigit():
        raise ValueError(
            f"{MIGRATION_FAULT_ENV}={value!r} must be KIND:RANK with KIND one of "
            f"{', '.join((*_FAULTS, *_STREAMED_FAULTS))} (e.g. corrupt:0)"
        )
    return (kind, int(rank)) if kind in _FAULTS else None  # the others: streamed moves only


def _exchange(
    stage: Stage,
    moves: Sequence[Move],
    wire: torch.device,
    timeout_s: float,
    base: int,
    report: MigrationReport,
    received: dict[str, Tensor],
) -> None:
    """Send this worker's moves and receive its incoming ones; check and parse them.

    Headers first (payload length and digest, or length -1 for "nothing comes"), so a
    sender that failed never leaves its receiver waiting for bytes.
    """
    rank, fault = stage.rank, _fault()
    mine = fault[0] if fault is not None and fault[1] == rank else None
    headers: dict[int, Tensor] = {}
    payloads: dict[int, bytes] = {}
    works = []
    for k, move in enumerate(moves):
        if move.src == rank:
            header = torch.full((33,), -1, dtype=torch.int64)
            try:
                if mine == "raise":
                    raise RuntimeError("migration fault injected before sending")
                payload = stage.pack(move.layers)
                header[0] = len(payload)
                header[1:] = torch.tensor(list(hashlib.sha256(payload).digest()))
                payloads[k] = payload
            except Exception as exc:
                report.ok, report.cause = False, f"{type(exc).__name__}: {exc}"
            works.append(dist.isend(header.to(wire), move.dst, tag=base + 2 * k))
        elif move.dst == rank:
            headers[k] = torch.empty(33, dtype=torch.int64, device=wire)
            works.append(dist.irecv(headers[k], move.src, tag=base + 2 * k))
    _wait(works, timeout_s)
    works, buffers = [], {}
    for k, payload in payloads.items():
        outgoing = bytearray(payload)
        if mine == "corrupt":
            outgoing[len(outgoing) // 2] ^= 0xFF
        if mine == "late":
            time.sleep(timeout_s + 0.5)
        tensor = torch.frombuffer(outgoing, dtype=torch.uint8).to(wire)
        works.append(dist.isend(tensor, moves[k].dst, tag=base + 2 * k + 1))
        report.bytes_sent += len(outgoing)
    for k, header in headers.items():
        size = int(header[0].item())
        if size >= 0:
            buffers[k] = torch.empty(size, dtype=torch.uint8, device=wire)
            works.append(dist.irecv(buffers[k], moves[k].src, tag=base + 2 * k + 1))
    _wait(works, timeout_s)
    for k, header in headers.items():
        move = moves[k]
        if k not in buffers:
            raise RuntimeError(f"worker {move.src} could not send layers {list(move.layers)}")
        data = buffers[k].cpu().numpy().tobytes()
        report.bytes_received += len(data)
        digest = bytes(int(b) for b in header[1:].tolist())
        if hashlib.sha256(data).digest() != digest:
            raise RuntimeError(
                f"layers {list(move.layers)} from worker {move.src}: checksum mismatch"
            )
        if mine == "refuse":
            raise RuntimeError("migration fault injected while receiving")
        layers, _ = payload_layers(data)
        if tuple(layers) != move.layers:
            raise RuntimeError(
                f"worker {move.src} sent layers {layers}, expected {list(move.layers)}"
            )
        received.update(safetensors.torch.load(data))
    if not report.ok:
        raise RuntimeError(report.cause)


def _wait(works: Sequence[Any], timeout_s: float) -> None:
    """Wait for ``works`` until ``timeout_s``. The waits run on a helper thread: a gloo
    wait with a timeout closes the connection to the peer when it expires, which would
    end the run, not just the migration. A message that comes late lands in its receive
    (later migrations use other tags) and ends the helper; one that never comes means a
    dead peer or link, which ends the run as any lost worker does."""
    done = threading.Event()
    errors: list[BaseException] = []

    def wait_all() -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as exc:  # handed to the caller
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait_all, name="migration-wait", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"a migration message did not arrive within {timeout_s:g} s")
    if errors:
        raise errors[0]
