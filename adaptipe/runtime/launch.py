"""The manager: resolve plans, start one worker per stage, watch them, summarise.

`train` is what ``adaptipe train`` calls. It writes every plan into the run directory
(`prepare`), starts the stage workers (`supervisor`) and follows their per-stage reports
to merge one metrics record per iteration (`metrics_merge`) and drive the progress bar;
a sweep's stop requests are decided alongside (`control`). A worker that dies, by an
exception or a signal, ends the run within seconds with an error naming the stage and
the cause; every other worker is stopped by its process id (never by name), and the last
committed checkpoint stays intact. The run ends with its `TrainSummary` (`summary`).
"""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError
from adaptipe.japsp.instance import JapspInstance
from adaptipe.models import ModelSpec
from adaptipe.monitor.collector import Collector
from adaptipe.monitor.schema import Event
from adaptipe.runtime.adapt_loop import AdaptLoop, Decider, DeciderFactory
from adaptipe.runtime.bootstrap import EXIT_RESTART
from adaptipe.runtime.config import RunConfig, parse_config
from adaptipe.runtime.control import (
    JobController,
    checkpoint_due,
    mark_manager,
    unadopted_stops,
)
from adaptipe.runtime.heap import settled
from adaptipe.runtime.host import fit_to_host, this_host
from adaptipe.runtime.interference import Interference, load_interference
from adaptipe.runtime.managerinfo import read_manager
from adaptipe.runtime.metrics_merge import MetricsFollower
from adaptipe.runtime.pace import ADAPT_POLL_S, Pace
from adaptipe.runtime.plans import Plans, resolve_plans
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.summary import LATE_STOP, TrainSummary, rank_jobs, summarise
from adaptipe.runtime.supervisor import (
    LocalWorkers,
    StageFailed,
    Terminated,
    Workers,
    failure,
    resume_hint,
    sigterm_raises,
    spawn,
)
from adaptipe.runtime.tboard import final_validation, open_sink, with_sink
from adaptipe.schedule.replicate import ReplicaLayout
from adaptipe.schedule.types import Schedule
from adaptipe.serial import json_line, load_json_file, write_json

if TYPE_CHECKING:
    from adaptipe.inject.scenario import Scenario
    from adaptipe.monitor.publisher import Publisher
    from adaptipe.monitor.tensorboard import TensorBoardSink

__all__ = [
    "Plans",
    "StageFailed",
    "Terminated",
    "TrainSummary",
    "prepare",
    "resolve_plans",
    "train",
]

ProgressFn = Callable[[dict[str, Any], int], None]


class Elsewhere(Protocol):
    """Workers that another launcher starts (torchrun, on other hosts): how the manager
    listens for them (`adaptipe.runtime.manage`)."""

    def start(
        self, run: RunDir, follower: MetricsFollower, *, monitored: bool
    ) -> tuple[Collector | None, Workers]:
        """Open the collector (when ``monitored``), mark this process as the run's
        manager with where the workers find it, and return both."""
        ...


