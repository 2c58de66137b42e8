"""The stage worker processes of one launch: start them, stop them, say why one died.

Workers run as child processes on loopback (a fresh port each launch), each in its own
session, so they are stopped by process id and process group, never by name. SIGTERM to
the manager becomes `Terminated`, so the cleanup that ends them runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import adaptipe
import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import AdaptipeError
from adaptipe.inject.injectors import CONTROL_DIR_ENV
from adaptipe.profile.children import free_port
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.worker import MANAGER_ENV, TELEMETRY_ENV, TELEMETRY_INTERVAL_ENV
from adaptipe.schedule.replicate import ReplicaLayout

__all__ = [
    "LocalWorkers",
    "StageFailed",
    "Terminated",
    "Workers",
    "failure",
    "resume_hint",
    "sigterm_raises",
    "spawn",
    "stop",
]

_KILL_GRACE_S = 3.0


class Terminated(KeyboardInterrupt):
    """``adaptipe train`` got SIGTERM (``kill``, ``timeout``, a batch scheduler): it stops
    its stage processes as on Ctrl-C before it exits."""


class StageFailed(AdaptipeError, RuntimeError):
    """A stage worker died; the message names the stage and the cause."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into `Terminated` while training (main thread only), so the cleanup
    that ends the stage processes runs; the default action would orphan them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated("terminated (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def spawn(
    run: RunDir,
    stages: int,
    *,
    resume: bool,
    telemetry: str | None,
    telemetry_interval_s: float = 0.5,
    control_dir: Path | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start one worker per stage on this host, each logging into the run directory."""
    port = free_port()
    # Workers import exactly the adaptipe this manager imported (a checkout, a link tree
    # or site-packages), whatever their working directory.
    package_root = str(Path(adaptipe.__file__).parent.parent)
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(stages):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(stages),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(stages),
            PYTHONPATH=pythonpath,
            **(
                {TELEMETRY_ENV: telemetry, TELEMETRY_INTERVAL_ENV: str(telemetry_interval_s)}
                if telemetry
                else {}
            ),
            **({CONTROL_DIR_ENV: str(control_dir)} if control_dir else {}),
            **{MANAGER_ENV: str(os.getpid())},  # a manager decides halvings; it is this one
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        )
        cmd = [sys.executable, "-m", "adaptipe.runtime.worker", "--run-dir", str(run.root)]
        if resume:
            cmd.append("--resume")
        with run.log(rank).open("ab") as log:
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    return procs


class Workers(Protocol):
    """A launch's stage workers, as the manager follows them."""

    def codes(self) -> list[int | None]:
        """Each stage's exit status (None: still running; `EXIT_RESTART`: restarting)."""
        ...

    def respawn(self) -> None:
        """Start every stage again, resuming (``[adapt] method = "restart"``)."""
        ...

    def stop(self) -> None:
        """End the workers still running (the run is over or failed)."""
        ...


class LocalWorkers:
    """Workers this manager started (`spawn`); ``restart`` starts them again, resuming.
    ``procs`` is changed in place, so whoever holds it (a scenario) sees the new ones."""

    def __init__(
        self,
        procs: list[subprocess.Popen[bytes]],
        restart: Callable[[], list[subprocess.Popen[bytes]]],
    ) -> None:
        self.procs, self._restart = procs, restart

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def respawn(self) -> None:
        self.procs[:] = self._restart()

    def stop(self) -> None:
        stop(self.procs)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate every worker still running (by pid and process group), then kill."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def failure(run: RunDir, stage: int, code: int | None) -> StageFailed:
    """The error for a worker that exited with `code`: the cause it recorded, else how it
    ended, with its log and how to resume."""
    deadline = time.monotonic() + 1.0
    cause = run.read_error(stage)
    while cause is None and time.monotonic() < deadline:
        time.sleep(0.05)
        cause = run.read_error(stage)
    if cause is None:
        if code is not None and code < 0:
            cause = f"killed by signal {signal.Signals(-code).name}"
        else:
            cause = f"exited with status {code}"
    resume = f"; {resume_hint(run)}" if ckpt.latest(run.checkpoints) else ""
    return StageFailed(
        f"{_worker_name(run, stage)} failed: {cause} (log: {run.log(stage)}){resume}"
    )


def _worker_name(run: RunDir, rank: int) -> str:
    """``stage N``, or for a replica beyond the first ``stage N replica K (rank R)``."""
    try:
        replicas = run.read_partition().replicas
        layout = ReplicaLayout.of(replicas, run.read_schedule().num_stages)
    except (OSError, ValueError):  # no plans to read: name the rank
        return f"stage {rank}"
    if rank < layout.num_stages or rank >= layout.world:
        return f"stage {rank}"
    stage, replica = layout.place(rank)
    return f"stage {stage} replica {replica} (rank {rank})"


def resume_hint(run: RunDir) -> str:
    """How to go on after a run stopped: resume from its last checkpoint, or start afresh."""
    last = ckpt.latest(run.checkpoints)
    if last is None:
        return f"no checkpoint in {run.root} yet: a new `adaptipe train` starts afresh"
    return f"resume from {last} with `adaptipe train --resume {run.root}`"
