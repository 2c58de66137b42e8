"""Stage worker process: ``python -m adaptipe.runtime.worker --run-dir DIR``.

Reads the plans the manager wrote into the run directory (resolved config, partition,
schedule), joins the process group from the usual ``torch.distributed`` environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``), so the
same entry point runs under ``adaptipe train`` on one machine and under ``torchrun``
across hosts, and executes its instruction list iteration after iteration.

On any error the worker writes ``errors/stage-N.txt`` (first line: the cause) before
exiting non-zero, so the manager can name the stage and the cause.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.models import ModelSpec, get_model
from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.data import BatchStream, loss_scale, split_microbatches
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.stage import LayerSlot, StageExecutor
from adaptipe.runtime.transport import P2PTransport, TensorSpec, recv_spec, send_spec
from adaptipe.schedule.types import Schedule

__all__ = ["FAULT_ENV", "InjectedFault", "main", "run_worker"]

FAULT_ENV = "ADAPTIPE_INJECT_FAULT"
"""``STAGE:ITERATION``: that stage raises `InjectedFault` when it reaches that iteration.
A drill for fault handling (tests, rehearsals); scenario-driven injection builds on it."""


class InjectedFault(RuntimeError):
    """Raised on purpose by a worker named in ``ADAPTIPE_INJECT_FAULT``."""


def _injected_fault(rank: int) -> int | None:
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    stage, sep, iteration = value.partition(":")
    if not sep or not stage.isdigit() or not iteration.isdigit():
        raise ValueError(f"{FAULT_ENV}={value!r} must look like STAGE:ITERATION (e.g. 1:5)")
    return int(iteration) if int(stage) == rank else None


def _pin_threads(local_rank: int, local_world: int, threads: int | None) -> int:
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


def _device(config: RunConfig, local_rank: int) -> torch.device:
    dev = torch.device(config.train.device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return dev


def _backend(config: RunConfig, device: torch.device) -> str:
    if config.train.backend != "auto":
        return config.train.backend
    return "nccl" if device.type == "cuda" else "gloo"


def _negotiate_shapes(
    chunks: list[list[LayerSlot]],
    schedule: Schedule,
    rank: int,
    first_input: TensorSpec | None,
    device: torch.device,
) -> dict[int, TensorSpec]:
    """Pass boundary shapes down the pipeline; each worker infers its chunks' outputs.

    The output of a chunk is found by running its real layers once, without autograd,
    on a zero input of the negotiated shape (zeros are valid token ids too). That is
    exact for the device and dtype in use, and costs one micro-batch forward.
    """
    out: dict[int, TensorSpec] = {}
    last = schedule.num_virtual_stages - 1
    for chunk, slots in enumerate(chunks):
        g = schedule.vstage(rank, chunk)
        if g == 0:
            assert first_input is not None
            in_spec = first_input
        else:
            in_spec = recv_spec(schedule.place(g - 1)[0])
            out[g] = in_spec
        if g < last:
            with torch.no_grad():
                y = torch.zeros(in_spec.shape, dtype=in_spec.dtype, device=device)
                for slot in slots:
                    y = slot.module(y)
            out_spec = TensorSpec(tuple(y.shape), y.dtype)
            send_spec(out_spec, schedule.place(g + 1)[0])
            out[g + 1] = out_spec
    return out


def _build_chunks(
    spec: ModelSpec,
    partition: Partition,
    schedule: Schedule,
    rank: int,
    config: RunConfig,
    device: torch.device,
) -> list[list[LayerSlot]]:
    chunks: list[list[LayerSlot]] = []
    for chunk in range(schedule.num_chunks):
        slots = []
        for i in partition.layers(schedule.vstage(rank, chunk)):
            module = spec.build_layer(i, seed=config.train.seed, device=device)
            params = list(module.parameters())
            slots.append(LayerSlot(i, module, config.optimizer.build(params) if params else None))
        chunks.append(slots)
    return chunks


def _save_checkpoint(
    run: RunDir,
    executor: StageExecutor,
    *,
    iteration: int,
    rank: int,
    world: int,
    config: RunConfig,
    num_layers: int,
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for slot in executor.slots():
        tensors.update(ckpt.layer_state(slot.index, slot.module, slot.optimizer))
    meta: dict[str, Any] = {
        "iteration": iteration,
        "stage": rank,
        "layers": [s.index for s in executor.slots()],
    }
    directory = run.checkpoint_dir(iteration)
    ckpt.save_stage(directory, stage=rank, tensors=tensors, meta=meta)
    dist.barrier()
    if rank == 0:
        ckpt.commit(
            run.checkpoints,
            iteration=iteration,
            num_stages=world,
            meta={
                "model": config.model.name,
                "model_config": dict(config.model.config),
                "num_layers": num_layers,
                "steps": executor.steps_done,
            },
        )
        if config.train.keep_checkpoints > 0:
            ckpt.prune(run.checkpoints, keep=config.train.keep_checkpoints)
    dist.barrier()


def run_worker(run_dir: Path, *, resume: bool) -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    run = RunDir(run_dir)
    config = run.read_config()
    partition = run.read_partition()
    schedule = run.read_schedule()
    if schedule.num_stages != world:
        raise RuntimeError(f"schedule has {schedule.num_stages} stages but WORLD_SIZE={world}")
    threads = _pin_threads(local_rank, local_world, config.train.threads_per_stage)
    device = _device(config, local_rank)
    dist.init_process_group(
        _backend(config, device),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=config.train.timeout_s),
    )
    try:
        _train(
            run,
            config,
            partition,
            schedule,
            rank=rank,
            world=world,
            device=device,
            threads=threads,
            resume=resume,
        )
    finally:
        dist.destroy_process_group()


def _train(
    run: RunDir,
    config: RunConfig,
    partition: Partition,
    schedule: Schedule,
    *,
    rank: int,
    world: int,
    device: torch.device,
    threads: int,
    resume: bool,
) -> None:
    spec = get_model(config.model.name, **config.model.config)
    chunks = _build_chunks(spec, partition, schedule, rank, config, device)
    start = 0
    steps = 0
    if resume:
        found = ckpt.latest(run.checkpoints)
        if found is not None:
            tensors, meta = ckpt.load(found)
            ckpt.check_compatible(
                meta,
                model=spec.name,
                model_config=dict(spec.config),
                num_layers=spec.num_layers,
                source=str(found),
            )
            for slot in (s for c in chunks for s in c):
                ckpt.load_layer_state(slot.index, slot.module, slot.optimizer, tensors)
            start = int(meta["iteration"])
            steps = int(meta.get("meta", {}).get("steps", 0))
    last = schedule.num_virtual_stages - 1
    holds_first = schedule.place(0)[0] == rank
    holds_last = schedule.place(last)[0] == rank
    dataset = spec.dataset(split=config.data.split)
    stream = (
        BatchStream(
            dataset, batch_size=config.data.batch_size, seed=config.data.seed, start_iteration=start
        )
        if holds_first or holds_last
        else None
    )
    micro = config.data.batch_size // config.data.microbatches
    first_input = None
    if holds_first:
        sample = dataset.sample_input(micro)
        first_input = TensorSpec(tuple(sample.shape), sample.dtype)
    specs = _negotiate_shapes(chunks, schedule, rank, first_input, device)
    transport = P2PTransport(
        rank=rank,
        device=device,
        num_boundaries=schedule.num_virtual_stages,
        num_microbatches=schedule.num_microbatches,
        num_jobs=schedule.num_jobs,
    )
    executor = StageExecutor(
        schedule=schedule,
        stage=rank,
        chunks=chunks,
        loss_fn=spec.loss,
        loss_scale=loss_scale(schedule.update_every),
        transport=transport,
        boundary_specs=specs,
    )
    executor.steps_done = steps
    total = config.iterations_total(len(dataset))
    every = config.train.checkpoint_every
    with run.stage_metrics(rank).open("a") as log:
        _log(
            log,
            {
                "event": "ready",
                "stage": rank,
                "pid": os.getpid(),
                "threads": threads,
                "device": str(device),
                "start": start,
            },
        )
        dist.barrier()
        fault_at = _injected_fault(rank)
        for it in range(start, total):
            if it == fault_at:
                raise InjectedFault(f"fault injected at iteration {it} ({FAULT_ENV})")
            mbs: list[tuple[torch.Tensor | None, torch.Tensor | None]]
            if stream is not None:
                x, y = next(stream)
                pairs = split_microbatches(x.to(device), y.to(device), schedule.num_microbatches)
                mbs = [
                    (xi if holds_first else None, yi if holds_last else None) for xi, yi in pairs
                ]
            else:
                mbs = [(None, None)] * schedule.num_microbatches
            stats = executor.run_iteration(it, mbs)
            record: dict[str, Any] = {
                "iteration": it,
                "stage": rank,
                "compute_s": stats.compute_s,
                "wait_s": stats.wait_s,
                "comm_s": stats.comm_s,
                "iteration_s": stats.iteration_s,
                "in_flight": stats.max_in_flight,
                "end_time": time.time(),
            }
            if stats.loss is not None:
                record["loss"] = stats.loss / schedule.num_microbatches
            _log(log, record)
            done = it + 1
            if (every > 0 and done % every == 0) or done == total:
                _save_checkpoint(
                    run,
                    executor,
                    iteration=done,
                    rank=rank,
                    world=world,
                    config=config,
                    num_layers=spec.num_layers,
                )
                _log(log, {"event": "checkpoint", "stage": rank, "iteration": done})
        _log(log, {"event": "done", "stage": rank, "steps": executor.steps_done})


def _log(fh: TextIO, record: dict[str, Any]) -> None:
    record.setdefault("time", time.time())
    fh.write(json.dumps(record) + "\n")
    fh.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptipe.runtime.worker", description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument(
        "--resume", action="store_true", help="continue from the run's latest checkpoint"
    )
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    try:
        run_worker(args.run_dir, resume=args.resume)
    except BaseException as exc:  # report every failure, including KeyboardInterrupt
        cause = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        try:
            if rank.isdigit():
                RunDir(args.run_dir).write_error(int(rank), cause, traceback.format_exc())
        finally:
            print(f"stage {rank}: {cause}", file=sys.stderr)
            traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