def prepare(
    config: RunConfig | str | Path, *, run_dir: str | Path | None = None
) -> tuple[RunDir, RunConfig]:
    """Resolve a config's plans and write them into a fresh run directory.

    This is all ``adaptipe train`` does before it starts workers, and what a multi-host
    launch (``torchrun -m adaptipe.runtime.worker --run-dir DIR``) needs beforehand. The
    config is checked against this host, which runs the workers (`fit_to_host`).
    """
    source: Path | None = None
    if not isinstance(config, RunConfig):
        source = Path(config)
        config = parse_config(source)
    # This host starts every worker: check the config against it (`load_config` in two).
    unfitted, config = config, fit_to_host(config, this_host())
    run = RunDir(run_dir if run_dir is not None else config.train.run_dir)
    existing = ckpt.latest(run.checkpoints)
    if existing is not None:
        raise PlanError(
            f"{run.root} already holds a trained run (checkpoint {existing.name}); continue it with "
            f"`adaptipe train --resume {run.root}`, or choose another --run-dir"
        )
    plans = resolve_plans(config)
    if plans.partition.replicas != config.pipeline.replicas and max(plans.partition.replicas) > 1:
        # a plan file's replicas: the config says them too, and they count as processes
        pipeline = replace(unfitted.pipeline, replicas=plans.partition.replicas)
        config = fit_to_host(replace(unfitted, pipeline=pipeline), this_host())
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
    # A fresh run: an earlier attempt's stop requests, active sets and switches must go.
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
    decider: DeciderFactory | None = None,
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
        decider: builds the controller ``[adapt].controller`` names
            (`adaptipe.controllers.live.decider`, which the CLI passes); needed when it
            is not "none" (controllers sit above the runtime in the import order).
    """
    if resume:
        if run_dir is None:
            raise PlanError("resuming needs the run directory")
        run, cfg, start = _resumable(RunDir(run_dir))
    else:
        run, cfg = prepare(config, run_dir=run_dir)
        start = 0
    schedule = run.read_schedule()
    spec = cfg.model.spec()
    scenario = None
    if inject is not None:
        cores = this_host().cores
        scenario = load_interference(
            inject, num_stages=schedule.num_stages, num_cores=cores, seed=inject_seed
        )
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
            decider=decider,
        )
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: say how to go on
        exc.add_note(resume_hint(run))
        raise


def _resumable(run: RunDir) -> tuple[RunDir, RunConfig, int]:
    """A run directory's saved config and the iteration its last checkpoint reached."""
    if not run.config_json.exists():
        raise PlanError(f"{run.root}: not a run directory (no config.json)")
    cfg = run.read_config()  # fitted to this host (`RunConfig.from_dict`)
    if cfg.sweep is not None and cfg.sweep.solver == "cpsat":
        from adaptipe.japsp.cpsat import available, missing_ortools

        if not available():  # a stop or a rung would re-plan with it mid-run
            raise missing_ortools(f"{run.root}: the run's")
    found = ckpt.latest(run.checkpoints)
    if found is None:
        raise PlanError(f"{run.root}: no committed checkpoint to resume from")
    spec = cfg.model.spec()
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
    return run, cfg, start


@dataclass(slots=True, kw_only=True)
class _Launch:
    """One launch's moving parts, which `_follow` watches until the workers finish."""

    run: RunDir
    cfg: RunConfig
    total: int
    workers: Workers
    follower: MetricsFollower
    controller: JobController | None
    collector: Collector | None
    interference: Interference | None
    on_iteration: ProgressFn | None
    start: int = 0  # the first iteration this launch trains
    adapt: AdaptLoop | None = None  # [adapt].controller's decision loop
    publisher: Publisher | None = None  # the manager's own events into the telemetry stream
    tensorboard: TensorBoardSink | None = None  # RUN_DIR/tensorboard ([train] tensorboard)
    marked: bool = False  # this process is marked as the run's manager

    def announce(self, events: list[dict[str, Any]]) -> None:
        """Put the migrations and the controller's moves and errors among ``events`` on
        the telemetry stream too (so ``adaptipe monitor`` lists them with the
        injections), and the validation losses of halving rungs into TensorBoard."""
        if self.tensorboard is not None:
            for e in events:
                self.tensorboard.control(e)
        if self.collector is None:
            return
        for e in events:
            detail = _announced(e)
            if detail is None:
                continue
            if self.publisher is None:
                from adaptipe.monitor.publisher import Publisher

                info = read_manager(self.run)  # off loopback: the workers' CURVE keys
                curve = info.curve() if info is not None else None
                self.publisher = Publisher(self.collector.address, stage=0, curve=curve)
            self.publisher.publish(Event(kind=e["event"], time_s=time.time(), detail=detail))

    def close(self) -> None:
        """Stop the scenario, the workers (by pid), the collector; in that order."""
        if self.interference is not None:
            self.interference.stop()
        self.workers.stop()
        if self.publisher is not None:
            self.publisher.close(linger_s=0.5)
        if self.collector is not None:
            self.collector.drain()  # what the stages sent last: into telemetry.jsonl too
            self.collector.close()
        if self.marked:
            mark_manager(self.run, running=False)
        if self.tensorboard is not None:
            self.tensorboard.close()


