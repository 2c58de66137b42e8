"""The manager: resolve plans, start one worker per stage, watch them, summarise.

`train` is what ``adaptipe train`` calls. It writes every plan into the run directory,
starts the stage workers as child processes on loopback (a fresh port each time), and
follows their per-stage reports to merge one metrics record per iteration and drive
the progress bar. A worker that dies, by an exception or a signal, ends the run within
seconds with an error naming the stage and the cause; every other worker is stopped
by its process id (never by name), and the last committed checkpoint stays intact.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import adaptipe
import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import AdaptipeError, PlanError
from adaptipe.inject.injectors import CONTROL_DIR_ENV
from adaptipe.japsp.instance import JapspInstance
from adaptipe.models import ModelSpec, get_model
from adaptipe.monitor.collector import Collector
from adaptipe.plan.partition import Partition
from adaptipe.profile.children import free_port
from adaptipe.profile.types import Profile
from adaptipe.runtime.config import RunConfig, load_config
from adaptipe.runtime.control import JobController, mark_manager, unadopted_stops
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.worker import MANAGER_ENV, TELEMETRY_ENV, TELEMETRY_INTERVAL_ENV
from adaptipe.schedule.build import build_schedule
from adaptipe.schedule.types import Schedule
from adaptipe.schedule.validate import validate
from adaptipe.serial import finite, json_line, load_json_file, write_json
from adaptipe.units import parse_bandwidth

if TYPE_CHECKING:
    from adaptipe.inject.runner import Event as InjectEvent
    from adaptipe.inject.scenario import Scenario

__all__ = [
    "Plans",
    "StageFailed",
    "Terminated",
    "TrainSummary",
    "prepare",
    "resolve_plans",
    "train",
]

_STAGE_FIELDS = ("compute_s", "wait_s", "comm_s")  # per-stage means in the summary
_ARRAY_FIELDS = ("resident_jobs", "state_wait_s")  # job-arrays' memory manager

_KILL_GRACE_S = 3.0


class Terminated(KeyboardInterrupt):
    """``adaptipe train`` got SIGTERM (``kill``, ``timeout``, a batch scheduler): it stops
    its stage processes as on Ctrl-C before it exits."""


@contextlib.contextmanager
def _sigterm_raises() -> Any:
    """Turn SIGTERM into `Terminated` while training (main thread only), so the cleanup
    that ends the stage processes runs; the default action would orphan them."""
    import threading

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


class StageFailed(AdaptipeError, RuntimeError):
    """A stage worker died; the message names the stage and the cause."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSummary:
    run_dir: str
    iterations: int
    start_iteration: int
    final_loss: float | None
    samples_per_s: float
    wall_s: float
    stages: list[dict[str, float]] = field(default_factory=list)
    checkpoint: str | None = None
    jobs: list[dict[str, Any]] = field(default_factory=list)  # sweeps: ranked by validation loss

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: a diverged loss (NaN, infinite) is null, not ``NaN``."""
        out: dict[str, Any] = finite(asdict(self))
        return out


@dataclass(frozen=True, slots=True)
class Plans:
    """Everything a run executes, resolved from its config before any worker starts."""

    partition: Partition
    schedule: Schedule
    profile: Profile | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more plan files: name -> JSON


def resolve_plans(config: RunConfig) -> Plans:
    """The partition and schedule a config asks for (profiling first if a planner needs it)."""
    spec = get_model(config.model.name, **config.model.config)
    samples = len(spec.dataset(split=config.data.split))
    for job in config.jobs:  # before profiling, which would draw a batch this big
        if job.batch_size > samples:
            where = f"[sweep] job {job.name!r}" if config.sweep is not None else "[data]"
            raise PlanError(
                f"{config.source}: {where} batch_size = {job.batch_size} is more than the "
                f"{samples} samples of {spec.name}'s {config.data.split} split (allowed: "
                f"1..{samples})"
            )
    p = config.pipeline
    sweep = config.sweep is not None
    num = p.stages * p.virtual
    profile: Profile | None = None
    where = f"{config.source}: [pipeline].partition"
    if isinstance(p.partition, tuple | list):
        partition = Partition(
            model=spec.name, num_layers=spec.num_layers, bounds=tuple(p.partition), planner="manual"
        )
    elif p.partition == "even":
        partition = Partition.even(model=spec.name, num_layers=spec.num_layers, num_stages=num)
    elif p.partition in ("pipedream", "dynpipe"):
        from adaptipe.plan.api import plan
        from adaptipe.profile.profiler import profile_model

        job = config.jobs[0]
        profile = profile_model(
            spec,
            microbatch=job.batch_size // config.data.microbatches,
            repeats=3,
            warmup=1,
            threads=1,
            device=config.train.device,
            optimizer=job.optimizer.profile_kind,
        )
        partition = plan(
            profile, planner=p.partition, num_stages=num, bandwidth_Bps=parse_bandwidth(p.bandwidth)
        )
    else:
        partition = load_json_file(p.partition, Partition.from_json)
    partition.check_model(model=spec.name, num_layers=spec.num_layers, source=where)
    if partition.num_stages != num:
        raise PlanError(
            f"{where}: has {partition.num_stages} stages but the schedule needs {num} "
            f"(stages x virtual = {p.stages} x {p.virtual})"
        )
    if sweep:
        from adaptipe.runtime.jobarray import plan_job_array

        planned = plan_job_array(config, spec, partition)
        validate(planned.schedule)
        extra = {
            "japsp-instance.json": planned.instance.to_json(),
            "japsp-solution.json": planned.solution,
        }
        first = planned.profiles[config.jobs[0].batch_size]
        return Plans(partition, planned.schedule, profile or first, extra)
    schedule = build_schedule(
        p.schedule,
        stages=p.stages,
        microbatches=config.data.microbatches,
        chunks=p.virtual,
        recompute=p.recompute,
        vertical_sync=p.vertical_sync,
        update_every=p.update_every,
    )
    validate(schedule)
    return Plans(partition, schedule, profile)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
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


class _Follower:
    """Reads the workers' per-stage reports as they grow and merges iterations."""

    def __init__(self, run: RunDir, stages: int, batch_sizes: dict[str, int]) -> None:
        self.run = run
        self.stages = stages
        self.batch_sizes = batch_sizes  # per job (sweep index as a string)
        self.offsets = [0] * stages
        self.pending: dict[int, dict[int, dict[str, Any]]] = {}
        self.merged: list[dict[str, Any]] = []
        self.ready = 0
        self.last_end: float | None = None

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        for s in range(self.stages):
            path = self.run.stage_metrics(s)
            if not path.exists():
                continue
            with path.open() as fh:
                fh.seek(self.offsets[s])
                chunk = fh.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self.offsets[s] += len(complete)
            for line in complete.splitlines():
                rec = json.loads(line)
                if rec.get("event") == "ready":
                    self.ready += 1
                elif "iteration" in rec and "event" not in rec:
                    self.pending.setdefault(rec["iteration"], {})[s] = rec
        for it in sorted(self.pending):
            if len(self.pending[it]) < self.stages:
                break
            recs = self.pending.pop(it)
            end = max(r["end_time"] for r in recs.values())
            span = (
                max(r["iteration_s"] for r in recs.values())
                if self.last_end is None
                else end - self.last_end
            )
            self.last_end = end
            loss = next((r["loss"] for r in recs.values() if "loss" in r), None)
            losses = next((r["losses"] for r in recs.values() if "losses" in r), None)
            jobs = losses if losses is not None else self.batch_sizes
            samples = sum(self.batch_sizes.get(j, 0) for j in jobs)
            merged = {
                "iteration": it,
                "window": max(int(r.get("window", 1)) for r in recs.values()),
                "loss": loss,
                "losses": losses,
                "iteration_s": span,
                "samples": samples,
                "samples_per_s": samples / span if span > 0 else None,
                "stages": [
                    {
                        k: recs[s][k]
                        for k in (*_STAGE_FIELDS, "iteration_s", "in_flight", *_ARRAY_FIELDS)
                        if k in recs[s]
                    }
                    for s in range(self.stages)
                ],
            }
            self.merged.append(merged)
            new.append(merged)
        return new


