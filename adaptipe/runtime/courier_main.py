"""A worker's streaming helper process (`adaptipe.runtime.courier`).

It does what would otherwise hold the stage's GIL during a streamed move: it sends the
base snapshot and every logged step from shared memory in checked chunks
(`adaptipe.runtime.statestream`), and on a receiving worker it takes the streams in,
checks them and replays each logged step on its own copy of the moving layers with
the optimizer the stage builds, on the stage's device (a CPU replay of a GPU stage's
step would differ in its last bits). At the switch it writes the copy's state to
shared memory for the stage to adopt.

Messages are JSON, one per frame of the socket pair. From the stage: ``hello``, then
per move ``bind``, ``connect``, ``send``, ``expect``, ``finish``, ``end``; ``exit``. To
it: ``ready``, then per move ``address``, ``sent``, ``base``, ``applied``, ``final``,
``error``. Every per-move message names its move; one move runs at a time.
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from adaptipe.runtime.statestream import Pace, StateReceiver, StateSender, StreamTimeout

_PER_STEP = 64  # streamproto.PER_STEP, kept here: the helper imports torch only when needed
_NICE = 10  # a low-priority helper's niceness


class _Move:
    """One move's sockets, threads and copies (built at ``bind``, ended at ``end``)."""

    def __init__(self, helper: _Helper, msg: dict[str, Any]) -> None:
        from adaptipe.monitor.publisher import CurveKeys

        self.helper, self.id = helper, int(msg["move"])
        self.fault: str | None = msg["fault"]
        self.prioritise = bool(msg["prioritise"])
        self.chunk_bytes, self.timeout_s = int(msg["chunk_bytes"]), float(msg["timeout_s"])
        pace = float(msg["pace_Bps"])  # one pace over every move's base
        self.pace = Pace(pace) if pace > 0 else None
        self.stop = threading.Event()
        self.outbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.senders: dict[int, StateSender] = {}
        self.receiver: StateReceiver | None = None
        self.progress = threading.Condition()
        self.applied: dict[int, int] = {}
        self.copies: dict[int, Any] = {}
        self.expect: dict[str, Any] = {}
        self.rings: dict[str, mmap.mmap] = {}
        self.busy: mmap.mmap | None = None
        if msg["busy"]:
            with open(msg["busy"], "r+b") as f:
                self.busy = mmap.mmap(f.fileno(), mmap.PAGESIZE)
        address = ""
        if msg["receive"]:
            curve = None
            if msg["curve"]:
                import zmq

                client_public, _ = zmq.curve_keypair()
                public, secret = msg["curve"]
                curve = CurveKeys(public.encode(), secret.encode(), client_public, None)
            self.receiver = StateReceiver(msg["host"], curve=curve)
            address = self.receiver.address
        self.tell({"kind": "address", "address": address})
        helper.spawn(self._send_loop, "send")

    def tell(self, msg: dict[str, Any]) -> None:
        self.helper.tell({**msg, "move": self.id})

    def fail(self, exc: BaseException) -> None:
        self.tell({"kind": "error", "error": f"{type(exc).__name__}: {exc}"})

    def end(self) -> None:
        self.stop.set()
        self.outbox.put(None)
        with self.progress:
            self.progress.notify_all()

    def on(self, kind: str, msg: dict[str, Any]) -> None:
        if kind == "connect":
            self._connect(msg)
        elif kind == "send":
            self.outbox.put(msg)
        elif kind == "expect":
            self.expect = msg
            self.applied = {int(k): -1 for k in msg["moves"]}
            self.helper.spawn(self._receive_loop, "receive")
        elif kind == "finish":
            self.helper.spawn(lambda: self._finish(msg), "finish")
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _connect(self, msg: dict[str, Any]) -> None:
        from adaptipe.monitor.publisher import CurveKeys

        curve = None
        if msg["curve"]:
            import zmq

            public, secret = zmq.curve_keypair()
            curve = CurveKeys(msg["curve"].encode(), None, public, secret)
        busy = self.busy
        self.senders[int(msg["dst"])] = StateSender(
            msg["address"],
            chunk_bytes=self.chunk_bytes,
            busy=(lambda: busy[0] != 0) if busy is not None else (lambda: False),
            prioritise=self.prioritise,
            idle_cpu=False,  # the whole helper already runs below the stages where it may
            curve=curve,
        )

    def _finish(self, msg: dict[str, Any]) -> None:
        """Write every incoming copy's state once it has replayed ``n`` steps."""
        try:
            deadline = time.monotonic() + self.timeout_s
            with self.progress:
                while any(self.applied[k] < msg["n"] for k in self.applied):
                    if self.stop.is_set() or time.monotonic() > deadline:
                        raise RuntimeError(f"the copies did not reach step {msg['n']}")
                    self.progress.wait(0.5)
            from adaptipe.runtime.replay import save_copy

            for k, path in msg["paths"].items():
                save_copy(self.copies[int(k)], path)
            self.tell({"kind": "final"})
        except Exception as exc:
            self.fail(exc)

    # ------------------------------------------------------------------ sending
    def _send_loop(self) -> None:
        try:
            while True:
                msg = self.outbox.get()
                if msg is None or self.stop.is_set():
                    return
                self._send_one(msg)
        except Exception as exc:  # the move fails at the stage's next boundary
            self.fail(exc)
        finally:
            for sender in self.senders.values():
                sender.close()
            for ring in self.rings.values():
                ring.close()

    def _send_one(self, msg: dict[str, Any]) -> None:
        if msg["log"] and self.fault == "die":
            os._exit(17)  # a drill: the helper dies in the middle of a move
        if self.fault == "raise":
            raise RuntimeError("migration fault injected before sending")
        dst = int(msg["dst"])
        deadline = time.monotonic() + self.timeout_s
        while dst not in self.senders:  # the stage connects at its next boundary
            if self.stop.is_set() or time.monotonic() > deadline:
                return
            time.sleep(0.005)
        if msg["log"]:
            ring = self.rings.get(msg["path"])
            if ring is None:
                with open(msg["path"], "rb") as f:
                    ring = self.rings[msg["path"]] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            a = int(msg["offset"])
            body = ring[a : a + int(msg["nbytes"])]  # a copy: the slot is free once sent
        else:
            with open(msg["path"], "rb") as f:
                body = f.read()
        sent = self.senders[dst].send(
            int(msg["stream"]), body, timeout_s=self.timeout_s, corrupt=self.fault == "corrupt",
            pace=None if msg["log"] else self.pace,
        )  # fmt: skip
        self.tell({"kind": "sent", "k": msg["k"], "slot": msg.get("slot"), "log": msg["log"],
                   "bytes": sent.bytes, "chunks": sent.chunks, "yielded_s": sent.yielded_s,
                   "paced_s": sent.paced_s,
                   "base_s": 0.0 if msg["log"] or self.pace is None else self.pace.span_s})  # fmt: skip

    # ------------------------------------------------------------------ receiving
    def _receive_loop(self) -> None:
        assert self.receiver is not None
        try:
            from adaptipe.runtime.replay import Copy

            moves = {int(k): v for k, v in self.expect["moves"].items()}
            n = 0
            while True:
                for k in sorted(moves):
                    body = self._take(n * _PER_STEP + k)
                    if body is None:
                        return
                    if n == 0:
                        self.copies[k] = Copy.from_base(
                            body, moves[k], self.expect["optimizer"], self.expect["device"]
                        )
                        path = self.expect["bases"][str(k)]
                        with open(path, "wb") as f:
                            f.write(body)  # the stage builds its slots from it meanwhile
                        self.tell({"kind": "base", "k": k, "bytes": len(body)})
                    else:
                        self.copies[k].replay(body)
                    with self.progress:
                        self.applied[k] = n
                        self.progress.notify_all()
                    self.tell({"kind": "applied", "k": k, "n": n, "bytes": len(body)})
                n += 1
        except Exception as exc:
            if not self.stop.is_set():
                self.fail(exc)
        finally:
            self.receiver.close()

    def _take(self, stream: int) -> bytes | None:
        assert self.receiver is not None
        while not self.stop.is_set():
            try:
                return self.receiver.receive(stream, digest=None, timeout_s=0.05)
            except StreamTimeout:
                continue
        return None