def _announced(e: dict[str, Any]) -> dict[str, Any] | None:
    """The telemetry detail of a control event worth announcing (None: not announced):
    every migration, and each decision that moves or failed."""
    if e.get("event") == "migration":
        detail = {
            "iteration": e["iteration"],
            "ok": e["ok"],
            "bounds": ",".join(str(b) for b in e["bounds"]),
            "bytes": e["bytes"],
            "seconds": round(e["seconds"], 6),
        }
        if e["causes"]:
            detail["cause"] = "; ".join(e["causes"])[:200]
        return detail
    decision = e.get("decision") or {}
    if e.get("event") != "decision" or (decision.get("bounds") is None and "error" not in e):
        return None
    out = {"iteration": e["iteration"], "controller": e["controller"], "acted": e["acted"]}
    if decision.get("bounds") is not None:
        out["bounds"] = ",".join(str(b) for b in decision["bounds"])
    why = e.get("error") or decision.get("reason", "")
    return out | {"reason": str(why)[:200]}


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
    elsewhere: Elsewhere | None = None,
    decider: DeciderFactory | None = None,
) -> TrainSummary:
    """Follow the run's workers to the end: started here (`spawn`), or, with
    ``elsewhere``, by another launcher (torchrun) that `adaptipe.runtime.manage` waits for."""
    total = cfg.iterations_total(len(spec.dataset(split=cfg.data.split)))
    run.clear_stage_files()
    follower = MetricsFollower(
        run, schedule.num_stages, {str(job.index): job.batch_size for job in cfg.jobs}
    )
    controller = _controller(run, cfg, total)
    if cfg.adapt.controller != "none" and decider is None:
        raise PlanError(
            f"{run.config_json}: [adapt].controller = {cfg.adapt.controller!r} needs its "
            "decider: pass decider=adaptipe.controllers.live.decider (`adaptipe train` and "
            "`adaptipe manage` do)"
        )
    # Built before any worker starts: a controller that cannot run here (a learned policy
    # for another stage count) is refused with nothing to clean up.
    chosen = decider(run, cfg) if decider is not None and cfg.adapt.controller != "none" else None
    sink = open_sink(run, cfg)  # before the workers: importing tensorboard takes ~1 s
    t0 = time.monotonic()
    # Injection events travel as telemetry, so a scenario keeps the collector on.
    monitored = cfg.train.telemetry or scenario is not None
    procs = None
    if elsewhere is not None:
        collector, workers = elsewhere.start(run, follower, monitored=monitored)
        marked = True  # with where its telemetry goes: the workers look it up
    else:
        marked = controller is not None or (decider is not None and cfg.train.telemetry)
        if marked:  # `adaptipe stop` and `adaptipe adapt` can tell their request is heard
            mark_manager(run, running=True)
        collector = Collector(jsonl=run.telemetry) if monitored else None  # `_follow` drives it
        control_dir = run.root / "inject" if scenario is not None else None
        start_workers = functools.partial(
            spawn,
            run,
            ReplicaLayout.of(run.read_partition().replicas, schedule.num_stages).world,
            telemetry=collector.address if collector is not None else None,
            telemetry_interval_s=cfg.train.telemetry_interval_s,
            control_dir=control_dir,
        )
        procs = start_workers(resume=resume)
        workers = LocalWorkers(procs, functools.partial(start_workers, resume=True))
    launch = _Launch(
        run=run,
        cfg=cfg,
        total=total,
        workers=workers,
        follower=follower,
        controller=controller,
        collector=collector,
        interference=None,
        on_iteration=with_sink(on_iteration, sink),
        start=start,
        marked=marked,
        tensorboard=sink,
    )
    if decider is not None and collector is not None and cfg.train.telemetry:
        launch.adapt = _adapt_loop(run, cfg, decider, chosen, collector, start, total)
    try:
        if scenario is not None:
            assert collector is not None
            # torchrun's workers: telemetry off loopback, with the keys manage made
            info = read_manager(run) if elsewhere is not None else None
            curve = info.curve() if info is not None else None
            launch.interference = Interference(
                scenario, collector.address, run.root / "inject", procs, inject_seed, curve=curve
            )
        for log in (run.metrics, run.root / "control.jsonl"):
            run.drop_torn_line(log)  # appended to below
        run.forget_metrics_from(start)  # trained again from the checkpoint: logged once
        with (
            sigterm_raises(),
            run.metrics.open("a") as metrics,
            (run.root / "control.jsonl").open("a") as control_log,
            settled(),  # no full collection walks the start-up heap while it trains
        ):
            _follow(launch, metrics, control_log, poll_s=poll_s)
    finally:
        launch.close()
    wall = time.monotonic() - t0
    summary = summarise(run, follower.merged, start=start, wall=wall)
    if cfg.sweep is not None:
        summary = replace(summary, jobs=rank_jobs(run))
        final_validation(run, cfg, summary.jobs, start + summary.iterations)
    write_json(run.summary, summary.to_json())  # to_json: strict already
    return summary


