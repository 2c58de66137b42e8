"""Live migration with the state streamed while training goes on (migration part 2).

Stop-and-copy (`adaptipe.runtime.migration`) moves a layer's whole state at one boundary,
and training waits for it. Here the state crosses while the old partition trains on:

1. at the boundary where the workers first see the new partition, each sending worker
   snapshots its outgoing layers (parameters, optimizer state with the step count,
   buffers: what stop-and-copy sends) and streams them on a `statestream` channel, at
   low priority, one layer at a time and paced (``pace_Bps``: spread over a few
   iterations, the copy costs each of them a little rather than one of them a lot);
   the receiver builds each layer as it comes, beside its own (`Stage.spare_slots`):
   the *base copy*;
2. from then on every optimizer step of the sender also logs the outgoing layers'
   gradients and buffers on that channel, and the receiver replays each step on its
   copy, in order, with the same optimizer: the copy follows the original bit for bit
   (the *gradient log*);
3. at every boundary the workers agree (one all-reduce on the CPU group) whether each
   receiver is at most one step behind; once so, each receiver waits for its last step
   (on its way since the sender's step), replays it, the workers agree once more, and
   the layers change owner as in stop-and-copy: the sender drops them, the receiver
   takes its copy.

Any failure before the switch (a chunk's checksum, a sender's error, the whole move
taking longer than ``timeout_s``) is a non-event, as in stop-and-copy: the copies are
dropped and training goes on on the old partition.

The receiving thread builds the copies and replays the steps itself (torch's kernels
leave the GIL, and nothing trains on the copies before the switch). Both threads run
at normal priority: at nice 19 they starved behind the stage on its one core here and
a move never caught up (measured, bench/bench_migration.py). What yields is the chunks
(to the stage's own sends), the packets (TOS 0x08) and, on stages that compute on a
GPU, the socket's I/O thread (`SCHED_IDLE`: a CPU stage's core is never idle).

The replay is exact because the receiver runs the sender's own update: the same
optimizer class and settings on the same state, fed the gradients the sender stepped
with. That holds for one-job runs with synchronous schedules (an asynchronous schedule
keeps weight versions per micro-batch; a job-array keeps its job states in the binder
and the memory manager); those move by stop-and-copy.
"""

from __future__ import annotations

import ipaddress
import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch
from torch import Tensor

from adaptipe.runtime import checkpoint as ckpt
from adaptipe.runtime.migration import MigrationReport, Move
from adaptipe.runtime.slots import LayerSlot
from adaptipe.runtime.stagestate import Stage, payload_layers, payload_metadata
from adaptipe.runtime.statestream import (
    Pace,
    StateReceiver,
    StateSender,
    StreamError,
    StreamTimeout,
)
from adaptipe.runtime.streamproto import (
    FAILED,
    LAG_CAUSE,
    LAG_STEPS,
    LAGGED,
    PER_STEP,
    READY,
    WAIT,
    StreamKeys,
    StreamSettings,
    agree,
    base_stream,
    exchange,
    finish_report,
    local_host,
    state_buffers,
    stream_fault,
    wait_until,
)
from adaptipe.runtime.tensorpack import Staged, pack_staged

__all__ = ["StreamedMove"]


_STOP_RANK, _LOG_RANK, _BASE_RANK = -1, 0, 1  # the outbox's order: stop, log, base


class _Stopped(Exception):
    """The move was closed while the sending thread sent a logged step."""


@dataclass(frozen=True, slots=True)
class _Send:
    """One payload on its way: its stream, where to, its bytes, whether it is paced."""

    stream: int
    dst: int
    body: bytes | bytearray | Staged
    paced: bool


