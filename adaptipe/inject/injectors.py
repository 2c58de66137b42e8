"""Injector mechanisms: load-generating child processes and control files.

Every hog is a child process that runs this file as a script (``python -P injectors.py
PAYLOAD``), so it imports only the standard library (numpy or torch only for matmul
loads), starts in tens of milliseconds and adds little memory of its own. Each child
runs in its own session, pins itself to its cores, reports ``ready`` only once its load
is in place (memory touched, CUDA warmed up) and exits within 0.1 s of its parent
process disappearing, so an injected process never outlives the run that started it.
`HogProcesses.stop` ends the children by pid (SIGTERM, then SIGKILL) and reaps them.

Link throttles and slowdowns act inside adaptipe's transport and stage loop, so here they
are only state: one small JSON file per active injection in a control directory, written
atomically and removed when the injection ends. The runtime reads them with
`read_throttles` and `read_slowdowns` (the directory travels in `CONTROL_DIR_ENV`).

Only the standard library is imported at module level: this file is the child's script.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

__all__ = [
    "CONTROL_DIR_ENV",
    "ChildFailed",
    "ControlFile",
    "HogProcesses",
    "Injector",
    "Throttle",
    "read_memory_loads",
    "read_slowdowns",
    "read_throttles",
]

CONTROL_DIR_ENV = "ADAPTIPE_INJECT_DIR"
_PERIOD_S = 0.1  # duty-cycle period of the hogs
_POLL_S = 0.1  # how often a child checks that its parent is alive


class ChildFailed(RuntimeError):
    """An injector's child process died or did not get ready in time."""


class Injector(Protocol):
    @property
    def pids(self) -> tuple[int, ...]: ...
    def start(self) -> None: ...
    def wait_ready(self, timeout_s: float) -> None: ...
    def stop(self) -> None: ...


# ---- child processes ---------------------------------------------------------------------


class HogProcesses:
    """One child process per payload (see `_LOADS` for the payload kinds)."""

    def __init__(self, payloads: Sequence[Mapping[str, Any]], *, grace_s: float = 2.0) -> None:
        self._payloads = [dict(p) for p in payloads]
        self._grace_s = grace_s
        self._procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p, _ in self._procs)

    def start(self) -> None:
        # One-thread BLAS: a matmul hog loads exactly the cores it is pinned to.
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        for payload in self._payloads:
            payload["parent"] = os.getpid()
            errors = tempfile.TemporaryFile()  # noqa: SIM115 (stop() closes it)
            proc = subprocess.Popen(
                # -P: this file's folder must not shadow modules the loads import
                [sys.executable, "-P", os.path.abspath(__file__), json.dumps(payload)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
                env=env,
                start_new_session=True,
            )
            self._procs.append((proc, errors))

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc, errors in self._procs:
            assert proc.stdout is not None
            left = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([proc.stdout], [], [], left)
            line = proc.stdout.readline() if readable else b""
            if line.strip() == b"ready":
                continue
            if readable:  # end of file: the child is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(left, 1.0))
            if proc.poll() is None:
                raise ChildFailed(f"process {proc.pid} was not ready within {timeout_s:g} s")
            errors.seek(0)
            lines = errors.read().decode(errors="replace").strip().splitlines()
            why = f": {lines[-1]}" if lines else ""
            raise ChildFailed(f"process {proc.pid} exited with code {proc.returncode}{why}")

    def stop(self) -> None:
        """Terminate every child by pid, SIGKILL what outlives the grace period, reap all."""
        for proc, _ in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._grace_s
        for proc, errors in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            errors.close()


def _exit_with_parent(parent: int) -> None:
    # Polling, not PR_SET_PDEATHSIG: that fires when the parent *thread* that started the
    # child exits, and injections are started from the runner's timeline thread.
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    os._exit(0)


def _duty_cycle(intensity: float, burst: Callable[[], object]) -> None:
    """Run `burst` for `intensity` of every period and sleep for the rest, forever."""
    while True:
        began = time.monotonic()
        busy_until = began + intensity * _PERIOD_S
        while time.monotonic() < busy_until:
            burst()
        rest = began + _PERIOD_S - time.monotonic()
        if rest > 0:
            time.sleep(rest)


def _spin() -> None:
    x = 0
    for i in range(1000):
        x += i


def _cpu_load(payload: Mapping[str, Any]) -> Callable[[], None]:
    burst: Callable[[], object] = _spin
    if payload["load"] == "matmul":
        import numpy as np

        a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
        burst = lambda: a @ a  # noqa: E731
    return lambda: _duty_cycle(float(payload["intensity"]), burst)


def _gpu_load(payload: Mapping[str, Any]) -> Callable[[], None]:
    import torch

    device = torch.device("cuda", int(payload["device"]))
    size = int(payload["size"])
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    out = torch.empty_like(a)

    def burst() -> None:
        torch.matmul(a, b, out=out)
        torch.cuda.synchronize(device)  # so the duty cycle measures real GPU time

    burst()
    return lambda: _duty_cycle(float(payload["intensity"]), burst)


def _memory_load(payload: Mapping[str, Any]) -> Callable[[], None]:
    size = int(payload["bytes"])
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    held = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    if payload["touch"]:
        chunk = b"\x5a" * (4 << 20)
        for offset in range(0, size, len(chunk)):
            n = min(len(chunk), size - offset)
            held[offset : offset + n] = chunk[:n]

    def hold() -> None:
        while held:
            time.sleep(3600)

    return hold


_LOADS: dict[str, Callable[[Mapping[str, Any]], Callable[[], None]]] = {
    "spin": _cpu_load,
    "matmul": _cpu_load,
    "gpu": _gpu_load,
    "memory": _memory_load,
}


def _child_main(argv: Sequence[str]) -> None:
    payload = json.loads(argv[1])
    parent = int(payload["parent"])
    if os.getppid() != parent:  # the parent died before we got here
        return
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    if payload.get("cores") and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, payload["cores"])
    run = _LOADS[payload["load"]](payload)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    run()