def _follow(launch: _Launch, metrics: IO[str], control_log: IO[str], *, poll_s: float) -> None:
    """Log merged metrics and control events until every worker has exited cleanly;
    raise `StageFailed` as soon as one has not."""
    follower, controller, interference = launch.follower, launch.controller, launch.interference
    on_iteration, workers, collector = launch.on_iteration, launch.workers, launch.collector
    pace = Pace(poll_s=poll_s, stages=follower.stages, next_iteration=launch.start)
    while True:
        if collector is not None:
            collector.pump()  # what came while we waited: one batch, before a decision reads it
        new = follower.poll()
        if (
            interference is not None
            and not interference.started
            and follower.ready >= follower.stages
        ):
            interference.start()
        for rec in new:
            pace.next_iteration = int(rec["iteration"]) + 1
            metrics.write(json_line(rec))
            metrics.flush()
            if interference is not None:
                interference.on_iteration(rec["iteration"] + 1)
            if on_iteration is not None:
                on_iteration(rec, launch.total)
        events = [*follower.migrations(), *(controller.poll() if controller is not None else [])]
        if launch.adapt is not None:
            events += launch.adapt.poll(new, answer_wait_s=ADAPT_POLL_S)
        for event in events:
            control_log.write(json_line(event))
            control_log.flush()
        launch.announce(events)
        codes = workers.codes()
        if all(c == EXIT_RESTART for c in codes):  # [adapt] method = "restart"
            workers.respawn()
            continue
        failed = next((s for s, c in enumerate(codes) if c not in (None, 0, EXIT_RESTART)), None)
        if failed is None and EXIT_RESTART in codes and 0 in codes:
            failed = codes.index(EXIT_RESTART)  # one stage restarts, another finished
        if failed is not None:
            raise failure(launch.run, failed, codes[failed])
        if all(c == 0 for c in codes):
            for rec in follower.poll():
                metrics.write(json_line(rec))
                if on_iteration is not None:
                    on_iteration(rec, launch.total)
            last = follower.migrations()
            if launch.adapt is not None:
                last += launch.adapt.close()
            for event in last:
                control_log.write(json_line(event))
            launch.announce(last)
            break
        pace.wait(launch.adapt, collector)
    if controller is not None:
        for event in controller.poll():  # requests that came with the last records
            control_log.write(json_line(event))
        late = unadopted_stops(launch.run, launch.cfg)
        if late:  # a stop that came in the last window changed nothing: say so
            event = {"event": "stop_unadopted", "jobs": sorted(late), "why": LATE_STOP}
            control_log.write(json_line(event))


def _adapt_loop(
    run: RunDir,
    cfg: RunConfig,
    factory: DeciderFactory,
    chosen: Decider | None,
    collector: Collector,
    start: int,
    total: int,
) -> AdaptLoop:
    """The decision loop; with no controller configured it idles until ``adaptipe adapt``
    names one."""
    return AdaptLoop(
        run,
        cfg.adapt,
        chosen,
        collector.for_decision,
        start=start,
        rebuild=functools.partial(_rebuild, factory, run, cfg),
        checkpoint_due=functools.partial(checkpoint_due, cfg, total=total),
        memory_warnings=cfg.train.stage_memory_mb is not None,
    )


def _rebuild(factory: DeciderFactory, run: RunDir, cfg: RunConfig, name: str) -> Decider | None:
    """The controller ``name`` for this run (``adaptipe adapt --controller``)."""
    if name == "none":
        return None
    return factory(run, replace(cfg, adapt=replace(cfg.adapt, controller=name)))


def _controller(run: RunDir, cfg: RunConfig, total: int) -> JobController | None:
    """The early-termination controller of a job-array run (None for one job)."""
    if cfg.sweep is None:
        return None
    instance = load_json_file(run.root / "japsp-instance.json", JapspInstance.from_json)
    return JobController(run, cfg, instance, total=total)
