"""A stage worker's process set-up: who it is, its cores, its device, its process group.

Each worker resolves its own host's facts (cores it may use, GPUs, stages on this host
from torchrun's ``LOCAL_WORLD_SIZE``), so workers started by torchrun on other hosts
resolve theirs; the run config carries only what the user asked for.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.host import resolve_backend, stages_per_host, this_host

__all__ = [
    "EXIT_RESTART",
    "MANAGER_ENV",
    "Process",
    "backend",
    "die_with_parent",
    "init_group",
    "pin_threads",
    "place",
]

EXIT_RESTART = 75
"""A worker's exit status when it stopped to be started again on a new partition
(``[adapt] method = "restart"``); the manager starts the workers again, resuming."""

MANAGER_ENV = "ADAPTIPE_MANAGER"
"""Set by `adaptipe train`'s manager for the workers it starts (absent under torchrun)."""


@dataclass(frozen=True, slots=True)
class Process:
    """This worker's place in the job, from the ``torch.distributed`` environment."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    @classmethod
    def from_env(cls) -> Process:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        return cls(
            rank=rank,
            world=world,
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        )


def pin_threads(local_rank: int, local_world: int, threads: int | None) -> int:
    """Give this worker its share of the cores and set torch's thread count to match."""
    cores = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    n = threads or max(1, len(cores) // max(local_world, 1))
    mine = {cores[(local_rank * n + k) % len(cores)] for k in range(n)}
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, mine)
    torch.set_num_threads(n)
    return n


def place(config: RunConfig, local_rank: int) -> torch.device:
    """This worker's device: "cuda" puts stage r on GPU r (several per GPU when there are
    fewer GPUs; gloo only)."""
    dev = torch.device(config.train.device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return dev


def backend(config: RunConfig, device: torch.device) -> str:
    """The config's backend, ``auto`` resolved on this host (`adaptipe.runtime.host`)."""
    host = this_host()
    local = stages_per_host(int(os.environ.get("WORLD_SIZE", "1")), host.local_world_size)
    gpus = host.gpus if device.type == "cuda" else 0
    return resolve_backend(config.train.backend, config.train.device, local, gpus)


def init_group(config: RunConfig, proc: Process, device: torch.device) -> None:
    """Join the process group (every worker of the run calls this)."""
    dist.init_process_group(
        backend(config, device),
        rank=proc.rank,
        world_size=proc.world,
        timeout=timedelta(seconds=config.train.timeout_s),
    )


def die_with_parent() -> None:
    """Linux: get SIGTERM when the process that started this worker (the manager) dies,
    even by SIGKILL, so no stage trains on with nobody reading its metrics."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util
    import signal

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return  # best effort: the manager's cleanup still ends the workers it can
    manager = os.environ.get(MANAGER_ENV, "")
    if manager.isdigit() and os.getppid() != int(manager):  # it died before the request
        raise SystemExit("the manager that started this worker has exited")
