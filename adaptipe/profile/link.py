"""`probe_link`: latency and bandwidth of one pipeline link, measured the way stages talk.

Two processes on this host, pinned to one core each as the stage workers pin themselves
(threads 1), join a ``torch.distributed`` group over loopback (or, between two hosts of
a namespace test bed, over their shaped links) and time echo round trips of tensors
with point-to-point ``send``/``recv``; the one-way ``latency + bytes /
bandwidth`` fit (`probe`, also telemetry's start-up probe) is what the simulator's cost model
takes (``CostModel.from_profile(..., latency_s=, bandwidth_Bps=)``). On gloo this
includes the Python and gloo overheads a real transfer pays at both ends, which on a
small CPU machine are most of a stage boundary's cost (about 0.4 ms per 256 KB transfer
here, against nothing in a model without links).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from adaptipe.errors import PlanError
from adaptipe.profile.children import free_port, pin_to_core, run_children

if TYPE_CHECKING:
    from adaptipe.netbed import Host

__all__ = ["PROBE_SIZES", "ProbeResult", "probe", "probe_link"]

_SIZES = (4 << 10, 256 << 10, 1 << 20)
PROBE_SIZES = (1 << 10, 1 << 16, 1 << 20)  # `probe`'s default


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Round trips per size and the one-way ``latency + size / bandwidth`` fit."""

    sizes: tuple[int, ...]
    rtt_s: tuple[float, ...]  # per size, the repeats reduced (by default the fastest)
    latency_s: float
    bandwidth_Bps: float


def probe(
    send_fn: Callable[[bytes], None],
    recv_fn: Callable[[], object],
    sizes: Sequence[int] = PROBE_SIZES,
    *,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    reduce: Callable[[list[float]], float] = min,
) -> ProbeResult:
    """Time echo round trips of each size and fit latency and bandwidth.

    ``send_fn(payload)`` sends the payload to the peer, which echoes it back;
    ``recv_fn()`` returns when the echo has arrived. Each round trip moves the payload
    twice, so one-way time is half the round trip. ``reduce`` turns a size's repeats
    into one round trip: the fastest (default) is the link's capacity, since
    interference only ever adds time; the median is what a typical transfer costs.
    With one size the latency is taken as 0.
    """
    if not sizes or min(sizes) < 1 or repeats < 1:
        raise PlanError(f"probe needs sizes >= 1 and repeats >= 1 (got {sizes}, {repeats})")
    rtts: list[float] = []
    for size in sizes:
        payload = bytes(size)
        times: list[float] = []
        for _ in range(repeats):
            t0 = clock()
            send_fn(payload)
            recv_fn()
            times.append(clock() - t0)
        rtts.append(reduce(times))
    one_way = [r / 2 for r in rtts]
    if len(set(sizes)) > 1:
        slope, latency = statistics.linear_regression([float(s) for s in sizes], one_way)
    else:
        slope, latency = one_way[0] / sizes[0], 0.0
    if slope <= 0:  # noise swamped the size dependence: report the best observed rate
        slope = min(t / s for s, t in zip(sizes, one_way, strict=True))
    return ProbeResult(
        tuple(sizes), tuple(rtts), max(latency, 0.0), 1.0 / slope if slope > 0 else math.inf
    )


