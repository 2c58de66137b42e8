"""Per-thread CPU from /proc for bench/bench_overhead.py: snapshots of a process and
its children while they run, and the split of each process's CPU between two of them by
thread kind (the manager's and the stages' telemetry threads, training, the rest).

Per thread, ``task/<tid>/schedstat`` gives the time on a CPU in nanoseconds (``stat``'s
utime + stime, the fallback, comes in 10 ms ticks); a process's total, which keeps the
threads that ended, comes from ``stat`` (this process's own from getrusage).
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_monitor import _progress

from adaptipe.monitor.threadname import name_os_thread

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
BENCH_THREAD = "bench-sampler"

# ----------------------------------------------------------------------------- /proc


@dataclass(frozen=True, slots=True)
class ThreadCpu:
    comm: str
    start: int  # clock ticks after boot: a tid reused by a new thread has another
    cpu_s: float


def parse_stat(text: str) -> tuple[str, int, float]:
    """A ``/proc/<pid>[/task/<tid>]/stat`` line: the name (which may hold spaces and
    ')'), the start time in ticks, and utime + stime in seconds (10 ms ticks)."""
    head, _, rest = text.rpartition(")")
    comm = head.split("(", 1)[1]
    fields = rest.split()  # fields[0] is the state, field 3 of stat(5)
    return comm, int(fields[19]), (int(fields[11]) + int(fields[12])) * TICK_S


def parse_schedstat(text: str) -> float:
    """A thread's ``schedstat``: its time on a CPU in seconds (kept in nanoseconds, where
    ``stat``'s utime + stime come in 10 ms ticks)."""
    return int(text.split()[0]) * 1e-9


@dataclass(frozen=True, slots=True)
class ProcCpu:
    cpu_s: float  # the whole process, exited threads included
    threads: Mapping[int, ThreadCpu]


