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
import contextlib
import math
import os
import resource
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
from adaptipe.errors import PlanError
from adaptipe.inject.injectors import CONTROL_DIR_ENV, read_slowdowns, read_throttles
from adaptipe.japsp.instance import JapspInstance
from adaptipe.models import get_model
from adaptipe.monitor.publisher import Publisher
from adaptipe.monitor.schema import StageStats
from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig, resolve_backend
from adaptipe.runtime.control import ActiveFollower, ActiveSet, is_rung
from adaptipe.runtime.data import BatchStream, RoundFeed, loss_scale
from adaptipe.runtime.memory import MemoryManager, block_order
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.stage import IterationStats, MicroBatches, StageExecutor
from adaptipe.runtime.stagestate import StageState, build_stage
from adaptipe.runtime.trace import TraceRecorder
from adaptipe.runtime.transport import (
    P2PTransport,
    TensorSpec,
    recv_spec,
    send_spec,
    wire_device,
)
from adaptipe.schedule.types import Schedule
from adaptipe.serial import json_line, load_json_file

__all__ = ["FAULT_ENV", "InjectedFault", "main", "run_worker"]

TELEMETRY_ENV = "ADAPTIPE_TELEMETRY"
"""The manager's collector address (ZeroMQ); workers publish telemetry there."""
TELEMETRY_INTERVAL_ENV = "ADAPTIPE_TELEMETRY_INTERVAL_S"

MANAGER_ENV = "ADAPTIPE_MANAGER"
"""Set by `adaptipe train`'s manager for the workers it starts (absent under torchrun)."""

FAULT_ENV = "ADAPTIPE_INJECT_FAULT"
"""``STAGE:ITERATION``: that stage raises `InjectedFault` when it reaches that iteration.
A drill for fault handling (tests, rehearsals); scenario-driven injection builds on it."""


class InjectedFault(RuntimeError):
    """Raised on purpose by a worker named in ``ADAPTIPE_INJECT_FAULT``."""


def _injected_fault() -> tuple[int, int] | None:
    """``(stage, iteration)`` from ``ADAPTIPE_INJECT_FAULT``, if set."""
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    stage, sep, iteration = value.partition(":")
    if not sep or not stage.isdigit() or not iteration.isdigit():
        raise ValueError(f"{FAULT_ENV}={value!r} must look like STAGE:ITERATION (e.g. 1:5)")
    return int(stage), int(iteration)


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
        # "cuda": stage r on GPU r (several per GPU when there are fewer GPUs; gloo only).
        index = dev.index if dev.index is not None else local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return dev