class _Helper:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        self.threads, self.device = 1, "cpu"
        self.move: _Move | None = None

    def tell(self, msg: dict[str, Any]) -> None:
        raw = json.dumps(msg).encode()
        with self._lock:
            self.conn.send_bytes(raw)

    def spawn(self, target: Any, name: str) -> None:
        threading.Thread(target=target, name=f"courier-{name}", daemon=True).start()

    def run(self) -> None:
        while True:
            try:
                msg = json.loads(self.conn.recv_bytes())
            except (EOFError, OSError):  # the stage is gone
                break
            kind = msg["kind"]
            if kind == "exit":
                break
            try:
                self._on(kind, msg)
            except Exception as exc:
                self.tell({"kind": "error", "move": msg.get("move"),
                           "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
        if self.move is not None:
            self.move.end()

    def _on(self, kind: str, msg: dict[str, Any]) -> None:
        if kind == "hello":
            if msg["low"]:  # below the stages, never starved (SCHED_IDLE was, measured)
                os.nice(_NICE)
            self.threads, self.device = int(msg["threads"]), str(msg["device"])
            self.spawn(self._warm, "warm")
        elif kind == "bind":
            if self.move is not None:
                self.move.end()
            self.move = _Move(self, msg)
        elif kind == "end":
            if self.move is not None and self.move.id == msg["move"]:
                self.move.end()
                self.move = None
        elif self.move is not None and self.move.id == msg["move"]:
            self.move.on(kind, msg)

    def _warm(self) -> None:
        """Import what a move needs (torch, and what a first optimizer step imports
        lazily: seconds) before any move waits for it."""
        import torch

        from adaptipe.runtime.replay import warm

        torch.set_num_threads(self.threads)
        warm(self.device)
        self.tell({"kind": "ready"})


def header(body: bytes) -> dict[str, Any]:
    """A safetensors payload's header (its ``__metadata__`` included)."""
    (size,) = struct.unpack("<Q", body[:8])
    out: dict[str, Any] = json.loads(body[8 : 8 + size])
    return out


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    _Helper(conn).run()
    conn.close()
    os._exit(0)  # daemon threads may be blocked in a socket; the stage reaps this pid


if __name__ == "__main__":
    main()