# ---- control files -----------------------------------------------------------------------


class ControlFile:
    """A JSON state file that exists exactly while the injection is active."""

    def __init__(self, path: Path, payload: Mapping[str, Any]) -> None:
        self.path, self._payload = path, dict(payload)

    @property
    def pids(self) -> tuple[int, ...]:
        return ()

    def start(self) -> None:
        from adaptipe.serial import atomic_write_text  # not in the child's script path

        atomic_write_text(self.path, json.dumps(self._payload) + "\n")

    def wait_ready(self, timeout_s: float) -> None:
        return None

    def stop(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class Throttle:
    """What a stage's sends are throttled to; several active throttles on one stage
    combine into the narrowest bandwidth and the sum of the extra latencies."""

    stage: int
    bandwidth_Bps: float = math.inf
    extra_latency_s: float = 0.0

    def delay_s(self, nbytes: int) -> float:
        """The least time a message of `nbytes` takes under this throttle."""
        return self.extra_latency_s + nbytes / self.bandwidth_Bps


def _states(control_dir: str | os.PathLike[str], prefix: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(Path(control_dir).glob(f"{prefix}-*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):  # removed or replaced while we listed the folder
            continue
        if isinstance(state, dict) and isinstance(state.get("stage"), int):
            out.append(state)
    return out


def read_throttles(control_dir: str | os.PathLike[str]) -> dict[int, Throttle]:
    """The link throttles active now, by stage (none when the folder does not exist)."""
    out: dict[int, Throttle] = {}
    for state in _states(control_dir, "throttle"):
        stage = state["stage"]
        old = out.get(stage, Throttle(stage))
        bandwidth = state.get("bandwidth_Bps")
        out[stage] = Throttle(
            stage,
            min(old.bandwidth_Bps, math.inf if bandwidth is None else float(bandwidth)),
            old.extra_latency_s + float(state.get("extra_latency_s", 0.0)),
        )
    return out


def read_slowdowns(control_dir: str | os.PathLike[str]) -> dict[int, float]:
    """The compute slowdown factor active now, by stage (several on one stage multiply)."""
    out: dict[int, float] = {}
    for state in _states(control_dir, "slowdown"):
        out[state["stage"]] = out.get(state["stage"], 1.0) * float(state.get("factor", 1.0))
    return out


def read_memory_loads(control_dir: str | os.PathLike[str]) -> dict[int, list[dict[str, Any]]]:
    """The in-worker memory loads active now, by stage: each its ``origin``, ``mb``
    (the most it holds), ``grow_mb`` (added per window boundary) and ``touch``."""
    out: dict[int, list[dict[str, Any]]] = {}
    for state in _states(control_dir, "memory"):
        out.setdefault(state["stage"], []).append(state)
    return out


if __name__ == "__main__":
    _child_main(sys.argv)