def _backend(config: RunConfig, device: torch.device) -> str:
    """The config's backend (parsing resolves ``auto``; this is for configs that did not)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return resolve_backend(config.train.backend, config.train.device, local, gpus)


def _negotiate_shapes(
    executor: StageExecutor,
    schedule: Schedule,
    rank: int,
    first_inputs: dict[int, TensorSpec],
    device: torch.device,
    wire: torch.device,
) -> dict[tuple[int, int], TensorSpec]:
    """Pass boundary shapes down the pipeline, job by job; each worker infers its own.

    The output of a chunk is found by running its real layers once, without autograd,
    on a zero input of the negotiated shape (zeros are valid token ids too). That is
    exact for the device and dtype in use, and costs one micro-batch forward.
    """
    out: dict[tuple[int, int], TensorSpec] = {}
    last = schedule.num_virtual_stages - 1
    for job in range(schedule.num_jobs):
        for chunk in range(schedule.num_chunks):
            g = schedule.vstage(rank, chunk)
            if g == 0:
                in_spec = first_inputs[job]
            else:
                in_spec = recv_spec(schedule.place(g - 1)[0], wire=wire)
                out[(job, g)] = in_spec
            if g < last:
                with torch.no_grad():
                    x = torch.zeros(in_spec.shape, dtype=in_spec.dtype, device=device)
                    y = executor.forward_only(job, chunk, x)
                out_spec = TensorSpec(tuple(y.shape), y.dtype)
                send_spec(out_spec, schedule.place(g + 1)[0], wire=wire)
                out[(job, g + 1)] = out_spec
    return out


def _save_checkpoint(
    run: RunDir,
    state: StageState,
    *,
    iteration: int,
    steps: int,
    rank: int,
    world: int,
    config: RunConfig,
    num_layers: int,
) -> None:
    if state.memory is not None:
        state.memory.synchronize()  # offloaded states are complete before they are saved
    meta: dict[str, Any] = {"iteration": iteration, "stage": rank, "layers": state.layers()}
    ckpt.save_stage(run.checkpoint_dir(iteration), stage=rank, tensors=state.tensors(), meta=meta)
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
                "jobs": [job.name for job in config.jobs],
                "steps": steps,
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
    if config.sweep is not None and config.sweep.halving_every and MANAGER_ENV not in os.environ:
        # Each rung waits for the manager's decision, which only `adaptipe train` makes.
        raise PlanError(
            f"{run.config_json}: [sweep].halving_every = {config.sweep.halving_every} needs "
            "the manager of `adaptipe train`, which decides each halving; these workers "
            "were started without it (torchrun?). Set halving_every = 0 to train here."
        )
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
    state = build_stage(spec, partition, schedule, rank, config, device)
    jobs = config.jobs
    start = 0
    steps = 0
    if resume:
        found = ckpt.latest(run.checkpoints)
        if found is not None:
            tensors, meta = ckpt.load_compatible(
                found, model=spec.name, model_config=dict(spec.config), num_layers=spec.num_layers
            )
            state.load(tensors)
            start = int(meta["iteration"])
            steps = int(meta.get("meta", {}).get("steps", 0))
    last = schedule.num_virtual_stages - 1
    holds_first = schedule.place(0)[0] == rank
    holds_last = schedule.place(last)[0] == rank
    dataset = spec.dataset(split=config.data.split)
    m = schedule.num_microbatches
    # Each job reads its own data stream: its batch size and data seed.
    streams = (
        [
            BatchStream(
                dataset,
                batch_size=job.batch_size,
                seed=job.data_seed,
                start_iteration=start,
            )
            for job in jobs
        ]
        if holds_first or holds_last
        else []
    )
    first_inputs: dict[int, TensorSpec] = {}
    if holds_first:
        for job in jobs:
            sample = dataset.sample_input(job.batch_size // m)
            first_inputs[job.index] = TensorSpec(tuple(sample.shape), sample.dtype)
    # Job-arrays: the block costs every worker unrolls windows with (all alike).
    instance = (
        load_json_file(run.root / "japsp-instance.json", JapspInstance.from_json)
        if config.sweep is not None
        else None
    )
    state.memory = _memory_manager(config, state, schedule, instance, rank, device)
    telemetry = _telemetry_address(config)
    # Job-arrays run windows of several iterations (`adaptipe.japsp.window`): round r of
    # a job is its micro-batch r of the window's schedule. "auto" windows grow as jobs
    # stop; the transport numbers transfers for the longest.
    stages = schedule.num_stages
    window = config.sweep.rounds(len(jobs), stages) if config.sweep is not None else 1
    longest = (
        max(config.sweep.rounds(j, stages) for j in range(1, len(jobs) + 1))
        if config.sweep is not None
        else 1
    )
    wire = wire_device(device, _backend(config, device))
    transport = P2PTransport(
        rank=rank,
        device=device,
        wire=wire,
        num_boundaries=schedule.num_virtual_stages,
        num_microbatches=m * longest,
        num_jobs=schedule.num_jobs,
        measure_links=telemetry is not None and config.train.link_telemetry,
    )
    executor = StageExecutor(
        schedule=schedule,
        stage=rank,
        chunks=state.chunks,
        loss_fn=spec.loss,
        loss_scale=loss_scale(schedule.update_every),
        transport=transport,
        boundary_specs={},
        binder=state.binder,
        memory=state.memory,
        batch_weight_grads=config.pipeline.batch_weight_grads,
    )
    executor.set_boundary_specs(
        _negotiate_shapes(executor, schedule, rank, first_inputs, device, wire)
    )
    if state.memory is not None:
        state.memory.take_window()  # loads for the shape probe are not the first window's
    executor.steps_done = steps
    total = config.iterations_total(len(dataset))
    every = config.train.checkpoint_every
    # Job-arrays: which jobs train, agreed on at every window boundary (early stops).
    follower = (
        ActiveFollower(
            run,
            config,
            rank=rank,
            total=total,
            device=wire,
            wait_s=0.8 * config.train.timeout_s,
        )
        if config.sweep is not None
        else None
    )
    windows = (
        _Windows(config, schedule, instance, executor, state, rank)
        if instance is not None
        else None
    )
    active = set(range(len(jobs)))
    publisher = _telemetry(telemetry, rank, config.train.telemetry_interval_s, device)
    with run.stage_metrics(rank).open("a") as log, contextlib.ExitStack() as cleanup:
        if publisher is not None:
            cleanup.callback(publisher.close, linger_s=0.5)
        cleanup.callback(transport.close)  # first: a stuck link watcher must not hold us
        if state.memory is not None:
            cleanup.callback(state.memory.close)  # its copy thread
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
        traced = range(
            config.train.trace_start, config.train.trace_start + config.train.trace_iterations
        )
        recorder = TraceRecorder(rank) if traced else None
        fault = _injected_fault()
        control_dir = os.environ.get(CONTROL_DIR_ENV)
        # Iterations a window must not span: where a checkpoint, a halving rung, the
        # traced range or the fault drill sits (the same on every stage).
        edges = {traced.start, traced.stop} if traced else set()
        if fault is not None:
            edges.add(fault[1])
        if follower is not None:  # a resumed run switches where it did before
            edges |= follower.replay_edges(start)
        it = start
        epoch = 0  # windows run so far (keeps consecutive windows' transfers apart)
        while it < total:
            if fault is not None and it == fault[1] and fault[0] == rank:
                raise InjectedFault(f"fault injected at iteration {it} ({FAULT_ENV})")
            t_window = time.time()
            if control_dir:
                _apply_interference(control_dir, rank, executor, transport)
            switched = follower.at_boundary(it) if follower is not None else None
            if switched is not None and switched.version > 0:
                active = set(switched.jobs)
                _log(
                    log,
                    {
                        "event": "active",
                        "stage": rank,
                        "iteration": it,
                        "version": switched.version,
                        "jobs": list(switched.jobs),
                    },
                )
            if config.sweep is not None:
                window = config.sweep.rounds(len(active), stages)
            stop = _window_end(config, it, total, window, edges)
            rounds = stop - it
            if windows is not None:
                if switched is not None:
                    windows.adopt(switched)
                executor = windows.executor(rounds, slowdown=executor.slowdown)
            # Each job's rounds are read when its first block of the round runs.
            feeds = {
                j: RoundFeed(
                    stream,
                    rounds=rounds,
                    per_round=m,
                    device=device,
                    keep_input=holds_first,
                    keep_target=holds_last,
                )
                for j, stream in enumerate(streams)
                if j in active  # a stopped job reads no more data
            }
            nothing: MicroBatches = [(None, None)] * (m * rounds)
            per_job = [feeds.get(j, nothing) for j in range(len(jobs))]
            executor.trace = recorder if it in traced else None
            stats = executor.run_iteration(epoch, per_job)
            for feed in feeds.values():
                feed.finish()
            epoch += 1
            if recorder is not None and stop == traced.stop:
                recorder.write(run.trace_file(rank), iterations=(traced.start, stop))
                recorder = None
            t_end = time.time()
            mean = _per_iteration(stats, rounds)
            for r in range(rounds):
                # A window's iterations share its time evenly.
                end_time = t_window + (t_end - t_window) * (r + 1) / rounds
                _log(
                    log,
                    _iteration_record(
                        stats,
                        iteration=it + r,
                        stage=rank,
                        rounds=rounds,
                        per_round=m,
                        round_index=r,
                        end_time=end_time,
                    ),
                )
                if publisher is not None:
                    publisher.publish(
                        _stage_stats(run, rank, it + r, mean, state.chunks, device, end_time)
                    )
            if publisher is not None:
                for link in transport.link_samples():
                    publisher.publish(link)
            it = done = stop
            if (every > 0 and done % every == 0) or done == total or is_rung(config, done, total):
                _save_checkpoint(
                    run,
                    state,
                    iteration=done,
                    steps=executor.steps_done,
                    rank=rank,
                    world=world,
                    config=config,
                    num_layers=spec.num_layers,
                )
                _log(log, {"event": "checkpoint", "stage": rank, "iteration": done})
        if recorder is not None and recorder.events:  # the run ended inside the window
            recorder.write(run.trace_file(rank), iterations=(traced.start, total))
        done_record: dict[str, Any] = {"event": "done", "stage": rank, "steps": executor.steps_done}
        if state.memory is not None and state.memory.enabled:
            mm = state.memory
            done_record["memory"] = {
                "budget": mm.budget,
                "peak_resident": mm.peak_resident,
                "hits": mm.hits,
                "misses": mm.misses,
                "prefetches": mm.prefetches,
                "evictions": mm.evictions,
                "wait_s": mm.wait_s,
            }
        _log(log, done_record)


def _window_end(config: RunConfig, it: int, total: int, window: int, edges: set[int]) -> int:
    """Where the window starting at ``it`` ends: ``window`` iterations later, or earlier
    at the run's end, a checkpoint, a halving rung or one of ``edges``."""
    every = config.train.checkpoint_every
    stop = min(it + window, total)
    for b in range(it + 1, stop):
        if (every > 0 and b % every == 0) or is_rung(config, b, total) or b in edges:
            return b
    return stop


