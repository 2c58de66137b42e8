"""`run_children`: run measuring processes at once and gather one answer from each.

Profilers that must measure in separate processes (a link between two pinned
processes, stages profiled side by side) start them with the ``spawn`` method, release
them together through a barrier, and wait for one ``(rank, value)`` from each on a
queue. A child reports a failure as a string instead of a value; one that dies without
an answer, or a silence past ``timeout_s``, is an error at once, and no child outlives
the call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from adaptipe.errors import PlanError

__all__ = ["free_port", "pin_to_core", "run_children"]


def run_children(
    target: Callable[..., None],
    args: Sequence[tuple[Any, ...]],
    *,
    timeout_s: float,
    what: str,
) -> list[Any]:
    """Start ``target(rank, *args[rank], start, out)`` for every rank; return the values.

    ``start`` is a barrier for all the children (wait on it right before measuring) and
    ``out`` the queue to put ``(rank, value)`` on, or ``(rank, "reason")`` on failure.
    """
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(len(args))
    out = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(rank, *a, start, out), daemon=True)
        for rank, a in enumerate(args)
    ]
    for p in procs:
        p.start()
    replies: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(replies) < len(procs):
            try:
                rank, value = out.get(timeout=0.2)
                replies[rank] = value
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in replies and p.exitcode is not None]
            if dead:
                raise PlanError(
                    f"{what}: process {dead[0]} died (exit code {procs[dead[0]].exitcode}) "
                    "without an answer"
                )
            if time.monotonic() > deadline:
                raise PlanError(f"{what}: no answer from the processes in {timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
    for rank, value in sorted(replies.items()):
        if isinstance(value, str):
            raise PlanError(f"{what}: process {rank} failed: {value}")
    return [replies[r] for r in range(len(procs))]


def pin_to_core(rank: int) -> None:
    """Pin this process to one core, the one stage worker ``rank`` takes (threads 1)."""
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def free_port() -> int:
    """A TCP port free on loopback right now (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
