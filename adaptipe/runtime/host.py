"""What a run needs to know about the host it runs on: cores, GPUs, stages per host.

A config file says what to run; whether this host can run it, and the values that
depend on the host (``threads_per_stage`` left unset, ``backend = "auto"``), are decided
here. `this_host` is the one function that asks the machine; everything else takes its
`HostFacts`, so ``adaptipe train`` checks a config against the host that starts the
processes and a worker (under torchrun, on another host) against its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from adaptipe.errors import PlanError

if TYPE_CHECKING:
    from adaptipe.runtime.config import RunConfig

__all__ = [
    "HostFacts",
    "default_threads",
    "fit_to_host",
    "own_gpus",
    "resolve_backend",
    "stages_per_host",
    "this_host",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class HostFacts:
    """Args:
    cores: CPU cores this process may run on (None where the OS cannot say).
    gpus: CUDA devices torch sees (0 when ``torch.cuda.is_available()`` is false).
    local_world_size: torchrun's LOCAL_WORLD_SIZE (None when unset: ``adaptipe train``
        runs every stage on this host).
    """

    cores: int | None
    gpus: int
    local_world_size: int | None = None


def this_host() -> HostFacts:
    """This process's host, as `HostFacts` (the only function here that asks the machine)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    local_world = int(local) if local.isdigit() and int(local) > 0 else None
    return HostFacts(cores=cores, gpus=gpus, local_world_size=local_world)


def stages_per_host(stages: int, local_world_size: int | None) -> int:
    """Stages on this host: torchrun's LOCAL_WORLD_SIZE, else all (`adaptipe train`)."""
    return min(stages, local_world_size) if local_world_size else stages


def default_threads(cores: int | None, stages: int) -> int:
    """One process per stage shares the machine's cores unless told otherwise."""
    return max(1, (cores or 1) // stages)


def own_gpus(device: str, local_stages: int, gpus: int) -> bool:
    """Whether each of `local_stages` stages on `device` gets a GPU of its own."""
    return local_stages == 1 or (device == "cuda" and local_stages <= gpus)


def resolve_backend(backend: str, device: str, local_stages: int, gpus: int) -> str:
    """``auto``: NCCL when every stage on this host has a GPU of its own, else gloo."""
    if backend != "auto":
        return backend
    cuda = device.startswith("cuda")
    return "nccl" if cuda and own_gpus(device, local_stages, gpus) else "gloo"


def fit_to_host(config: RunConfig, host: HostFacts) -> RunConfig:
    """`config` checked against `host`, with what depends on the host filled in.

    Raises `PlanError` naming the file and field when ``[train].device`` names a GPU the
    host lacks, or ``backend = "nccl"`` would put two stages on one GPU. Fills in an
    unset ``threads_per_stage`` (cores // stages) and resolves ``backend = "auto"``.
    Applying it again with the same facts changes nothing.
    """
    train, stages = config.train, config.pipeline.processes  # a replica is a process too
    device, backend, count = train.device, train.backend, host.gpus
    where = f"{config.source}: [train]"
    if device.startswith("cuda") and int(device.partition(":")[2] or 0) >= count:
        why = "torch.cuda.is_available() is false" if not count else f"torch sees {count} devices"
        allowed = f"cpu, cuda, cuda:0..cuda:{count - 1}" if count else "cpu"
        raise PlanError(f"{where}.device is {device!r} but {why} (allowed here: {allowed})")
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so it needs a GPU per
    # stage: device "cuda" gives stage r cuda:(local rank). Gloo moves CUDA tensors
    # through host memory, so any number of stages may share GPUs (`P2PTransport`).
    local = stages_per_host(stages, host.local_world_size)
    if backend == "nccl" and local > 1 and not own_gpus(device, local, count):
        shared = (
            f"all {local} stages would share {device}"
            if device != "cuda"
            else f"{local} stages on this host but torch sees {count} GPU{'s' * (count != 1)}"
        )
        raise PlanError(
            f"{where}.backend 'nccl' needs one GPU per stage ({shared}; NCCL refuses two "
            "ranks on one GPU); use backend 'gloo', which moves activations through host "
            "memory, or 'auto' (on several hosts, LOCAL_WORLD_SIZE gives the stages per "
            "host, as torchrun sets)"
        )
    threads = train.threads_per_stage or default_threads(host.cores, stages)
    fitted = replace(
        train, threads_per_stage=threads, backend=resolve_backend(backend, device, local, count)
    )
    return config if fitted == train else replace(config, train=fitted)