def _iteration_record(
    stats: IterationStats,
    *,
    iteration: int,
    stage: int,
    rounds: int,
    per_round: int,
    round_index: int,
    end_time: float,
) -> dict[str, Any]:
    """One iteration's metrics record; a window's iterations share its times evenly."""
    record: dict[str, Any] = {
        "iteration": iteration,
        "stage": stage,
        "compute_s": stats.compute_s / rounds,
        "wait_s": stats.wait_s / rounds,
        "comm_s": stats.comm_s / rounds,
        "iteration_s": stats.iteration_s / rounds,
        "in_flight": stats.max_in_flight,
        "end_time": end_time,
    }
    if rounds > 1:
        record["window"] = rounds
    if stats.resident_jobs:  # a job-array
        record["resident_jobs"] = stats.resident_jobs
        record["state_wait_s"] = stats.state_wait_s / rounds
        if round_index == 0:  # a window's loads on demand, counted once
            record["state_misses"] = stats.state_misses
    group = range(round_index * per_round, (round_index + 1) * per_round)
    losses: dict[str, float] = {}
    for (j, mb), value in sorted(stats.microbatch_losses.items()):
        if mb in group:
            losses[str(j)] = losses.get(str(j), 0.0) + value / per_round
    if losses:
        # Mean loss of each job's mini-batch; "loss" is the mean over the jobs.
        record["losses"] = losses
        record["loss"] = sum(losses.values()) / len(losses)
    return record