def _spawn(
    run: RunDir,
    stages: int,
    *,
    resume: bool,
    telemetry: str | None,
    telemetry_interval_s: float = 0.2,
    control_dir: Path | None = None,
) -> list[subprocess.Popen[bytes]]:
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


ProgressFn = Callable[[dict[str, Any], int], None]


def prepare(
    config: RunConfig | str | Path, *, run_dir: str | Path | None = None
) -> tuple[RunDir, RunConfig]:
    """Resolve a config's plans and write them into a fresh run directory.

    This is all ``adaptipe train`` does before it starts workers, and what a multi-host
    launch (``torchrun -m adaptipe.runtime.worker --run-dir DIR``) needs beforehand.
    """
    source: Path | None = None
    if not isinstance(config, RunConfig):
        source = Path(config)
        config = load_config(source)
    run = RunDir(run_dir if run_dir is not None else config.train.run_dir)
    existing = ckpt.latest(run.checkpoints)
    if existing is not None:
        raise PlanError(
            f"{run.root} already holds a trained run (checkpoint {existing.name}); continue it with "
            f"`adaptipe train --resume {run.root}`, or choose another --run-dir"
        )
    plans = resolve_plans(config)
    run.write_plans(
        config=config,
        partition=plans.partition,
        schedule=plans.schedule,
        profile=plans.profile,
        config_source=source,
        extra=plans.extra,
    )
    if run.metrics.exists():
        run.metrics.unlink()
    run.summary.unlink(missing_ok=True)  # an earlier attempt's: this run has not finished
    # A fresh run: an earlier attempt's stop requests, active sets and recorded switches
    # (kept for resumes) must not apply to it.
    shutil.rmtree(run.root / "control", ignore_errors=True)
    return run, config