def _side(
    rank: int,
    port: int,
    backend: str,
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    timeout_s: float,
    start: Any,
    out: Any,
) -> None:
    """One end of a loopback link (a `run_children` child)."""
    try:
        pin_to_core(rank)
        result = _measure(
            rank, f"tcp://127.0.0.1:{port}", backend, sizes, repeats, warmup, timeout_s
        )
        out.put((rank, result))
    except BaseException as exc:  # report, never hang the parent
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def _measure(
    rank: int,
    init: str,
    backend: str,
    sizes: Sequence[int],
    repeats: int,
    warmup: int,
    timeout_s: float,
) -> tuple[tuple[int, ...], tuple[float, ...], float, float] | None:
    """One end of the link: rank 0 times round trips and returns the fit, rank 1 echoes
    them (None)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init,
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        bufs = {n: torch.empty(n // 4, dtype=torch.float32, device=device) for n in sizes}
        if rank == 1:  # rank 0 warms every size up, then times every size
            for n, count in [(n, warmup) for n in sizes] + [(n, repeats) for n in sizes]:
                for _ in range(count):
                    dist.recv(bufs[n], 0)
                    dist.send(bufs[n], 0)
            return None
        current: dict[str, int] = {"n": sizes[0]}

        def send(payload: bytes) -> None:
            current["n"] = len(payload)
            dist.send(bufs[len(payload)], 1)

        def recv() -> None:
            dist.recv(bufs[current["n"]], 1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        for n in sizes:  # untimed round trips: connections, allocator, caches
            for _ in range(warmup):
                send(bytes(n))
                recv()
        result = probe(send, recv, sizes, repeats=repeats, reduce=statistics.median)
        return result.sizes, result.rtt_s, result.latency_s, result.bandwidth_Bps
    finally:
        dist.destroy_process_group()


def probe_link(
    *,
    backend: str = "gloo",
    sizes: Sequence[int] = _SIZES,
    repeats: int = 20,
    warmup: int = 3,
    timeout_s: float = 60.0,
    hosts: tuple[Host, Host] | None = None,
) -> ProbeResult:
    """Measure one link between two pinned processes: on loopback (gloo on CPU, or NCCL
    between GPUs 0 and 1), or, with ``hosts``, between two hosts of a namespace test bed
    over their shaped links (gloo); the median round trip per size and the one-way fit."""
    if backend not in ("gloo", "nccl"):
        raise PlanError(f"probe_link: backend must be gloo or nccl (got {backend!r})")
    if not sizes or any(n < 4 or n % 4 for n in sizes) or len(set(sizes)) != len(sizes):
        raise PlanError(
            f"probe_link: sizes must be distinct multiples of 4 bytes (got {list(sizes)})"
        )
    if repeats < 1 or warmup < 0:
        raise PlanError(f"probe_link: repeats >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    if hosts is not None:
        if backend != "gloo":
            raise PlanError("probe_link: between test-bed hosts the backend is gloo (no GPUs)")
        return _between(hosts, backend, tuple(sizes), repeats, warmup, timeout_s)
    args = (free_port(), backend, tuple(sizes), repeats, warmup, timeout_s)
    replies = run_children(_side, [args, args], timeout_s=timeout_s, what="probe_link")
    sizes_out, rtts, latency, bandwidth = replies[0]
    return ProbeResult(tuple(sizes_out), tuple(rtts), float(latency), float(bandwidth))


_PORT = 29431  # the rendezvous on the first host (its namespace has nothing else there)


def _between(
    hosts: tuple[Host, Host],
    backend: str,
    sizes: tuple[int, ...],
    repeats: int,
    warmup: int,
    timeout_s: float,
) -> ProbeResult:
    """The link between two hosts of a test bed (`adaptipe.netbed`): one end on each,
    pinned to its host's cores, gloo on the host's bed interface."""
    import json
    import os
    import subprocess
    import sys

    init = f"tcp://{hosts[0].address}:{_PORT}"
    spec = json.dumps([init, backend, list(sizes), repeats, warmup, timeout_s])
    procs = []
    for rank, host in enumerate(hosts):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": host.interface, "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "adaptipe.profile.link", str(rank), spec]
        procs.append(host.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        raise PlanError(
            f"probe_link: no answer from {hosts[0].namespace} and "
            f"{hosts[1].namespace} in {timeout_s} s"
        ) from None
    finally:
        for p in procs:  # by pid
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise PlanError(f"probe_link: the end on {hosts[rank].namespace} failed: {last[0]}")
    sizes_out, rtts, latency, bandwidth = json.loads(outs[0][0].decode().strip().splitlines()[-1])
    return ProbeResult(tuple(sizes_out), tuple(rtts), float(latency), float(bandwidth))


def _main(argv: Sequence[str]) -> None:
    """``python -m adaptipe.profile.link RANK SPEC``: one end of `_between`, run on its
    host; rank 0 prints the fit as one JSON line."""
    import json

    init, backend, sizes, repeats, warmup, timeout_s = json.loads(argv[1])
    pin_to_core(0)  # the host's first core (the host pins the process to its own cores)
    result = _measure(int(argv[0]), init, backend, sizes, repeats, warmup, timeout_s)
    if result is not None:
        print(json.dumps(result))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