def _per_iteration(stats: IterationStats, rounds: int) -> IterationStats:
    """A window's stats as one iteration's average (telemetry)."""
    if rounds == 1:
        return stats
    return IterationStats(
        compute_s=stats.compute_s / rounds,
        wait_s=stats.wait_s / rounds,
        comm_s=stats.comm_s / rounds,
        iteration_s=stats.iteration_s / rounds,
        loss=stats.loss,  # already a mean over the window's rounds
        layer_forward_s={i: t / rounds for i, t in stats.layer_forward_s.items()},
        layer_backward_s={i: t / rounds for i, t in stats.layer_backward_s.items()},
        max_in_flight=stats.max_in_flight,
        resident_jobs=stats.resident_jobs,
        state_wait_s=stats.state_wait_s / rounds,
        state_misses=stats.state_misses,
    )


class _Windows:
    """A job-array worker's executors: one per window length, for the active set.

    Every worker unrolls the same one-round schedule with the same block costs (the
    run's JAPSP instance), so all agree on every window without talking. Layer slots,
    per-job states, transport and negotiated shapes are shared; the memory manager
    follows whichever window runs.
    """

    def __init__(
        self,
        config: RunConfig,
        schedule: Schedule,
        instance: JapspInstance,
        executor: StageExecutor,
        state: StageState,
        rank: int,
    ) -> None:
        self.num_jobs = len(config.jobs)
        self.budget = config.sweep.memory_budget if config.sweep is not None else 0
        self.instance = instance
        self.template, self.state, self.rank = executor, state, rank
        self.active = ActiveSet(version=0, jobs=tuple(range(self.num_jobs)), schedule=schedule)
        self._executors: dict[int, StageExecutor] = {}
        self._running: tuple[int, int] | None = None  # (active version, rounds) in memory

    def adopt(self, active: ActiveSet) -> None:
        """Run ``active``'s jobs from the next window on (an iteration boundary)."""
        if active.version != self.active.version:
            self.active = active
            self._executors.clear()

    def executor(self, rounds: int, *, slowdown: float) -> StageExecutor:
        from adaptipe.runtime.control import remap_jobs
        from adaptipe.runtime.jobarray import window_for

        ex = self._executors.get(rounds)
        if ex is None:
            act = self.active
            local = window_for(
                act.schedule, self.instance.select(act.jobs), rounds, budget=self.budget
            )
            ex = _respawn(self.template, remap_jobs(local, act.jobs, self.num_jobs), self.rank)
            self._executors[rounds] = ex
        ex.steps_done = self.template.steps_done
        ex.slowdown = slowdown
        key = (self.active.version, rounds)
        if self.state.memory is not None and key != self._running:
            self.state.memory.reorder(block_order(ex.program))
        self._running = key
        self.template = ex
        return ex