def train(
    config: RunConfig | str | Path,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    on_iteration: ProgressFn | None = None,
    poll_s: float = 0.05,
    inject: str | Path | None = None,
    inject_seed: int = 0,
) -> TrainSummary:
    """Train a config over real stage processes; return the summary.

    Args:
        config: a `RunConfig`, or the path of its TOML file.
        run_dir: where plans, metrics and checkpoints go (default: the config's run_dir).
        resume: continue the run in ``run_dir`` from its latest checkpoint, with the
            resolved config and plans stored there.
        on_iteration: called with each merged metrics record and the total iteration count.
        inject: an interference scenario (TOML) to run next to training; its clock starts
            when every worker is ready, and its events join the telemetry stream.
        inject_seed: seed of the scenario's random draws (Poisson arrivals, kills).
    """
    if resume:
        if run_dir is None:
            raise PlanError("resuming needs the run directory")
        run = RunDir(run_dir)
        if not run.config_json.exists():
            raise PlanError(f"{run.root}: not a run directory (no config.json)")
        cfg = run.read_config()
        if cfg.sweep is not None and cfg.sweep.solver == "cpsat":
            from adaptipe.japsp.cpsat import available, missing_ortools

            if not available():  # a stop or a rung would re-plan with it mid-run
                raise missing_ortools(f"{run.root}: the run's")
        found = ckpt.latest(run.checkpoints)
        if found is None:
            raise PlanError(f"{run.root}: no committed checkpoint to resume from")
        spec = get_model(cfg.model.name, **cfg.model.config)
        _, meta = ckpt.load_compatible(
            found, model=spec.name, model_config=dict(spec.config), num_layers=spec.num_layers
        )
        start = int(meta["iteration"])
        total = cfg.iterations_total(len(spec.dataset(split=cfg.data.split)))
        if start >= total:
            raise PlanError(
                f"{run.root}: the run is complete (checkpoint {found.name} holds all {total} "
                "iterations); nothing to resume"
            )
        schedule = run.read_schedule()
    else:
        run, cfg = prepare(config, run_dir=run_dir)
        schedule = run.read_schedule()
        spec = get_model(cfg.model.name, **cfg.model.config)
        start = 0
    scenario = None
    if inject is not None:
        from adaptipe.inject import expand, load_scenario

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        scenario = load_scenario(inject, num_stages=schedule.num_stages, num_cores=cores)
        if scenario.poisson:
            scenario = expand(scenario, horizon_s=_SCENARIO_HORIZON_S, seed=inject_seed)
    try:
        return _run(
            run,
            cfg,
            spec,
            schedule,
            start=start,
            resume=resume,
            on_iteration=on_iteration,
            poll_s=poll_s,
            scenario=scenario,
            inject_seed=inject_seed,
        )
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: say how to go on
        exc.add_note(_resume_hint(run))
        raise


def _resume_hint(run: RunDir) -> str:
    last = ckpt.latest(run.checkpoints)
    if last is None:
        return f"no checkpoint in {run.root} yet: a new `adaptipe train` starts afresh"
    return f"resume from {last} with `adaptipe train --resume {run.root}`"


