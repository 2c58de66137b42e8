"""A streamed move whose streaming work runs in the worker's helper process.

The same protocol as `adaptipe.runtime.streamed` (base copy, replayed gradient log, the
workers' agreement at every boundary, the switch once every copy is at most one step
behind), with the work that held the stage's GIL there moved into the worker's
`adaptipe.runtime.courier.Courier`:

- the sender writes the base snapshot to a file in shared memory once, and each logged
  step's gradients and buffers into a slot of a shared ring (on a GPU stage through
  pinned memory, off the compute stream); the helper chunks, hashes and sends them;
- the receiver's helper checks the streams, replays every logged step on its own copy
  with the optimizer the stage builds, on the stage's device, and at the switch writes
  the copy's state for the stage to load into the layers it built from the base.

What stays on the stage: one copy of each step's gradients into the ring, and at the
switch one load of the moved layers' state. The helper yields to the stage's sends
through a shared flag a pacing thread keeps (``prioritise``), marks its packets TOS
0x08 and, on a GPU stage, runs at a lower CPU priority (nice 10).

The move begins (base, channel) at the first boundary where every worker's helper is
ready; a helper that is not yet started makes the move wait, never training.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from adaptipe.runtime import checkpoint as ckpt
from adaptipe.runtime.courier import Courier, LogRing, SharedFlag, log_entries, shm_path
from adaptipe.runtime.migration import MigrationReport, Move
from adaptipe.runtime.slots import LayerSlot
from adaptipe.runtime.stagestate import Stage
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
    exchange,
    finish_report,
    local_host,
    state_buffers,
    stream_fault,
    wait_until,
)

__all__ = ["CourierMove"]

_POLL_S = 0.001  # how often the pacer mirrors whether the stage sends
_ADDRESS_S = 10.0  # how long a worker waits for its helper to open its receiving end


class CourierMove:
    """One streamed migration in flight on this worker, through its ``courier`` (every
    worker builds one at the same boundary). As `adaptipe.runtime.streamed.StreamedMove`:
    `boundary` at every boundary, `switch` once it says READY or FAILED, `close`."""

    def __init__(
        self,
        stage: Stage,
        moves: Sequence[Move],
        *,
        version: int,
        settings: StreamSettings,
        busy: Callable[[], bool],
        courier: Courier,
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
        self.boundaries = 0
        self.started = time.monotonic()
        self._courier, self._busy = courier, busy
        self._fault = stream_fault(rank)
        self._error = ""
        self._lagged = False  # the gradient log fell behind: stop-and-copy at once
        self._status = WAIT
        self._began = False
        self._copies: dict[int, LayerSlot] = {}
        self._applied = {k: -1 for k, _ in self.incoming}  # 0: the base, n: step base + n - 1
        self._sent: dict[str, float] = {
            "bytes": 0, "chunks": 0, "yielded_s": 0.0, "paced_s": 0.0, "log_bytes": 0,
            "base_s": 0.0
        }  # fmt: skip
        self._received = 0
        self._handed = self._reported = 0  # payloads handed to the helper / said sent
        self._stop = threading.Event()
        self._progress = threading.Condition()  # guards _applied, _handed, _reported
        self._address: queue.Queue[str] = queue.Queue()
        self._final = threading.Event()
        self._files: list[Path] = []
        self._bases = {k: shm_path("base") for k, _ in self.incoming}
        self._finals = {k: shm_path("final") for k, _ in self.incoming}
        self._rings: dict[int, LogRing] = {}
        self._threads: list[threading.Thread] = []
        self._notify: queue.Queue[tuple[Any, dict[str, Any], LogRing, int] | None] = queue.Queue()
        if self._fault == "open":
            self._error = "migration fault injected: the state channel could not open"
        elif not courier.alive:
            self._error = "the state channel could not open: the streaming helper is gone"
        courier.attach(version, self._on_message)
        self._try_begin()

    # ------------------------------------------------------------------ beginning
    def _try_begin(self) -> None:
        """Begin where every worker's helper is ready (every worker at one boundary)."""
        mine = FAILED if self._error else READY if self._courier.ready.is_set() else WAIT
        agreed = self._agree(mine)
        if agreed == FAILED:
            self._error = self._error or "another worker could not open the state channel"
        elif agreed == READY:
            self._began = True
            failed = False
            keys = None
            try:
                keys = self._begin()
            except Exception as exc:
                self._fail(f"the state channel could not open: {type(exc).__name__}: {exc}")
                failed = True
            self._connect(keys, failed=failed)

    def _begin(self) -> StreamKeys | None:
        """Snapshot the base, open the helper's receiving end, log every step from now."""
        stage, settings, courier = self.stage, self.settings, self._courier
        self.base_step = stage.steps_done
        host = local_host()
        keys = StreamKeys.generate() if not ipaddress.ip_address(host).is_loopback else None
        flag = None
        if self.outgoing and settings.prioritise:
            flag = SharedFlag()
            self._files.append(flag.path)
            self._thread(lambda: self._pace(flag), "migration-pace")
        receives = bool(self.incoming)
        curve = [keys.server_public, keys.server_secret] if keys and receives else None
        courier.send({"kind": "bind", "move": self.version, "receive": receives,
                      "host": f"tcp://{host}:*", "curve": curve, "fault": self._fault,
                      "prioritise": settings.prioritise, "chunk_bytes": settings.chunk_bytes,
                      "timeout_s": settings.timeout_s, "pace_Bps": settings.pace_Bps,
                      "busy": str(flag.path) if flag else ""})  # fmt: skip
        if receives:
            self._files += [*self._bases.values(), *self._finals.values()]
            courier.send({"kind": "expect", "move": self.version,
                          "moves": {k: list(m.layers) for k, m in self.incoming},
                          "optimizer": dataclasses.asdict(stage.config.optimizer),
                          "device": str(stage.device),
                          "bases": {k: str(p) for k, p in self._bases.items()}})  # fmt: skip
        held = {slot.index: slot for chunk in stage.chunks for slot in chunk}
        bases = []
        for k, move in self.outgoing:  # the base copy: a snapshot now (copies), written
            modules = [held[i].module for i in move.layers]  # to shared memory off the
            entries = log_entries(move.layers, modules)  # stage's thread, sent by the helper
            path = shm_path("base")
            self._files.append(path)
            bases.append((k, move, path, stage.tensors(move.layers), entries))
            ring = LogRing(entries, LAG_STEPS + 1, stage.device)
            self._files.append(ring.path)
            self._rings[k] = ring
        if bases:
            self._thread(lambda: self._write_bases(bases), "migration-base")
        if any(ring.cuda for ring in self._rings.values()):
            self._thread(self._publish_loop, "migration-publish")
        if self.outgoing:
            stage.tap_steps(self._log_step)
        return keys

    def _connect(self, keys: StreamKeys | None, *, failed: bool) -> None:
        """Exchange the receivers' addresses (every worker) and connect the senders."""
        address = ""
        if self.incoming and not failed:
            try:
                address = self._address.get(timeout=_ADDRESS_S)
            except queue.Empty:
                self._fail(f"the streaming helper opened no receiving end in {_ADDRESS_S:g} s")
        bad = failed or bool(self._error) or (bool(self.incoming) and not address)
        peers = exchange(address, keys, failed=bad, group=self.group, device=self.device)
        broken = [rank for rank, (_, _, down) in peers.items() if down]
        if broken:
            self._error = self._error or f"worker {broken[0]} could not open the state channel"
            return
        for dst in sorted({move.dst for _, move in self.outgoing}):
            peer, public, _ = peers[dst]
            self._courier.send({"kind": "connect", "move": self.version, "dst": dst,
                                "address": peer, "curve": public})  # fmt: skip

    def _write_bases(
        self, bases: list[tuple[int, Move, Path, dict[str, torch.Tensor], Any]]
    ) -> None:
        try:
            for k, move, path, snapshot, entries in bases:
                meta = {"layers": list(move.layers), "log": entries}
                metadata = {"adaptipe_stream": json.dumps(meta)}
                safetensors.torch.save_file(snapshot, str(path), metadata=metadata)
                self._hand()
                self._courier.send({"kind": "send", "move": self.version, "k": k, "stream": k,
                                    "dst": move.dst, "path": str(path), "log": False})  # fmt: skip
        except Exception as exc:
            self._fail(f"the base copy could not be written: {type(exc).__name__}: {exc}")

    def _thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ------------------------------------------------------------------ boundaries
    def boundary(self) -> int:
        """At a boundary while streaming (every worker): agree on READY (switch now: call
        `switch`), WAIT or FAILED (call `switch`, which fails)."""
        self.boundaries += 1
        late = time.monotonic() - self.started > self.settings.timeout_s
        if not self._began and not self._error and not late:
            self._try_begin()
            if not self._error:
                self._status = WAIT
                return WAIT
        done = self.stage.steps_done - self.base_step  # steps the receiver must replay
        mine = READY
        if self._error or late:
            mine = LAGGED if self._lagged else FAILED
            self._error = self._error or f"not moved within {self.settings.timeout_s:g} s"
        elif self._behind(done) > 1:
            mine = WAIT
        self._status = self._agree(mine)
        return self._status

    def switch(self, layer_lists: Sequence[Sequence[int]]) -> MigrationReport:
        """Take ``layer_lists`` on (every worker, at the boundary `boundary` said READY or
        FAILED at): the receivers load their helpers' copies, all agree, then the layers
        change owner. Returns this worker's report; when not ok nothing changed."""
        t0 = time.perf_counter()
        report = MigrationReport(
            ok=False, moves=self.moves, transfer="streamed", streamer="process"
        )
        mine = self._status if self._status in (READY, LAGGED) else FAILED
        if mine == READY and self.incoming:
            self._adopt(self.stage.steps_done - self.base_step)
            mine = FAILED if self._error else READY
        agreed = self._agree(mine)
        if agreed == READY and self.outgoing:  # the receivers have it all; the helper's
            wait_until(self._progress, self._all_reported, self._deadline)  # word may lag
        self.close()
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

    @property
    def _deadline(self) -> float:
        return self.started + self.settings.timeout_s

    def _hand(self) -> None:
        with self._progress:
            self._handed += 1

    def _all_reported(self) -> bool:
        """Whether the helper said it sent each payload handed to it (or can say no more)."""
        return self._reported >= self._handed or bool(self._error) or not self._courier.alive

    def _adopt(self, done: int) -> None:
        """Wait for the copies to replay ``done`` steps, then load their state into the
        layers built from the base (one copy; on a GPU stage one host-to-device copy)."""
        deadline = self._deadline
        replayed = lambda: bool(self._error) or all(n >= done for n in self._applied.values())  # noqa: E731
        if not wait_until(self._progress, replayed, deadline):
            self._error = f"not moved within {self.settings.timeout_s:g} s"
        if self._error:
            return
        paths = {k: str(p) for k, p in self._finals.items()}
        self._courier.send({"kind": "finish", "move": self.version, "n": done, "paths": paths})
        while not self._final.wait(0.05):
            if self._error or time.monotonic() > deadline:
                self._error = self._error or f"not moved within {self.settings.timeout_s:g} s"
                return
        if len(self._copies) != sum(len(m.layers) for _, m in self.incoming):
            self._error = "the layers built from the base copy are missing"
            return
        for k, move in self.incoming:
            tensors = safetensors.torch.load_file(str(self._finals[k]))
            for i in move.layers:
                slot = self._copies[i]
                ckpt.load_layer_state(i, slot.module, slot.optimizer, tensors)

    def close(self, *, wait: bool = False) -> None:
        """Stop streaming (after the switch, or when the move is dropped): the helper
        drops the move, the shared files go. ``wait`` joins the stage's threads."""
        self.stage.tap_steps(None)
        self._stop.set()
        self._notify.put(None)
        self._courier.detach(self.version)
        for thread in self._threads if wait else []:
            thread.join(timeout=5.0)
        for path in self._files:
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ sending
    def _log_step(self, step: int, slots: list[LayerSlot]) -> None:
        """Before the sender's optimizer step ``step``: copy the outgoing layers'
        gradients and buffers into a free ring slot and tell the helper."""
        held = {slot.index: slot for slot in slots}
        n = step - self.base_step + 1
        for k, move in self.outgoing:
            ring = self._rings[k]
            free = ring.take()
            if free is None or self._fault == "lag":  # the link cannot keep up
                self._lagged = not self._error
                self._fail(LAG_CAUSE)
                self.stage.tap_steps(None)
                return
            tensors: list[torch.Tensor | None] = []
            for i in move.layers:
                module = held[i].module
                tensors += [p.grad for p in module.parameters()]
                tensors += [b for _, b in state_buffers(module)]
            event = ring.write(free, tensors)
            msg = {"kind": "send", "move": self.version, "k": k, "stream": n * PER_STEP + k,
                   "dst": move.dst, "path": str(ring.path), "offset": free * ring.slot_bytes,
                   "nbytes": ring.slot_bytes, "slot": free, "log": True}  # fmt: skip
            self._hand()
            if event is None:
                self._courier.send(msg)
            else:
                self._notify.put((event, msg, ring, free))

    def _publish_loop(self) -> None:
        """A GPU stage's logged steps: once a step's device-to-host copy ended (waiting
        leaves the GIL), into shared memory and on to the helper."""
        while True:
            item = self._notify.get()
            if item is None or self._stop.is_set():
                return
            event, msg, ring, free = item
            event.synchronize()
            ring.publish(free)
            self._courier.send(msg)

    def _pace(self, flag: SharedFlag) -> None:
        """Mirror whether the stage has a send in flight into the helper's flag."""
        try:
            while not self._stop.wait(_POLL_S):
                flag.set(self._busy())
            flag.set(False)
        finally:
            flag.close()

    # ------------------------------------------------------------------ the helper says
    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg["kind"]
        if kind == "address":
            self._address.put(str(msg["address"]))
        elif kind == "sent":
            with self._progress:
                self._sent["bytes"] += msg["bytes"]
                self._sent["chunks"] += msg["chunks"]
                self._sent["yielded_s"] += msg["yielded_s"]
                self._sent["paced_s"] += msg["paced_s"]
                self._sent["base_s"] = max(self._sent["base_s"], msg["base_s"])
                self._reported += 1
                self._progress.notify_all()
            if msg["log"]:
                self._sent["log_bytes"] += msg["bytes"]
                self._rings[int(msg["k"])].give(int(msg["slot"]))
        elif kind == "base":  # build the layers beside the stage's own, off its thread
            try:
                self._build(int(msg["k"]))
            except Exception as exc:
                self._fail(f"{type(exc).__name__}: {exc}")
        elif kind == "applied":
            self._received += msg["bytes"]
            with self._progress:
                self._applied[int(msg["k"])] = int(msg["n"])
                self._progress.notify_all()
        elif kind == "final":
            self._final.set()
        elif kind == "error":
            self._fail(str(msg["error"]))
        elif kind == "died" and not self._stop.is_set():
            self._fail(f"the streaming helper (pid {msg['pid']}) exited (code {msg['code']})")

    def _fail(self, error: str) -> None:
        self._error = self._error or error
        with self._progress:
            self._progress.notify_all()

    def _build(self, k: int) -> None:
        move = self.moves[k]
        path = self._bases[k]
        tensors = safetensors.torch.load_file(str(path))
        path.unlink(missing_ok=True)
        for slot in self.stage.spare_slots(move.layers, tensors):
            self._copies[slot.index] = slot

    def _behind(self, done: int) -> int:
        """How many steps the slowest incoming move's copy lacks of ``done``."""
        with self._progress:
            return max((done - n for n in self._applied.values()), default=0)

    def _agree(self, mine: int) -> int:
        return agree(mine, group=self.group, device=self.device)
