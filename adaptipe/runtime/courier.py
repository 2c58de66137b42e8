"""The stage's side of its streaming helper process (`adaptipe.runtime.courier_main`).

A streamed move through the helper (`adaptipe.runtime.courier_move`) keeps the stage's
interpreter out of the streaming work: chunking, hashing, sending, receiving, checking
and the receiver's replayed optimizer steps run in a helper process of their own, so
they never hold the stage's GIL. One helper serves a worker for its whole life: it is
started with the worker (a fresh interpreter that imports torch takes seconds, which no
move should wait for) and reaped by its pid when the worker ends or the helper dies.

The stage and its helper share state through files in ``/dev/shm`` (the base snapshot,
a ring of gradient-log slots, the final copy) and talk over a socket pair in small
JSON messages, each tagged with its move. Nothing is unpickled on either side.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from adaptipe.runtime.streamproto import state_buffers

__all__ = ["Courier", "LogRing", "SharedFlag", "log_entries", "shm_path"]

_ALIGN = 64


def shm_path(tag: str) -> Path:
    """A fresh file name in shared memory (``/dev/shm``, else the temporary folder)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"adaptipe-{os.getpid()}-{tag}-{uuid.uuid4().hex[:8]}"


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


Handler = Callable[[dict[str, Any]], None]


class Courier:
    """A worker's helper process and the thread that reads its messages: ``ready`` is
    set once the helper has imported what a move needs; each message goes to the
    handler `attach` gave for its move (``{"kind": "died", ...}`` to the current one if
    the helper goes away, and `alive` turns false)."""

    def __init__(self, *, low: bool, threads: int, device: str = "cpu") -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adaptipe.runtime.courier_main", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.pid = self.proc.pid
        self.ready = threading.Event()
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._move: int | None = None
        self._handler: Handler = lambda msg: None
        self._closed = False
        self._dead = False
        self.send({"kind": "hello", "low": low, "threads": threads, "device": device})
        self._reader = threading.Thread(target=self._read, name="courier-read", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._dead and not self._closed

    def attach(self, move: int, handler: Handler) -> None:
        """Route the messages of ``move`` to ``handler`` (any other move's are dropped)."""
        with self._lock:
            self._move, self._handler = move, handler
        if self._dead:
            handler({"kind": "died", "pid": self.pid, "code": self.proc.poll()})

    def detach(self, move: int) -> None:
        """``move`` is over: tell the helper to drop it and stop routing its messages."""
        with self._lock:
            if self._move == move:
                self._move, self._handler = None, lambda msg: None
        self.send({"kind": "end", "move": move})

    def send(self, msg: dict[str, Any]) -> bool:
        """Send ``msg`` to the helper (False: it is gone; its reader says why)."""
        raw = json.dumps(msg).encode()
        try:
            with self._lock:
                self._conn.send_bytes(raw)
            return True
        except (OSError, ValueError):
            return False

    def _read(self) -> None:
        while True:
            try:
                msg = json.loads(self._conn.recv_bytes())
            except (EOFError, OSError, ValueError):
                break
            if msg.get("kind") == "ready":
                self.ready.set()
                continue
            with self._lock:
                handler = self._handler if msg.get("move") == self._move else None
            if handler is not None:
                handler(msg)
        self._dead = True
        if not self._closed:
            try:
                code = self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                code = None
            with self._lock:
                handler = self._handler
            handler({"kind": "died", "pid": self.pid, "code": code})

    def close(self, *, wait_s: float = 5.0) -> None:
        """Ask the helper to exit and reap it (by its pid, killed if it will not go)."""
        if self._closed:
            return
        self._closed = True
        self.send({"kind": "exit"})
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=wait_s)
        self._conn.close()


class SharedFlag:
    """One byte in shared memory: whether the stage has a send in flight (the helper's
    chunks yield while it is set)."""

    def __init__(self) -> None:
        self.path = shm_path("busy")
        with open(self.path, "wb") as f:
            f.write(b"\0" * mmap.PAGESIZE)
        with open(self.path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), mmap.PAGESIZE)

    def set(self, on: bool) -> None:
        self._mm[0] = 1 if on else 0

    def close(self) -> None:
        self._mm.close()
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class _Group:
    dtype: torch.dtype
    offset: int  # bytes from the slot's start
    numel: int
    members: tuple[int, ...]  # entry positions, in order