def _run(
    run: RunDir,
    cfg: RunConfig,
    spec: ModelSpec,
    schedule: Schedule,
    *,
    start: int,
    resume: bool,
    on_iteration: ProgressFn | None,
    poll_s: float,
    scenario: Scenario | None = None,
    inject_seed: int = 0,
) -> TrainSummary:
    total = cfg.iterations_total(len(spec.dataset(split=cfg.data.split)))
    run.clear_stage_files()
    follower = _Follower(
        run, schedule.num_stages, {str(job.index): job.batch_size for job in cfg.jobs}
    )
    controller = _controller(run, cfg, total)
    if controller is not None:
        mark_manager(run, running=True)  # `adaptipe stop` can tell its request is heard
    t0 = time.monotonic()
    # Injection events travel as telemetry, so a scenario keeps the collector on.
    monitored = cfg.train.telemetry or scenario is not None
    collector = Collector(jsonl=run.telemetry).start() if monitored else None
    control_dir = run.root / "inject" if scenario is not None else None
    procs = _spawn(
        run,
        schedule.num_stages,
        resume=resume,
        telemetry=collector.address if collector is not None else None,
        telemetry_interval_s=cfg.train.telemetry_interval_s,
        control_dir=control_dir,
    )
    interference = None
    if scenario is not None:
        assert collector is not None
        interference = _Interference(
            scenario, collector.address, run.root / "inject", procs, inject_seed
        )
    for log in (run.metrics, run.root / "control.jsonl"):
        run.drop_torn_line(log)  # appended to below
    run.forget_metrics_from(start)  # trained again from the checkpoint: logged once
    try:
        with (
            _sigterm_raises(),
            run.metrics.open("a") as metrics,
            (run.root / "control.jsonl").open("a") as control_log,
        ):
            while True:
                new = follower.poll()
                if (
                    interference is not None
                    and not interference.started
                    and follower.ready >= len(procs)
                ):
                    interference.start()
                for rec in new:
                    metrics.write(json_line(rec))
                    metrics.flush()
                    if interference is not None:
                        interference.on_iteration(rec["iteration"] + 1)
                    if on_iteration is not None:
                        on_iteration(rec, total)
                if controller is not None:
                    for event in controller.poll():
                        control_log.write(json_line(event))
                        control_log.flush()
                codes = [p.poll() for p in procs]
                failed = next((s for s, c in enumerate(codes) if c not in (None, 0)), None)
                if failed is not None:
                    raise _failure(run, failed, codes[failed])
                if all(c == 0 for c in codes):
                    for rec in follower.poll():
                        metrics.write(json_line(rec))
                        if on_iteration is not None:
                            on_iteration(rec, total)
                    break
                time.sleep(poll_s)
            if controller is not None:
                for event in controller.poll():  # requests that came with the last records
                    control_log.write(json_line(event))
                # A stop that came in the last window changed nothing: say so.
                late = unadopted_stops(run, cfg)
                if late:
                    event = {"event": "stop_unadopted", "jobs": sorted(late), "why": _LATE}
                    control_log.write(json_line(event))
    finally:
        if interference is not None:
            interference.stop()
        _stop(procs)
        if collector is not None:
            collector.close()
        if controller is not None:
            mark_manager(run, running=False)
    wall = time.monotonic() - t0
    summary = _summarise(run, follower.merged, start=start, wall=wall)
    if cfg.sweep is not None:
        summary = replace(summary, jobs=_rank_jobs(run))
    write_json(run.summary, summary.to_json())  # to_json: strict already
    return summary


_LATE = "the run ended before the next window boundary: trained to the end"


def _controller(run: RunDir, cfg: RunConfig, total: int) -> JobController | None:
    """The early-termination controller of a job-array run (None for one job)."""
    if cfg.sweep is None:
        return None
    instance = load_json_file(run.root / "japsp-instance.json", JapspInstance.from_json)
    return JobController(run, cfg, instance, total=total)


