"""Running a job on a namespace test bed, for tests: `adaptipe manage` on one host and
one torchrun stage on each of two others (c10d rendezvous on the head host, which the
hosts' shared host name cannot find: ``is_host``, ``--local-addr`` and the bed
interface for gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from adaptipe.netbed import Host
from adaptipe.runtime.managerinfo import ManagerInfo, read_manager
from adaptipe.runtime.rundir import RunDir


def torchrun_stage(
    host: Host, node: int, head: Host, run_dir: Path, *, port: int
) -> subprocess.Popen[bytes]:
    """One stage on ``host`` (node ``node`` of 2), logging to ``torchrun-NODE.log``."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head.address}:{port}",
        "--rdzv-conf", f"is_host={int(host is head)}",  # the store lives on the head host
        "--local-addr", host.address, "--max-restarts", "0",
        "-m", "adaptipe.runtime.worker", "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": host.interface, "OMP_NUM_THREADS": "1"}
    log = (run_dir / f"torchrun-{node}.log").open("wb")
    return host.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def start_manager(host: Host, run: RunDir, *extra: str) -> subprocess.Popen[bytes]:
    """``adaptipe manage`` on ``host``, bound to its bed address (summary as JSON)."""
    return host.popen(
        [sys.executable, "-m", "adaptipe.cli", "manage", str(run.root), *extra,
         "--bind", host.address, "--no-progress", "--json", "--wait-s", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def wait_marked(
    run: RunDir, manager: subprocess.Popen[bytes], timeout_s: float = 60
) -> ManagerInfo:
    """The manager's record once it has marked itself (its error if it died first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = read_manager(run)
        if info is not None:
            return info
        assert manager.poll() is None, manager.communicate()[1].decode()[-2000:]
        time.sleep(0.05)
    raise AssertionError(f"the manager did not mark itself in {timeout_s} s")
