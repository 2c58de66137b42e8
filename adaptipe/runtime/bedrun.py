"""A prepared run trained across a namespace test bed (`adaptipe.netbed`): ``adaptipe
manage`` on one host and one torchrun node on each of the others, as a cluster runs it.

The hosts share this machine's host name, which the c10d rendezvous cannot tell apart:
the head host says it holds the store (``is_host``), each node names its bed address
(``--local-addr``), and gloo talks over the bed interface (``GLOO_SOCKET_IFNAME``). Used
by the multi-host tests and the benchmarks that run on shaped links.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from adaptipe.netbed import Host
from adaptipe.runtime.managerinfo import ManagerInfo, read_manager
from adaptipe.runtime.rundir import RunDir

__all__ = ["run_on_bed", "start_manager", "torchrun_stage", "wait_marked"]


def torchrun_stage(
    host: Host,
    node: int,
    head: Host,
    run_dir: Path,
    *,
    port: int,
    nodes: int = 2,
    per_node: int = 1,
) -> subprocess.Popen[bytes]:
    """Node ``node`` of ``nodes`` on ``host`` (``per_node`` stages), logging to
    ``RUN_DIR/torchrun-NODE.log``."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--node-rank", str(node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head.address}:{port}",
        "--rdzv-conf", f"is_host={int(host is head)}",  # the store lives on the head host
        "--local-addr", host.address, "--max-restarts", "0",
        "-m", "adaptipe.runtime.worker", "--run-dir", str(run_dir),
    ]  # fmt: skip
    iface = "lo" if per_node > 1 else host.interface  # stages of one host talk on loopback
    env = {**os.environ, "GLOO_SOCKET_IFNAME": iface, "OMP_NUM_THREADS": "1"}
    log = (run_dir / f"torchrun-{node}.log").open("wb")
    return host.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def start_manager(
    host: Host, run: RunDir, *extra: str, wait_s: float = 60.0, stderr: int | None = None
) -> subprocess.Popen[bytes]:
    """``adaptipe manage`` on ``host``, bound to its bed address (its summary as JSON on
    stdout; ``stderr`` defaults to a pipe)."""
    return host.popen(
        [sys.executable, "-m", "adaptipe.cli", "manage", str(run.root), *extra,
         "--bind", host.address, "--no-progress", "--json", "--wait-s", f"{wait_s:g}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE if stderr is None else stderr,
    )  # fmt: skip


def wait_marked(
    run: RunDir, manager: subprocess.Popen[bytes], timeout_s: float = 60
) -> ManagerInfo:
    """The manager's record once it has marked itself (`RuntimeError` with its error
    output if it ended first or did not mark itself in time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = read_manager(run)
        if info is not None:
            return info
        if manager.poll() is not None:
            err = manager.stderr.read().decode(errors="replace") if manager.stderr else ""
            raise RuntimeError(f"the manager ended ({manager.returncode}): {err[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"the manager did not mark itself in {timeout_s:g} s")


def run_on_bed(
    run: RunDir,
    manager_host: Host,
    workers: Sequence[Host],
    *,
    port: int,
    extra: Sequence[str] = (),
    timeout_s: float = 600.0,
) -> None:
    """Train the prepared ``run``: managed from ``manager_host`` (with ``extra``
    arguments, e.g. ``--inject SCENARIO``), one torchrun node per host of ``workers``
    (the run's stages spread evenly over them). Its log goes to ``RUN_DIR/manager.log``.
    Every process this starts is ended (by pid) before it returns; `RuntimeError` when
    one failed."""
    stages = run.read_schedule().num_stages
    if stages % len(workers):
        raise ValueError(f"{stages} stages do not spread evenly over {len(workers)} hosts")
    with (run.root / "manager.log").open("wb") as log:
        manager = start_manager(manager_host, run, *extra, wait_s=120.0, stderr=log.fileno())
    procs = [manager]
    try:
        wait_marked(run, manager)
        head = workers[0]
        for node, host in enumerate(workers):
            procs.append(
                torchrun_stage(
                    host, node, head, run.root, port=port, nodes=len(workers),
                    per_node=stages // len(workers),
                )
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if codes != [0] * len(procs):
            err = (run.root / "manager.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{run.root}: the run ended with {codes}: {err}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # by pid: this function's own processes
                proc.wait()