def _rank_jobs(run: RunDir) -> list[dict[str, Any]]:
    """The sweep's jobs ranked by validation loss, with their last training loss and,
    for jobs stopped early, when and why.

    Read from the whole run (every launch of a resumed run): the metrics log and the
    workers' recorded switches. A stop committed but never adopted (it came in the last
    window) did not stop anything: such a job's row says so under ``stop_unadopted``.
    """
    from adaptipe.runtime.control import adoptions, read_active
    from adaptipe.runtime.export import evaluate_jobs

    last: dict[str, float] = {}
    for rec in run.read_metrics():  # in file order: a resumed run's records come last
        last.update(rec.get("losses") or {})
    switched = sorted(adoptions(run).items())
    stopped = read_active(run, switched[-1][0]).stopped if switched else {}
    # The iteration a stop took effect at: the first switch whose active set lacks the job.
    took_effect: dict[int, int] = {}
    for version, iteration in switched:
        jobs = read_active(run, version).jobs
        for job in stopped:
            if job not in jobs:
                took_effect.setdefault(job, iteration)
    late = unadopted_stops(run)
    rows = evaluate_jobs(run.root)
    for row in rows:
        row["train_loss"] = last.get(str(row["job"]))
        info = stopped.get(int(row["job"]))
        if info is not None:
            row["stopped"] = {**info, "iteration": took_effect.get(int(row["job"]))}
        elif int(row["job"]) in late:
            row["stop_unadopted"] = {**late[int(row["job"])], "why": _LATE}
    return rows


_SCENARIO_HORIZON_S = 24 * 3600.0  # Poisson arrivals are drawn this far ahead


class _Interference:
    """Runs an injection scenario next to training; its events go into the telemetry."""

    def __init__(
        self,
        scenario: Scenario,
        telemetry: str,
        control_dir: Path,
        procs: list[subprocess.Popen[bytes]],
        seed: int,
    ) -> None:
        from adaptipe.inject import ScenarioRunner
        from adaptipe.monitor.publisher import Publisher

        self.procs = procs
        self.publisher = Publisher(telemetry, stage=0)
        self.runner = ScenarioRunner(
            scenario,
            on_event=self._event,
            control_dir=control_dir,
            kill_stage=self._kill,
            seed=seed,
        )
        self.started = False

    def _event(self, event: InjectEvent) -> None:
        from adaptipe.monitor.schema import Event

        detail: dict[str, str | int | float | bool | None] = {"injector": event.injector}
        detail.update(
            {k: v for k, v in event.detail.items() if isinstance(v, str | int | float | bool)}
        )
        self.publisher.publish(
            Event(kind=event.kind, time_s=time.time(), stage=event.stage, detail=detail)
        )

    def _kill(self, stage: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[stage].pid, signal.SIGKILL)  # spot preemption of that worker

    def start(self) -> None:
        self.runner.start()
        self.started = True

    def on_iteration(self, iteration: int) -> None:
        if self.started:
            self.runner.on_iteration(iteration)

    def stop(self) -> None:
        self.runner.stop()
        self.publisher.close(linger_s=0.5)


def _failure(run: RunDir, stage: int, code: int | None) -> StageFailed:
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
    resume = f"; {_resume_hint(run)}" if ckpt.latest(run.checkpoints) else ""
    return StageFailed(f"stage {stage} failed: {cause} (log: {run.log(stage)}){resume}")


def _summarise(
    run: RunDir, merged: list[dict[str, Any]], *, start: int, wall: float
) -> TrainSummary:
    # Steady-state throughput: skip the first iteration (start-up, warm caches), or the
    # first window of a job-array, whose records share its start-up evenly.
    first = int(merged[0].get("window", 1)) if merged else 1
    steady = merged[first:] if len(merged) > first else merged
    span = sum(r["iteration_s"] for r in steady)
    stages: list[dict[str, float]] = []
    if steady:
        for s in range(len(steady[0]["stages"])):
            rows = [r["stages"][s] for r in steady]
            stage = {k: sum(row[k] for row in rows) / len(rows) for k in _STAGE_FIELDS}
            if all("resident_jobs" in row for row in rows):  # a job-array
                stage["resident_jobs"] = max(row["resident_jobs"] for row in rows)
                stage["state_wait_s"] = sum(row["state_wait_s"] for row in rows) / len(rows)
            stages.append(stage)
    last = ckpt.latest(run.checkpoints)
    return TrainSummary(
        run_dir=str(run.root),
        iterations=len(merged),
        start_iteration=start,
        final_loss=merged[-1]["loss"] if merged else None,
        samples_per_s=sum(r["samples"] for r in steady) / span if span > 0 else 0.0,
        wall_s=wall,
        stages=stages,
        checkpoint=str(last) if last else None,
    )