def _respawn(executor: StageExecutor, schedule: Schedule, rank: int) -> StageExecutor:
    """An executor for another job-array schedule (at an iteration boundary).

    Layer slots, per-job states, transport and negotiated shapes carry over; only the
    instruction list changes.
    """
    new = StageExecutor(
        schedule=schedule,
        stage=rank,
        chunks=executor.chunks,
        loss_fn=executor.loss_fn,
        loss_scale=executor.loss_scale,
        transport=executor.transport,
        boundary_specs=executor.boundary_specs,
        binder=executor.binder,
        memory=executor.memory,
        batch_weight_grads=executor.batch_weight_grads,
    )
    new.steps_done = executor.steps_done
    new.slowdown = executor.slowdown
    return new


def _memory_manager(
    config: RunConfig,
    state: StageState,
    schedule: Schedule,
    instance: JapspInstance | None,
    rank: int,
    device: torch.device,
) -> MemoryManager | None:
    """A memory manager when the sweep keeps fewer job states resident than it has jobs.

    It starts on the one-iteration order that fits the budget (the solver's order may
    not); each window then hands it that window's order.
    """
    from adaptipe.runtime.jobarray import window_for

    budget = config.sweep.memory_budget if config.sweep is not None else 0
    if state.binder is None or instance is None or not 0 < budget < len(config.jobs):
        return None
    first = window_for(schedule, instance, 1, budget=budget)
    return MemoryManager(
        state.binder, budget=budget, device=device, order=block_order(first.stages[rank])
    )


def _apply_interference(
    control_dir: str, rank: int, executor: StageExecutor, transport: P2PTransport
) -> None:
    """Apply the injected slowdown and link throttle active now (scenario control files)."""
    executor.slowdown = read_slowdowns(control_dir).get(rank, 1.0)
    throttle = read_throttles(control_dir).get(rank)
    transport.throttle = (
        None if throttle is None else (throttle.extra_latency_s, throttle.bandwidth_Bps)
    )


def _telemetry_address(config: RunConfig) -> str | None:
    """The collector's address when this worker should publish telemetry, else None.

    A scenario keeps the manager's collector on for its events even with
    ``[train] telemetry = false``; the stages then still publish nothing.
    """
    address = os.environ.get(TELEMETRY_ENV)
    return address if address and config.train.telemetry else None


def _telemetry(
    address: str | None, rank: int, interval_s: float, device: torch.device
) -> Publisher | None:
    """Publish to the manager's collector when there is one (non-blocking sends).

    A stage on a GPU samples that GPU through NVML; a CPU stage samples its process,
    also on a machine with GPUs.
    """
    if address is None:
        return None
    publisher = Publisher(address, stage=rank)
    interval = float(os.environ.get(TELEMETRY_INTERVAL_ENV, interval_s))
    publisher.start_sampler(
        interval_s=interval,
        device_index=device.index if device.type == "cuda" else None,
    )
    return publisher


def _memory(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS, KiB on Linux
    return rss, rss


def _stage_stats(
    run: RunDir,
    rank: int,
    it: int,
    stats: IterationStats,
    chunks: list[list[Any]],
    device: torch.device,
    time_s: float | None = None,
) -> StageStats:
    layers = [slot.index for chunk in chunks for slot in chunk]
    contiguous = layers == list(range(layers[0], layers[0] + len(layers))) if layers else False
    allocated, reserved = _memory(device)
    return StageStats(
        run_id=run.root.name,
        stage=rank,
        iteration=it,
        time_s=time.time() if time_s is None else time_s,
        first_layer=layers[0] if contiguous else 0,
        forward_s=tuple(stats.layer_forward_s.get(i, 0.0) for i in layers) if contiguous else (),
        backward_s=tuple(stats.layer_backward_s.get(i, 0.0) for i in layers) if contiguous else (),
        compute_s=stats.compute_s,
        wait_s=stats.wait_s,
        comm_s=stats.comm_s,
        iteration_s=stats.iteration_s,
        in_flight=stats.max_in_flight,
        memory_allocated_bytes=allocated,
        memory_reserved_bytes=reserved,
        # A diverged job's NaN stays in the metrics log; telemetry carries numbers only.
        loss=None if stats.loss is None or math.isnan(stats.loss) else stats.loss,
        resident_jobs=stats.resident_jobs,
        state_wait_s=stats.state_wait_s,
    )


def _log(fh: TextIO, record: dict[str, Any]) -> None:
    record.setdefault("time", time.time())
    fh.write(json_line(record))
    fh.flush()


def _die_with_parent() -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptipe.runtime.worker", description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument(
        "--resume", action="store_true", help="continue from the run's latest checkpoint"
    )
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    if MANAGER_ENV in os.environ:
        _die_with_parent()
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