def log_entries(layers: Sequence[int], modules: Sequence[torch.nn.Module]) -> list[list[Any]]:
    """What one logged step holds for ``layers`` (their ``modules``): every parameter's
    gradient, then the state buffers, as ``[key, dtype, shape]`` (the helper and the
    receiver read a step's bytes with it)."""
    out: list[list[Any]] = []
    for i, module in zip(layers, modules, strict=True):
        for name, p in module.named_parameters():
            out.append([f"{i}/grad/{name}", str(p.dtype).removeprefix("torch."), list(p.shape)])
        for name, b in state_buffers(module):
            out.append([f"{i}/buffer/{name}", str(b.dtype).removeprefix("torch."), list(b.shape)])
    return out


def layout(entries: Sequence[Sequence[Any]]) -> tuple[int, list[_Group]]:
    """A step's slot: a presence byte per entry, then one flat run per dtype (entries in
    order within it), each aligned. Returns (slot bytes, groups)."""
    order: dict[str, list[int]] = {}
    for pos, (_, dtype, _) in enumerate(entries):
        order.setdefault(dtype, []).append(pos)
    offset, groups = _align(len(entries)), []
    for dtype_name, members in order.items():
        dtype = getattr(torch, dtype_name)
        numel = sum(_numel(entries[m][2]) for m in members)
        groups.append(_Group(dtype, offset, numel, tuple(members)))
        offset += _align(numel * torch.empty((), dtype=dtype).element_size())
    return offset, groups


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class LogRing:
    """The sender's gradient-log slots for one move, in shared memory: the stage writes
    a step into a free slot (a stage on a GPU through a pinned buffer, off its stream),
    the helper sends it and frees it. Out of free slots: the link cannot keep up."""

    def __init__(self, entries: Sequence[Sequence[Any]], slots: int, device: torch.device) -> None:
        self.entries = [list(e) for e in entries]
        self.slot_bytes, self.groups = layout(self.entries)
        self.path = shm_path("log")
        size = max(self.slot_bytes * slots, 1)
        with open(self.path, "wb") as f:
            f.truncate(size)
        self.shared = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
        self.free: deque[int] = deque(range(slots))
        self._lock = threading.Lock()
        self.cuda = device.type == "cuda"
        self.staging = (
            torch.empty(size, dtype=torch.uint8, pin_memory=True) if self.cuda else self.shared
        )
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]

    def take(self) -> int | None:
        with self._lock:
            return self.free.popleft() if self.free else None

    def give(self, slot: int) -> None:
        with self._lock:
            self.free.append(slot)

    def write(self, slot: int, tensors: Sequence[Tensor | None]) -> Any:
        """Copy one step's ``tensors`` (in entry order; None: no gradient) into ``slot``.
        On a CPU stage the copy lands in shared memory now and None is returned; on a
        GPU it is queued on a side stream into pinned memory and the CUDA event that
        marks its end is returned (`publish` after it)."""
        base = slot * self.slot_bytes
        mask = torch.tensor([t is not None for t in tensors], dtype=torch.uint8)
        self.staging[base : base + len(tensors)].copy_(mask)
        flats = []
        for group in self.groups:
            parts = []
            for m in group.members:
                t = tensors[m]
                if t is None:
                    t = torch.zeros(self.entries[m][2], dtype=group.dtype, device=_device(tensors))
                parts.append(t.detach().reshape(-1))
            start = base + group.offset
            nbytes = group.numel * parts[0].element_size() if parts else 0
            target = self.staging[start : start + nbytes].view(group.dtype)
            if not self.cuda:
                torch.cat(parts, out=target)
            else:  # one device copy on the stage's stream, the D2H on the side stream
                flats.append((torch.cat(parts), target))
        if not self.cuda:
            return None
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for flat, target in flats:
                target.copy_(flat, non_blocking=True)
                flat.record_stream(self.stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return event

    def publish(self, slot: int) -> None:
        """After the D2H copy of ``slot`` ended: the pinned bytes into shared memory."""
        if self.cuda:
            a, b = slot * self.slot_bytes, (slot + 1) * self.slot_bytes
            self.shared[a:b].copy_(self.staging[a:b])

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def _device(tensors: Sequence[Tensor | None]) -> torch.device:
    for t in tensors:
        if t is not None:
            return t.device
    return torch.device("cpu")
