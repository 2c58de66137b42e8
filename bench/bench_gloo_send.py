"""What a gloo send's completion time measures: the link, or the receiver's readiness.

`adaptipe.monitor.bandwidth.LinkWatcher` times each activation or gradient send from
its post to its completion, and the controllers price stage boundaries at the
bandwidth that gives. On this 2-core machine it read loopback at 20-80 MB/s in a
pipeline (docs/telemetry.md). This bench times one 128 KB ``isend`` between two
processes on loopback, by a watcher thread as the runtime does, under three receivers:

- ``posted``: the receive is posted before the send, the receiver then waits;
- ``posted_busy``: posted before, then both sides compute for ``--busy-ms`` (one
  thread each, as the stages do), the receiver waiting after;
- ``posted_late``: the receiver computes for ``--busy-ms`` first and posts the receive
  after.

Session 19 (this 2-core machine, nothing else running): 860, 560 and 6.4 MB/s (0.15,
0.23 and 20.6 ms). A gloo send completes only once the matching receive is posted, so a
receive posted late (the transport posts a bounded number ahead) is counted as link
time.

Prints one JSON object.

    python bench/bench_gloo_send.py [--sends 40] [--busy-ms 20] [--bytes 131072]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = ("posted", "posted_busy", "posted_late")


def _spin(seconds: float) -> None:
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = a @ a
        a = a / a.norm()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rank: int, case: str, port: int, args: dict[str, Any], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    busy = args["busy_ms"] / 1e3
    x = torch.ones(args["bytes"] // 4)
    times: list[float] = []
    pending: queue.SimpleQueue[tuple[Any, float] | None] = queue.SimpleQueue()

    def watch() -> None:  # the runtime's LinkWatcher, reduced: wait, read the clock
        while (item := pending.get()) is not None:
            item[0].wait()
            times.append(time.perf_counter() - item[1])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for it in range(args["sends"]):
        if rank == 0:
            pending.put((dist.isend(x, 1, tag=it), time.perf_counter()))
            if case == "posted":
                time.sleep(busy)
            else:
                _spin(busy)
        else:
            buf = torch.empty_like(x)
            if case == "posted_late":
                _spin(busy)
            work = dist.irecv(buf, 0, tag=it)
            if case == "posted_busy":
                _spin(busy)
            work.wait()
        dist.barrier()
    pending.put(None)
    watcher.join()
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sends", type=int, default=40)
    parser.add_argument("--busy-ms", type=float, default=20.0)
    parser.add_argument("--bytes", type=int, default=131072)
    args = vars(parser.parse_args())
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {"bytes": args["bytes"], "busy_ms": args["busy_ms"], "cases": {}}
    for case in CASES:
        out = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_run, args=(r, case, port, args, out)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            times = out.get(timeout=120)[5:]  # the first sends set the connection up
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        median = statistics.median(times)
        result["cases"][case] = {
            "median_ms": round(median * 1e3, 3),
            "bandwidth_MBps": round(args["bytes"] / median / 1e6, 1),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
