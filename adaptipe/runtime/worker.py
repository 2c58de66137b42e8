"""Stage worker process: ``python -m adaptipe.runtime.worker --run-dir DIR``.

Reads the plans the manager wrote into the run directory (resolved config, partition,
schedule), joins the process group from the usual ``torch.distributed`` environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``), so the
same entry point runs under ``adaptipe train`` on one machine and under ``torchrun``
across hosts, and executes its instruction list window after window. At each window
boundary every worker agrees on the plan version in force (`PlanFollower`); a version
with another partition moves layers there (`adaptipe.runtime.migration`).

On any error the worker writes ``errors/stage-N.txt`` (first line: the cause) before
exiting non-zero, so the manager can name the stage and the cause.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError
from adaptipe.japsp.instance import JapspInstance
from adaptipe.models import ModelSpec
from adaptipe.models.mapdata import with_loader
from adaptipe.plan.partition import Partition
from adaptipe.runtime.bootstrap import (
    EXIT_RESTART,
    MANAGER_ENV,
    Process,
    backend,
    die_with_parent,
    init_group,
    pin_threads,
    place,
)
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.control import checkpoint_due
from adaptipe.runtime.data import BatchStream, RoundFeed
from adaptipe.runtime.follower import PlanFollower
from adaptipe.runtime.handshake import negotiate_shapes
from adaptipe.runtime.heap import settled
from adaptipe.runtime.hooks import (
    FAULT_ENV,
    TELEMETRY_ENV,
    TELEMETRY_INTERVAL_ENV,
    InjectedFault,
    Window,
    telemetry_target,
    worker_hooks,
)
from adaptipe.runtime.iteration_stats import IterationStats
from adaptipe.runtime.link_probe import probe_hook
from adaptipe.runtime.managerinfo import read_manager
from adaptipe.runtime.memory_guard import guard_hook
from adaptipe.runtime.migration import layers_of
from adaptipe.runtime.plan_switch import PlanSwitch
from adaptipe.runtime.planversion import PlanVersion
from adaptipe.runtime.records import done_record, log, log_window
from adaptipe.runtime.replicas import Replicas
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.stage import MicroBatches
from adaptipe.runtime.stage_checkpoint import load_latest, save_checkpoint
from adaptipe.runtime.stagestate import Stage, build_stage
from adaptipe.runtime.transport import P2PTransport, TensorSpec
from adaptipe.runtime.windowcut import WindowCut
from adaptipe.runtime.windows import Windows, memory_manager, window_end
from adaptipe.schedule.replicate import ReplicaLayout
from adaptipe.serial import load_json_file, read_json

__all__ = [
    "EXIT_RESTART",
    "FAULT_ENV",
    "MANAGER_ENV",
    "TELEMETRY_ENV",
    "TELEMETRY_INTERVAL_ENV",
    "InjectedFault",
    "RestartForPlan",
    "main",
    "run_worker",
]


class RestartForPlan(Exception):
    """Raised at a boundary where ``[adapt] method = "restart"`` takes a new partition on."""


def run_worker(run_dir: Path, *, resume: bool) -> None:
    proc, run = Process.from_env(), RunDir(run_dir)
    config = run.read_config()
    managed = MANAGER_ENV in os.environ or read_manager(run) is not None
    if config.sweep is not None and config.sweep.halving_every and not managed:
        raise PlanError(
            f"{run.config_json}: [sweep].halving_every = {config.sweep.halving_every} needs "
            "a manager, which decides each halving; these workers were started without "
            "one (torchrun?): start `adaptipe manage RUN_DIR` first, or set "
            "halving_every = 0 to train here."
        )
    schedule = run.read_schedule()
    layout = ReplicaLayout.of(run.read_partition().replicas, schedule.num_stages)
    if layout.world != proc.world:  # replicated stages: one process per replica
        raise RuntimeError(f"schedule has {schedule.num_stages} stages, replicas "
                           f"{list(layout.replicas)}: {layout.world} processes but WORLD_SIZE={proc.world}")  # fmt: skip
    threads = pin_threads(proc.local_rank, proc.local_world, config.train.threads_per_stage)
    device = place(config, proc.local_rank)
    init_group(config, proc, device)
    try:
        worker = _Worker.setup(run, config, proc, device, resume=resume)
        worker.train(threads)
    finally:
        dist.destroy_process_group()


@dataclass(kw_only=True, slots=True)
class _Worker:
    """One stage worker's pieces, set up once; `train` is the loop over windows."""

    run: RunDir
    config: RunConfig
    proc: Process
    spec: ModelSpec
    stage: Stage
    partition: Partition
    start: int
    total: int
    streams: list[BatchStream]
    first_inputs: dict[int, TensorSpec]
    transport: P2PTransport
    wire: torch.device
    windows: Windows
    follower: PlanFollower
    holds: tuple[bool, bool]  # (first virtual stage, last virtual stage)
    switch: PlanSwitch  # which plan version runs from each boundary
    replicas: Replicas  # this worker's stage and replica (`adaptipe.runtime.replicas`)
    cut: WindowCut | None = None  # job-arrays: ends a window when a plan comes mid-way
    active: set[int] = field(default_factory=set)

    @property
    def per_round(self) -> int:
        """Micro-batches per job and iteration."""
        return self.windows.plan.schedule.num_microbatches

    @classmethod
    def setup(
        cls, run: RunDir, config: RunConfig, proc: Process, device: torch.device, *, resume: bool
    ) -> _Worker:
        spec = config.model.spec()
        partition, schedule = run.read_partition(), run.read_schedule()
        layout = ReplicaLayout.of(partition.replicas, schedule.num_stages)
        replicas = Replicas.join(layout, proc.rank, backend=backend(config, device), device=device)
        wire = replicas.wire  # where tensors travel (`wire_device`)
        stage = build_stage(spec, partition, schedule, replicas.stage, config, device)
        stage.install_clipping(replicas.step_hook)  # the replicas' all-reduce, then clipping
        schedule = replicas.view(schedule)  # a replica runs its micro-batches only
        start = load_latest(run, spec, stage, restore=proc.rank == 0) if resume else 0
        if resume:
            dist.barrier()  # rank 0 restored the checkpoint's plan history: all read it
        stage_holds = (schedule.place(0)[0], schedule.place(schedule.num_virtual_stages - 1)[0])
        holds = (stage_holds[0] == replicas.stage, stage_holds[1] == replicas.stage)
        dataset = with_loader(spec.dataset(split=config.data.split), config.data.loader_workers)
        jobs, m = config.jobs, schedule.num_microbatches
        streams = [  # each job reads its own data stream: its batch size and data seed
            BatchStream(dataset, batch_size=j.batch_size, seed=j.data_seed, start_iteration=start)
            for j in jobs
            if any(holds)
        ]
        first_inputs = {}
        for job in jobs if holds[0] else ():
            sample = dataset.sample_input(job.batch_size // m)
            first_inputs[job.index] = TensorSpec(tuple(sample.shape), sample.dtype)
        instance = (  # job-arrays: the block costs every worker unrolls windows with
            load_json_file(run.root / "japsp-instance.json", JapspInstance.from_json)
            if config.sweep is not None
            else None
        )
        stage.use_memory(memory_manager(config, stage, schedule, instance, device))
        longest = max(  # the transport numbers transfers for the longest window
            (config.sweep.rounds(j, schedule.num_stages) for j in range(1, len(jobs) + 1))
            if config.sweep is not None
            else (1,)
        )
        transport = P2PTransport(
            rank=proc.rank,
            device=device,
            wire=wire,
            num_boundaries=schedule.num_virtual_stages,
            num_microbatches=m * longest,
            num_jobs=schedule.num_jobs,
            measure_links=replicas.primary and _measures_links(run, config),  # who reports
        )
        plan = PlanVersion(version=0, jobs=tuple(range(len(jobs))), schedule=schedule)
        windows = Windows(config, instance, stage, plan)
        # Plan versions are agreed every boundary: beside NCCL on a CPU group, so the
        # agreement does not sync the device.
        group = dist.new_group(backend="gloo") if wire.type == "cuda" else None
        follower = PlanFollower(
            run,
            config,
            rank=proc.rank,
            total=config.iterations_total(len(dataset)),
            device=torch.device("cpu") if group is not None else wire,
            wait_s=0.8 * config.train.timeout_s,
            group=group,
        )
        cut = None
        if config.sweep is not None and proc.world > 1:
            cut = WindowCut(
                rank=proc.rank,
                world=proc.world,
                per_round=m,
                newer=follower.pending,
                group=dist.new_group(backend="gloo"),  # its words alone
                max_rounds=longest,
            )
        worker = cls(
            run=run,
            config=config,
            proc=proc,
            spec=spec,
            stage=stage,
            partition=partition,
            start=start,
            total=follower.total,
            streams=streams,
            first_inputs=first_inputs,
            transport=transport,
            wire=wire,
            windows=windows,
            follower=follower,
            holds=holds,
            cut=cut,
            switch=PlanSwitch(
                config=config, follower=follower, stage=stage, transport=transport, start=start
            ),
            active=set(range(len(jobs))),
            replicas=replicas,
        )
        worker.handshake()
        return worker

    # ------------------------------------------------------------------ the loop
    def train(self, threads: int) -> None:
        run, config, rank, stage = self.run, self.config, self.replicas.stage, self.stage
        primary = self.replicas.primary  # replica 0 reports the stage, takes injections
        hooks = worker_hooks(run, config, stage, self.transport) if primary else []
        edges = set().union(*(h.edges() for h in hooks)) | self.follower.replay_edges(self.start)
        with self.replicas.metrics_path(run).open("a") as fh, contextlib.ExitStack() as cleanup:
            logged = functools.partial(log, fh)
            hooks += guard_hook(run.root, config.train.memory_limit_mb(rank), stage, logged)
            hooks += probe_hook(config.train, self.windows.schedule(), self.transport, logged)
            for hook in hooks:
                cleanup.callback(hook.close)
            cleanup.callback(self.transport.close)  # first: a stuck link watcher must not hold us
            cleanup.callback(self.switch.close)  # a streamed move still in flight
            cleanup.callback(_close_memory, stage)  # its copy thread (the one in use then)
            ready = {"event": "ready", "stage": rank, "pid": os.getpid(), "threads": threads}
            log(fh, {**ready, "device": str(stage.device), "start": self.start})
            cleanup.enter_context(settled())  # no full collection walks the start-up heap
            dist.barrier()
            it, epoch = self.start, 0  # epoch: windows run so far (keeps transfers apart)
            while it < self.total:
                begun = time.time()
                for hook in hooks:
                    hook.before_boundary(it)
                schedule = self.windows.schedule()
                switched = self.switch.at(it, self.partition, schedule, lambda e: log(fh, e))
                if switched is not None:
                    self.adopt(switched, it, fh)
                stop = window_end(config, it, self.total, self.windows.length(), edges)
                plan = self.windows.plan.version
                window = Window(
                    it, stop, self.windows.executor(stop - it), begun, plan_version=plan
                )
                for hook in hooks:
                    hook.before_window(window)
                feeds = self.feeds(window.rounds)
                stats = self.run_window(window, epoch, feeds)
                if stats.cut_at is not None:  # a plan was committed: it comes in now
                    stop = it + stats.cut_at
                    cut = {"event": "window_cut", "stage": rank, "iteration": stop}
                    log(fh, {**cut, "planned": window.stop})
                for feed in feeds.values():
                    feed.finish(upto=stop - it)
                epoch += 1
                window = Window(it, stop, window.executor, begun, time.time(), stats, plan)
                self.switch.note(stats, window.rounds)
                times = (window.begun, window.ended)
                log_window(fh, stats, start=it, stop=stop, times=times, stage=rank, per_round=self.per_round)  # fmt: skip
                for hook in hooks:
                    hook.after_window(window)
                it = stop
                if self.checkpoint_due(it):
                    self.checkpoint(it)
                    log(fh, {"event": "checkpoint", "stage": rank, "iteration": it})
            for hook in hooks:
                hook.finish(self.total)
            log(fh, done_record(rank, stage.steps_done, stage.memory))

    def run_window(self, window: Window, epoch: int, feeds: dict[int, RoundFeed]) -> IterationStats:
        """Run ``window``; a job-array window ends early, at the next iteration, when a
        plan version is committed while it runs (`adaptipe.runtime.windowcut`)."""
        cut = self.cut if window.rounds > 1 else None
        if cut is not None:
            cut.begin(epoch, window.rounds)
        stats = window.executor.run_iteration(epoch, self.microbatches(feeds, window), cut)
        self.replicas.merge_losses(stats, last=self.holds[1], microbatches=self.per_round)
        if cut is not None:
            cut.end()
        if stats.cut_at is not None:
            self.windows.interrupted()
        return stats

    # ------------------------------------------------------------------ plan versions
    def adopt(self, plan: PlanVersion, it: int, fh: TextIO) -> None:
        """Run ``plan`` from iteration ``it`` on (every worker calls this at ``it``)."""
        rank = self.proc.rank
        partition = plan.partition if plan.partition is not None else self.run.read_partition()
        self.windows.adopt(plan)
        if partition.bounds != self.partition.bounds and not self.move_layers(partition, it, fh):
            plan = self.follower.failed(it)  # the old partition stays; the rest stands
            self.windows.adopt(plan)
        if plan.version > 0:
            self.active = set(plan.jobs)
            event = {"event": "active", "stage": rank, "iteration": it, "version": plan.version}
            log(fh, {**event, "jobs": list(plan.jobs)})

    def move_layers(self, partition: Partition, it: int, fh: TextIO) -> bool:
        """Take on ``partition`` at iteration ``it``; False when the move failed and the
        old partition is intact (a live migration that did not complete)."""
        rank = self.proc.rank
        event = {"stage": rank, "iteration": it, "bounds": list(partition.bounds)}
        method = self.config.adapt.method
        if self.replicas.layout.replicated:  # config checks refuse it; a request can ask
            log(fh, {"event": "plan_refused", **event, "why": "replicated stages do not move layers"})  # fmt: skip
            return False
        if method == "restart" and it != self.start:
            # The field's baseline: every stage checkpoints here and exits; the manager
            # starts the workers again, which take the partition on from the checkpoint.
            if not self._checkpoint_is_latest(it):
                self.checkpoint(it)
                log(fh, {"event": "checkpoint", "stage": rank, "iteration": it})
            log(fh, {"event": "restart", **event})
            raise RestartForPlan(f"restarting at iteration {it} to hold {partition.bounds}")
        if method == "live":
            moved = self.switch.move(
                self.partition, partition, self.windows.schedule(), wire=self.wire,
                seq=self.follower.active.version if self.follower.active is not None else 0,
                log=lambda kind, report: log(fh, {"event": kind, **event, **report}),
            )  # fmt: skip
            if not moved:
                return False
        else:
            self._move_through_checkpoint(partition, it, fh)
        self.partition = partition
        self.stage.check(layers_of(partition, self.windows.schedule(), rank))
        if self.stage.memory is not None:
            self.stage.refresh_memory(self.windows.first_order())
        self.handshake()
        log(fh, {"event": "plan", **event, "layers": self.stage.layers()})
        return True

    def _move_through_checkpoint(self, partition: Partition, it: int, fh: TextIO) -> None:
        """The layers this stage gains come from a checkpoint of iteration ``it``
        (written now unless it is the latest)."""
        if not self._checkpoint_is_latest(it):
            self.checkpoint(it)
            log(fh, {"event": "checkpoint", "stage": self.proc.rank, "iteration": it})
        found = ckpt.latest(self.run.checkpoints)
        assert found is not None
        tensors, _ = ckpt.load(found)
        layer_lists = layers_of(partition, self.windows.schedule(), self.proc.rank)
        self.stage.reshape(layer_lists, tensors)

    def _checkpoint_is_latest(self, it: int) -> bool:
        found = ckpt.latest(self.run.checkpoints)
        return found is not None and _iteration_of(found) == it

    def handshake(self) -> None:
        """Agree on boundary shapes with the neighbours (every worker at one boundary)."""
        schedule = self.windows.schedule()
        probe = self.stage.build_executor(
            schedule=schedule, transport=self.transport, boundary_specs={}
        )
        specs = negotiate_shapes(
            probe,
            schedule,
            self.proc.rank,
            self.first_inputs,
            self.stage.device,
            self.wire,
            jobs=self.windows.plan.jobs,  # a stopped job's state is not loaded for it
            layout=self.replicas.layout,
        )
        if self.stage.memory is not None:
            self.stage.memory.take_window()  # loads for the shape probe are not a window's
        self.windows.connect(self.transport, specs)

    # ------------------------------------------------------------------ helpers
    def feeds(self, rounds: int) -> dict[int, RoundFeed]:
        """Each active job's rounds, read when its first block of a round runs."""
        m = self.per_round
        first, last = self.holds
        return {
            j: RoundFeed(
                stream,
                rounds=rounds,
                per_round=m,
                device=self.stage.device,
                keep_input=first,
                keep_target=last,
            )
            for j, stream in enumerate(self.streams)
            if j in self.active  # a stopped job reads no more data
        }

    def microbatches(self, feeds: dict[int, RoundFeed], window: Window) -> list[MicroBatches]:
        nothing: MicroBatches = [(None, None)] * (self.per_round * window.rounds)
        return [feeds.get(j, nothing) for j in range(len(self.config.jobs))]

    def checkpoint_due(self, done: int) -> bool:
        return checkpoint_due(self.config, done, self.total)

    def checkpoint(self, iteration: int) -> None:
        save_checkpoint(
            self.run,
            self.stage,
            iteration=iteration,
            steps=self.stage.steps_done,
            rank=self.replicas.stage,
            world=self.replicas.layout.num_stages,
            primary=self.replicas.primary,  # one copy per stage: replica 0's
            config=self.config,
            num_layers=self.spec.num_layers,
        )


def _close_memory(stage: Stage) -> None:
    if stage.memory is not None:
        stage.memory.close()


def _iteration_of(found: Path) -> int:
    return int(read_json(found / ckpt.COMMITTED)["iteration"])


def _measures_links(run: RunDir, config: RunConfig) -> bool:
    return telemetry_target(run, config) is not None and config.train.link_telemetry


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptipe.runtime.worker", description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument(
        "--resume", action="store_true", help="continue from the run's latest checkpoint"
    )
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    if MANAGER_ENV in os.environ:
        die_with_parent()
    try:
        run_worker(args.run_dir, resume=args.resume)
    except RestartForPlan as exc:  # [adapt] method = "restart": not a failure
        print(f"stage {rank}: {exc}", file=sys.stderr)
        return EXIT_RESTART
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
