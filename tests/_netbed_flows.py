"""Traffic for tests/test_netbed.py, run inside a bed's hosts (``Host.popen``).

``sink``: receive TCP connections and/or ZeroMQ PULL messages, each flow named by its
first byte, and print each flow's Mbit/s in each ``--window`` (seconds after the first
byte of any flow) as one JSON line. ``send``: one bulk flow (TCP or ZeroMQ PUSH) with
an optional IP TOS byte, from ``--after`` to ``--seconds`` after it starts.
``listen``/``rtt``: a TCP listener and the median time of a TCP connect to it (one
round trip: SYN out, SYN-ACK back). Every mode prints ``ready`` once it listens and
exits on its own by ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any, NoReturn

CHUNK = 64 * 1024
MESSAGE = 4 * 1024  # a PULL socket counts whole messages: small ones count smoothly


class Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes: dict[str, int] = {}

    def add(self, tag: str, n: int) -> None:
        with self.lock:
            self.bytes[tag] = self.bytes.get(tag, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.bytes)


def _tcp_sink(port: int, counts: Counts) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(8)

    def serve(conn: socket.socket) -> None:
        tag = conn.recv(1).decode()
        while data := conn.recv(CHUNK):
            counts.add(tag, len(data))

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def _zmq_sink(port: int, counts: Counts) -> None:
    import zmq

    pull: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(f"tcp://0.0.0.0:{port}")

    def receive() -> None:
        while True:
            message = pull.recv()
            counts.add(message[:1].decode(), len(message))

    threading.Thread(target=receive, daemon=True).start()


def sink(args: argparse.Namespace) -> dict[str, Any]:
    counts = Counts()
    if args.tcp:
        _tcp_sink(args.tcp, counts)
    if args.zmq:
        _zmq_sink(args.zmq, counts)
    print("ready", flush=True)
    while not counts.snapshot():  # the clock starts at the first byte of any flow
        time.sleep(0.01)
    t0 = time.monotonic()
    windows = []
    for window in args.window:
        start, end = (float(x) for x in window.split(":"))
        time.sleep(max(0.0, t0 + start - time.monotonic()))
        t_start, before = time.monotonic(), counts.snapshot()
        time.sleep(max(0.0, t0 + end - time.monotonic()))
        seconds, after = time.monotonic() - t_start, counts.snapshot()
        got = {tag: after.get(tag, 0) - before.get(tag, 0) for tag in args.tags.split(",")}
        windows.append({tag: n * 8 / seconds / 1e6 for tag, n in got.items()})
    return {"mbit": windows}


def send(args: argparse.Namespace) -> dict[str, Any]:
    payload = args.tag.encode() + b"x" * ((MESSAGE if args.zmq else CHUNK) - 1)
    host, _, port = args.to.rpartition(":")
    end = time.monotonic() + args.seconds
    time.sleep(args.after)
    sent = 0
    if args.zmq:
        import zmq

        push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        if args.tos:
            push.setsockopt(zmq.TOS, args.tos)
        push.setsockopt(zmq.SNDTIMEO, 100)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://{host}:{port}")
        while time.monotonic() < end:
            try:
                push.send(payload)
                sent += len(payload)
            except zmq.Again:
                pass
        push.close()
        return {"sent": sent}
    conn = socket.create_connection((host, int(port)), timeout=5)
    if args.tos:
        conn.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, args.tos)
    conn.settimeout(0.2)
    while time.monotonic() < end:
        try:
            sent += conn.send(payload)
        except TimeoutError:
            pass
        except OSError:  # the sink has its numbers and went away
            break
    conn.close()
    return {"sent": sent}


def listen(args: argparse.Namespace) -> dict[str, Any]:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", args.port))
    server.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        conn.close()


def rtt(args: argparse.Namespace) -> dict[str, Any]:
    host, _, port = args.to.rpartition(":")
    times = []
    for _ in range(args.count):
        start = time.perf_counter()
        with socket.create_connection((host, int(port)), timeout=5):
            times.append(time.perf_counter() - start)
    return {"rtt_ms": statistics.median(times) * 1e3, "all_ms": [t * 1e3 for t in times]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=20.0)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("sink")
    p.add_argument("--tcp", type=int)
    p.add_argument("--zmq", type=int)
    p.add_argument("--tags", required=True, help="the flows to report, e.g. d,l")
    p.add_argument(
        "--window",
        action="append",
        required=True,
        help="START:END seconds after the first byte; Mbit/s of each flow in it",
    )
    p = sub.add_parser("send")
    p.add_argument("--to", required=True, help="HOST:PORT")
    p.add_argument("--zmq", action="store_true")
    p.add_argument("--tag", required=True)
    p.add_argument("--tos", type=lambda s: int(s, 0), default=0)
    p.add_argument("--seconds", type=float, required=True, help="stop this long after start")
    p.add_argument("--after", type=float, default=0.0, help="start sending this much later")
    p = sub.add_parser("listen")
    p.add_argument("--port", type=int, required=True)
    p = sub.add_parser("rtt")
    p.add_argument("--to", required=True, help="HOST:PORT")
    p.add_argument("--count", type=int, default=10)
    args = parser.parse_args()
    # Ends the process on time whatever a socket does (threads are daemons).
    timer = threading.Timer(args.timeout, _exit, args=(3,))
    timer.daemon = True
    timer.start()
    mode = {"sink": sink, "send": send, "listen": listen, "rtt": rtt}[args.mode]
    print(json.dumps(mode(args)), flush=True)
    _exit(0)


def _exit(code: int) -> NoReturn:
    """End now, threads and all (they block on sockets); what was printed is flushed."""
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