def _thread(pid: int, tid: str) -> ThreadCpu:
    comm, start, cpu_s = parse_stat(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
    with contextlib.suppress(OSError, ValueError, IndexError):  # no schedstats: ticks
        cpu_s = parse_schedstat(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text())
    return ThreadCpu(comm=comm, start=start, cpu_s=cpu_s)


def read_proc(pid: int) -> ProcCpu | None:
    """The process's and its live threads' CPU seconds; None once it has gone. This
    process's own total comes from getrusage (microseconds), another's from its stat."""
    try:
        if pid == os.getpid():
            usage = resource.getrusage(resource.RUSAGE_SELF)
            total = usage.ru_utime + usage.ru_stime
        else:
            total = parse_stat(Path(f"/proc/{pid}/stat").read_text())[2]
        threads = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                threads[int(tid)] = _thread(pid, tid)
            except OSError:  # the thread ended between listing and reading
                continue
    except OSError:
        return None
    return ProcCpu(cpu_s=total, threads=threads)


def children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


@dataclass(frozen=True, slots=True)
class Snapshot:
    time_s: float
    procs: Mapping[int, ProcCpu]  # the manager (this process) and the stages alive


class Sampler:
    """Snapshots of this process and its children every ``interval_s`` (and on `mark`)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s, self.pid = interval_s, os.getpid()
        self.snaps: list[Snapshot] = []
        self.mark_at: int | None = None  # index of the snapshot taken at `mark`
        self.tid = 0
        self._wake, self._stop = threading.Event(), threading.Event()
        self._marked = False
        self._thread = threading.Thread(target=self._run, name=BENCH_THREAD, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)

    def mark(self) -> None:
        """Start the window now (called from the manager's thread: sets a flag, no I/O)."""
        if not self._marked:
            self._marked = True
            self._wake.set()

    def _run(self) -> None:
        name_os_thread(BENCH_THREAD)
        self.tid = threading.get_native_id()
        while not self._stop.is_set():
            pids = [self.pid, *children(self.pid)]
            procs = {pid: p for pid in pids if (p := read_proc(pid)) is not None}
            self.snaps.append(Snapshot(time.time(), procs))
            if self._marked and self.mark_at is None:
                self.mark_at = len(self.snaps) - 1
            self._wake.wait(self.interval_s)
            self._wake.clear()


# ----------------------------------------------------------------------- attribution


def kind(comm: str, *, tid: int, pid: int, manager: bool) -> str:
    """What a thread is, by its tid and OS name (Linux keeps 15 bytes of it)."""
    if comm.startswith("ZMQbg"):
        return "zmq"
    if manager:
        if tid == pid:
            return "main"
        if comm == BENCH_THREAD:
            return "bench"
        if comm.startswith("adaptipe-collec"):
            return "collector"
        return "other"
    if tid == pid:
        return "training"
    if comm.startswith("adaptipe-sample"):
        return "sampler"
    if comm.startswith("adaptipe-l"):
        return "link"
    return "other"


def split(before: ProcCpu | None, after: ProcCpu, *, pid: int, manager: bool) -> dict[str, float]:
    """CPU seconds per thread kind between two readings of one process.

    A thread alive at both counts its difference, one born since counts whole; "exited"
    is the process's difference less its live threads' (threads that ended in between,
    and the part of live ones from before ``before`` for any tid whose start changed).
    """
    out: dict[str, float] = {}
    live = 0.0
    for tid, t in after.threads.items():
        was = before.threads.get(tid) if before is not None else None
        cpu_s = t.cpu_s - (was.cpu_s if was is not None and was.start == t.start else 0.0)
        name = kind(t.comm, tid=tid, pid=pid, manager=manager)
        out[name] = out.get(name, 0.0) + cpu_s
        live += cpu_s
    # can dip below 0 by a tick's rounding where the total comes from stat
    out["exited"] = after.cpu_s - (before.cpu_s if before is not None else 0.0) - live
    return out


def window(snaps: list[Snapshot], mark_at: int, ends: Mapping[int, list[float]]) -> tuple[int, int]:
    """The first and last snapshot of the window: from the mark to the last one taken
    before any stage finished its last iteration (a stage that is shutting down has
    joined its other threads, which would then count as exited)."""
    until = min(e[-1] for e in ends.values())
    inside = [
        i
        for i, s in enumerate(snaps)
        if i >= mark_at and s.time_s < until and ends.keys() <= s.procs.keys()
    ]
    if len(inside) < 2:
        raise RuntimeError(f"fewer than 2 snapshots while every stage trained (from {mark_at})")
    return inside[0], inside[-1]


MONITOR_STAGE = ("sampler", "zmq", "link")
MONITOR_MANAGER = ("collector", "zmq", "exited", "other")


@dataclass(slots=True)
class Account:
    """One run's window: CPU seconds per iteration, per process kind and thread kind."""

    iterations: float
    manager: dict[str, float] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)  # summed over the stages

    def monitor_stage(self) -> float:
        return sum(self.stages.get(k, 0.0) for k in MONITOR_STAGE)

    def training(self) -> float:
        return sum(v for k, v in self.stages.items() if k not in MONITOR_STAGE)

    def monitor_manager(self) -> float:
        """The manager's threads that exist for telemetry and control, its main thread
        and this bench's sampler left out."""
        return sum(self.manager.get(k, 0.0) for k in MONITOR_MANAGER)

    def manager_total(self) -> float:
        return sum(v for k, v in self.manager.items() if k != "bench")


def account(
    snaps: list[Snapshot], first: int, last: int, manager_pid: int, ends: Mapping[int, list[float]]
) -> Account:
    """Attribute the window ``snaps[first] .. snaps[last]``; ``ends`` holds each stage
    process's iteration end times (wall), which give the iterations done in it."""
    s0, s1 = snaps[first], snaps[last]
    done = statistics.mean(_progress(e, s1.time_s) - _progress(e, s0.time_s) for e in ends.values())
    acc = Account(iterations=done)
    for pid, after in s1.procs.items():
        if pid != manager_pid and pid not in ends:
            continue  # a child that is not a stage
        into = acc.manager if pid == manager_pid else acc.stages
        got = split(s0.procs.get(pid), after, pid=pid, manager=pid == manager_pid)
        for k, v in got.items():
            into[k] = into.get(k, 0.0) + v / done
    return acc