class StreamedMove:
    """One streamed migration in flight on this worker (every worker builds one at the
    same boundary; see the module doc). ``moves``: every move of the migration, this
    worker's among them; ``group``/``device``: where the agreements run (a CPU group)."""

    def __init__(
        self,
        stage: Stage,
        moves: Sequence[Move],
        *,
        version: int,
        settings: StreamSettings,
        busy: Callable[[], bool],
        group: Any = None,
        device: torch.device | None = None,
    ) -> None:
        if len(moves) > PER_STEP:
            raise ValueError(f"{len(moves)} moves in one migration (at most {PER_STEP})")
        rank = stage.rank
        self.stage, self.moves, self.version, self.settings = stage, list(moves), version, settings
        self.group, self.device = group, device if device is not None else torch.device("cpu")
        self.outgoing = [(k, m) for k, m in enumerate(self.moves) if m.src == rank]
        self.incoming = [(k, m) for k, m in enumerate(self.moves) if m.dst == rank]
        self.base_step = stage.steps_done
        self.boundaries = 0  # boundaries passed while streaming
        self.started = time.monotonic()
        self._fault = stream_fault(rank)
        self._error = ""
        self._lagged = False  # the gradient log fell behind: stop-and-copy at once
        self._status = WAIT
        self._copies: dict[int, LayerSlot] = {}
        self._applied = {k: -1 for k, _ in self.incoming}  # 0: the base, n: step base + n - 1
        self._sent: dict[str, float] = {
            "bytes": 0, "chunks": 0, "yielded_s": 0.0, "paced_s": 0.0, "log_bytes": 0,
            "base_s": 0.0
        }  # fmt: skip
        self._received = 0
        self._handed = self._reported = 0  # payloads queued to send / sent
        self._stop = threading.Event()
        self._progress = threading.Condition()  # guards _applied, _handed, _reported
        # (rank, order, what): the log before the base (see `_send_all`); None stops
        self._outbox: queue.PriorityQueue[tuple[int, int, _Send | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._logged = self._log_sent = 0  # steps' payloads queued / sent (one writer each)
        self._pace = Pace(settings.pace_Bps) if settings.pace_Bps > 0 else None  # the base's
        self._receiver: StateReceiver | None = None
        self._senders: dict[int, StateSender] = {}
        self._threads: list[threading.Thread] = []
        keys: StreamKeys | None = None
        try:  # this worker's end; a failure is agreed on below, never a hang
            if self._fault == "open":
                raise OSError("migration fault injected while opening the state channel")
            host = local_host()
            keys = StreamKeys.generate() if not ipaddress.ip_address(host).is_loopback else None
            if self.incoming:
                curve = keys.server() if keys else None
                self._receiver = StateReceiver(f"tcp://{host}:*", curve=curve)
        except Exception as exc:
            self._error = f"the state channel could not open: {type(exc).__name__}: {exc}"
        address = self._receiver.address if self._receiver else ""
        peers = self._exchange(address, keys, failed=bool(self._error))
        broken = [rank for rank, (_, _, bad) in peers.items() if bad]
        if broken:
            self._error = self._error or f"worker {broken[0]} could not open the state channel"
            self._close_sockets()
            return
        for _, move in self.outgoing:
            if move.dst not in self._senders:
                address, public, _ = peers[move.dst]
                self._senders[move.dst] = StateSender(
                    address,
                    chunk_bytes=settings.chunk_bytes,
                    busy=busy,
                    prioritise=settings.prioritise,
                    idle_cpu=settings.idle_cpu,
                    curve=StreamKeys.client_of(public) if public else None,
                )
        self._threads = [
            threading.Thread(target=self._send_loop, name="migration-send", daemon=True),
            threading.Thread(target=self._receive_loop, name="migration-receive", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        held = {slot.index: slot for chunk in stage.chunks for slot in chunk}
        for k, move in self.outgoing:  # the base copy: one payload a layer, packed now
            for j, layer in enumerate(move.layers):
                slot = held[layer]
                state = ckpt.layer_state(layer, slot.module, slot.optimizer, copy=False)
                body = pack_staged(state, payload_metadata([layer], 0))
                self._put(_BASE_RANK, _Send(base_stream(k, j), move.dst, body, paced=True))
        if self.outgoing:
            stage.tap_steps(self._log_step)

    # ------------------------------------------------------------------ boundaries
    def boundary(self) -> int:
        """At a boundary while streaming (every worker): replay what came, then agree on
        READY (switch now: call `switch`), WAIT or FAILED (call `switch`, which fails)."""
        self.boundaries += 1
        done = self.stage.steps_done - self.base_step  # steps the receiver must replay
        mine = READY
        if self._error or time.monotonic() - self.started > self.settings.timeout_s:
            mine = LAGGED if self._lagged else FAILED
            self._error = self._error or f"not moved within {self.settings.timeout_s:g} s"
        elif self._behind(done) > 1:
            mine = WAIT
        self._status = self._agree(mine)
        return self._status

    def switch(self, layer_lists: Sequence[Sequence[int]]) -> MigrationReport:
        """Take ``layer_lists`` on (every worker, at the boundary `boundary` said READY or
        FAILED at): the receivers replay their last step, all agree, then the layers change
        owner. Returns this worker's report; when not ok nothing changed."""
        t0 = time.perf_counter()
        report = MigrationReport(ok=False, moves=self.moves, transfer="streamed", streamer="thread")
        mine = self._status if self._status in (READY, LAGGED) else FAILED
        if mine == READY:
            done = self.stage.steps_done - self.base_step
            replayed = lambda: bool(self._error) or all(n >= done for n in self._applied.values())  # noqa: E731
            if not wait_until(self._progress, replayed, self.started + self.settings.timeout_s):
                self._error = f"not moved within {self.settings.timeout_s:g} s"
            mine = FAILED if self._error else READY
        agreed = self._agree(mine)
        if agreed == READY and self.outgoing:  # the receivers have it all; the sending
            wait_until(self._progress, self._all_reported, self.started + self.settings.timeout_s)
        self.close()  # thread's count of it may lag
        if agreed == READY:
            self.stage.reshape(layer_lists, {}, built=self._copies)
            report.ok = True
        else:
            report.cause = self._error or "another worker's side failed"
            report.lagged = agreed == LAGGED
        return finish_report(
            report, self.stage, self._sent, self._received, t0=t0,
            boundaries=self.boundaries, started=self.started, pace_Bps=self.settings.pace_Bps,
        )  # fmt: skip

    def _all_reported(self) -> bool:
        return self._reported >= self._handed or bool(self._error)

    def close(self, *, wait: bool = False) -> None:
        """Stop streaming (after the switch, or when the move is dropped). The threads
        close their own sockets as they end, off the training path; ``wait`` joins them."""
        self.stage.tap_steps(None)
        self._stop.set()
        self._put(_STOP_RANK, None)
        if wait:
            for thread in self._threads:
                thread.join(timeout=5.0)

    # ------------------------------------------------------------------ sending
    def _log_step(self, step: int, slots: list[LayerSlot]) -> None:
        """Before the sender's optimizer step ``step``: log the outgoing layers' gradients
        (copies: an optimizer may change them in place) and buffers."""
        held = {slot.index: slot for slot in slots}
        n = step - self.base_step + 1
        lags = self._logged - self._log_sent > LAG_STEPS * len(self.outgoing)
        if lags or self._fault == "lag":  # the link cannot carry the log
            self._lagged = not self._error
            self._error = self._error or LAG_CAUSE
            self.stage.tap_steps(None)
            return
        for k, move in self.outgoing:
            tensors: dict[str, Tensor] = {}
            for i in move.layers:
                module = held[i].module
                for name, p in module.named_parameters():
                    if p.grad is not None:
                        tensors[f"{i}/grad/{name}"] = p.grad
                for name, b in state_buffers(module):
                    tensors[f"{i}/buffer/{name}"] = b
            body = pack_staged(tensors)  # the one copy (an optimizer may change them in place)
            self._logged += 1
            self._put(_LOG_RANK, _Send(n * PER_STEP + k, move.dst, body, paced=False))

    def _put(self, rank: int, item: _Send | None) -> None:
        if item is not None:
            with self._progress:
                self._handed += 1
        self._outbox.put((rank, next(self._order), item))

    def _send_loop(self) -> None:
        try:
            self._send_all()
        finally:
            for sender in self._senders.values():
                sender.close()

    def _send_all(self) -> None:
        """Send what is queued, logged steps first, and a logged step that comes while a
        base payload is ahead of its pace in the time the pace leaves (the receiver keeps
        a step that comes before its base): the log arrives spread over the iterations
        the base takes, not all at once after it, and never holds the base behind its
        pace (where the link cannot carry both, the base goes first, as it must)."""
        try:
            while True:
                _, _, item = self._outbox.get()
                if item is None or self._stop.is_set():
                    return
                self._send(item)
        except _Stopped:
            return
        except Exception as exc:  # the move fails at the next boundary
            self._error = f"{type(exc).__name__}: {exc}"

    def _send(self, item: _Send) -> None:
        if self._fault == "raise":
            raise RuntimeError("migration fault injected before sending")
        body = item.body.ready() if isinstance(item.body, Staged) else item.body
        sent = self._senders[item.dst].send(
            item.stream, body, timeout_s=3600.0, corrupt=self._fault == "corrupt",
            pace=self._pace if item.paced else None,  # one pace over every layer's payload
            while_ahead=self._send_logged if item.paced else None,
        )  # fmt: skip
        with self._progress:
            self._sent["bytes"] += sent.bytes
            self._sent["chunks"] += sent.chunks
            self._sent["yielded_s"] += sent.yielded_s
            self._sent["paced_s"] += sent.paced_s
            if item.paced and self._pace is not None:
                self._sent["base_s"] = self._pace.span_s
            if not item.paced:
                self._sent["log_bytes"] += sent.bytes
                self._log_sent += 1
            self._reported += 1
            self._progress.notify_all()

    def _send_logged(self) -> None:
        """The logged steps queued now (while a base payload waits for its pace)."""
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                rank, order, item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if rank != _LOG_RANK or item is None:  # a base, or the stop: not now
                self._outbox.put((rank, order, item))
                return
            self._send(item)

    # ------------------------------------------------------------------ receiving
    def _receive_loop(self) -> None:
        if self._receiver is None:
            return
        try:
            self._receive_all(self._receiver)
        except Exception as exc:  # the move fails at the next boundary
            if not self._stop.is_set():
                self._error = self._error or f"{type(exc).__name__}: {exc}"
        finally:
            self._receiver.close()
            with self._progress:
                self._progress.notify_all()

    def _receive_all(self, receiver: StateReceiver) -> None:
        """Take the incoming streams in order (every move's base, then step by step) and
        apply each to the copies as it comes."""
        n = 0
        while True:
            for k, move in self.incoming:
                if n == 0:  # the base, a layer at a time
                    for j, layer in enumerate(move.layers):
                        data = self._take(receiver, base_stream(k, j))
                        if data is None:
                            return
                        self._build(k, layer, data)
                else:
                    data = self._take(receiver, n * PER_STEP + k)
                    if data is None:
                        return
                    self._received += len(data)
                    _replay(
                        self._copies, move.layers, safetensors.torch.load(data), self.stage.device
                    )
                with self._progress:
                    self._applied[k] = n
                    self._progress.notify_all()
            n += 1

    def _take(self, receiver: StateReceiver, stream: int) -> bytes | None:
        """Stream ``stream`` whole, or None once the move is closed."""
        while not self._stop.is_set():
            try:
                return receiver.receive(stream, digest=None, timeout_s=0.05)
            except StreamTimeout:
                continue
        return None

    def _build(self, k: int, layer: int, body: bytes) -> None:
        """The copy of ``layer`` (of move ``k``) from its base."""
        move = self.moves[k]
        self._received += len(body)
        layers, _ = payload_layers(body)
        if layers != [layer]:
            raise StreamError(f"worker {move.src} sent layers {layers}, not [{layer}]")
        (slot,) = self.stage.spare_slots(layers, safetensors.torch.load(body))
        self._copies[slot.index] = slot

    def _behind(self, done: int) -> int:
        """How many steps the slowest incoming move's copy lacks of ``done``."""
        with self._progress:
            return max((done - n for n in self._applied.values()), default=0)

    # ------------------------------------------------------------------ collectives
    def _agree(self, mine: int) -> int:
        return agree(mine, group=self.group, device=self.device)

    def _exchange(
        self, address: str, keys: StreamKeys | None, *, failed: bool
    ) -> dict[int, tuple[str, str, bool]]:
        return exchange(address, keys, failed=failed, group=self.group, device=self.device)

    def _close_sockets(self) -> None:
        """Close the channel's ends when no thread took them over."""
        for sender in self._senders.values():
            sender.close()
        if self._receiver is not None:
            self._receiver.close()
        self._senders.clear()
        self._receiver = None


def _replay(
    copies: Mapping[int, LayerSlot],
    layers: Sequence[int],
    logged: Mapping[str, Tensor],
    device: torch.device,
) -> None:
    """One optimizer step of the copies of ``layers`` with the sender's gradients, then
    the sender's buffers after that step's forwards."""
    for i in layers:
        slot = copies[i]
        for name, p in slot.module.named_parameters():
            grad = logged.get(f"{i}/grad/{name}")
            p.grad = grad.to(device) if grad is not None else None
        if slot.optimizer is not None:
            slot.optimizer.step()
            slot.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in state_buffers(slot.module):
                b.copy_(logged[f"{i}/buffer/{name}"])
