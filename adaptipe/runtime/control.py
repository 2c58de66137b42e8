"""Early termination in a job-array: stop requests, successive halving, the active set.

A job of a running array can be stopped by the user (``adaptipe stop RUN_DIR JOB`` or
`stop_jobs`) or by successive halving on validation loss (``[sweep] halving_every``).
Either way the manager re-plans the block order for the remaining jobs from the run's
JAPSP instance (no re-profiling) and commits a new plan version with the remaining jobs
(`adaptipe.runtime.planversion`); the workers adopt it
at the next iteration boundary (the window that runs is cut short there,
`adaptipe.runtime.windowcut`), without a restart. The
remaining jobs' numerics are untouched: each job's state, data stream and optimizer
only ever see that job's blocks.

Files under ``RUN_DIR/control/``::

    requests/stop-*.json   one per stop request: {"jobs": [...], "reason": ...}
    active-*.json, adopted-*.json   plan versions and their adoption (planversion.py)
    rung-NNNNNN.json       successive halving decided at that iteration: {"version": N}
    manager.json           {"pid": P, "host": H} while `adaptipe train` manages the run

Rank 0 reads ``active.json`` at each window boundary and broadcasts the version, so
every worker switches at the same boundary (`adaptipe.runtime.follower`); each then
reads the immutable version file. At a halving rung rank 0 first waits for the manager's decision, which makes the
set of survivors (and the iteration they are decided at) deterministic.

A run resumed from a checkpoint replays the recorded switches: each version comes into
force at the iteration it did before (windows end there), so a job stopped after the
checkpoint trains up to its stop again, as it did, and the run ends as an
uninterrupted one would. Versions committed but never adopted are taken up afterwards.
"""

from __future__ import annotations

import math
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptipe.errors import PlanError
from adaptipe.japsp.instance import JapspInstance
from adaptipe.runtime.managerinfo import ManagerInfo, clear_manager, read_manager, write_manager
from adaptipe.runtime.planversion import (
    ActiveSet,
    PlanVersion,
    adoptions,
    commit_plan,
    current_version,
    read_active,
    remap_jobs,
    replans,
)
from adaptipe.runtime.rundir import RunDir
from adaptipe.serial import read_json, write_json

if TYPE_CHECKING:
    from adaptipe.runtime.config import RunConfig
    from adaptipe.schedule.types import Schedule

__all__ = [
    "ActiveSet",
    "JobController",
    "PlanVersion",
    "adoptions",
    "array_jobs",
    "current_version",
    "halving_survivors",
    "has_finished",
    "is_rung",
    "manager_running",
    "mark_manager",
    "read_active",
    "remap_jobs",
    "replans",
    "rung_decided",
    "stop_jobs",
    "unadopted_stops",
]


# ---------------------------------------------------------------------- files
def _control(run: RunDir) -> Path:
    return run.root / "control"


def unadopted_stops(run: RunDir, config: RunConfig | None = None) -> dict[int, dict[str, Any]]:
    """Stops committed after the workers' last switch, ``{job: why}``: the run ended
    before the next iteration boundary, so those jobs trained to the end."""
    adopted = adoptions(run)
    last = max(adopted, default=0)
    newest = current_version(run)
    if newest <= last:
        return {}
    before = read_active(run, last, config).stopped if last else {}
    after = read_active(run, newest, config).stopped
    return {j: info for j, info in after.items() if j not in before}


def mark_manager(run: RunDir, *, running: bool, info: ManagerInfo | None = None) -> None:
    """Say (or unsay) that this process manages ``run``: stop requests are answered.
    ``info``: what to record (default: this process, no telemetry address)."""
    if running:
        write_manager(run, info if info is not None else ManagerInfo.here())
    else:
        clear_manager(run)


def manager_running(run: RunDir) -> bool | None:
    """Whether a manager answers ``run``'s stop requests now: False when none is marked or
    the marked one (on this host) has exited; None when it runs on another host."""
    info = read_manager(run)
    if info is None:
        return False
    if info.host != socket.gethostname():
        return None
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _rung_path(run: RunDir, iteration: int) -> Path:
    return _control(run) / f"rung-{iteration:06d}.json"


def rung_decided(run: RunDir, iteration: int) -> int | None:
    """The active-set version decided at halving rung ``iteration``, if it is decided."""
    path = _rung_path(run, iteration)
    if not path.exists():
        return None
    return int(read_json(path)["version"])


def is_rung(config: RunConfig, iteration: int, total: int) -> bool:
    """Whether successive halving decides at the boundary before ``iteration`` (of ``total``)."""
    every = config.sweep.halving_every if config.sweep is not None else 0
    return every > 0 and 0 < iteration < total and iteration % every == 0


def checkpoint_due(config: RunConfig, done: int, total: int) -> bool:
    """Whether a checkpoint is written once ``done`` of ``total`` iterations have run:
    every ``[train].checkpoint_every``, at the end, and at each halving rung (the workers
    write it; the decision loop saves its own state at the same boundaries)."""
    every = config.train.checkpoint_every
    return (every > 0 and done % every == 0) or done == total or is_rung(config, done, total)


def halving_survivors(losses: dict[int, float], keep: float) -> list[int]:
    """The best ``ceil(keep * n)`` jobs by validation loss (at least one); ties by index.

    A non-finite loss (a diverged job) ranks last.
    """
    n = max(1, math.ceil(keep * len(losses)))
    ranked = sorted(losses, key=lambda j: (not math.isfinite(losses[j]), losses[j], j))
    return sorted(ranked[:n])


# ---------------------------------------------------------------------- user API
def _resolve_jobs(
    names_in_order: Sequence[str], jobs: Sequence[int | str], where: str
) -> list[int]:
    names = {name: index for index, name in enumerate(names_in_order)}
    count = len(names_in_order)
    out: list[int] = []
    for job in jobs:
        if isinstance(job, str) and job in names:  # a name first: a job may be named "3"
            index = names[job]
        elif isinstance(job, int) or (isinstance(job, str) and job.isdigit()):
            index = int(job)
            if not 0 <= index < count:
                raise PlanError(f"{where}: job {index} is not in the array (0..{count - 1})")
        else:
            raise PlanError(
                f"{where}: no job named {job!r} (jobs: {', '.join(names)}; or an index)"
            )
        out.append(index)
    return out


def array_jobs(run: RunDir) -> tuple[list[str], int | None]:
    """The job names of a job-array run and its iteration count, read from its saved
    config without building it (no model, no torch: `adaptipe stop` answers at once)."""
    data = read_json(run.config_json)
    sweep = data.get("sweep") if isinstance(data, dict) else None
    if not isinstance(sweep, dict):
        raise PlanError(f"{run.root}: not a job-array run (no [sweep]); nothing to stop")
    try:
        names = [str(job["name"]) for job in sweep["jobs"]]
        iterations = data.get("train", {}).get("iterations")
    except (KeyError, TypeError, AttributeError) as exc:
        raise PlanError(f"{run.config_json}: malformed config.json ({exc})") from None
    return names, iterations if isinstance(iterations, int) else None


def _checkpointed(run: RunDir) -> int | None:
    """The iteration the run's latest checkpoint holds (its pointer, read raw), if any."""
    try:
        return int(read_json(run.checkpoints / "latest.json")["iteration"])
    except (OSError, PlanError, KeyError, TypeError, ValueError):
        return None


def has_finished(run: RunDir, iterations: int | None) -> bool:
    """Whether the run is done: its summary is written, or (a few seconds before, while
    the jobs are evaluated) its latest checkpoint holds all ``iterations``."""
    return run.summary.exists() or (iterations is not None and _checkpointed(run) == iterations)


def stop_jobs(
    run_dir: str | os.PathLike[str], jobs: Sequence[int | str], *, reason: str = "user"
) -> list[int]:
    """Ask a running job-array to stop ``jobs`` (sweep indices or names); returns indices.

    The manager re-plans for the remaining jobs and the workers switch at the next
    window boundary. Stopping every job, a job of a run that has finished, or a run that
    is not a job-array, is an error.
    """
    run = RunDir(Path(run_dir))
    if not run.config_json.exists():
        raise PlanError(f"{run.root}: not a run directory (no config.json)")
    names, iterations = array_jobs(run)
    if has_finished(run, iterations):
        raise PlanError(
            f"{run.root}: the run has finished (all {iterations} iterations; "
            f"see {run.summary.name}); there is nothing left to stop"
        )
    if not jobs:
        raise PlanError(f"{run.root}: name at least one job to stop")
    indices = _resolve_jobs(names, jobs, str(run.root))
    version = current_version(run)
    running = read_active(run, version).jobs if version else tuple(range(len(names)))
    if not set(indices) & set(running):
        gone = ", ".join(names[j] for j in sorted(set(indices)))
        raise PlanError(f"{run.root}: job(s) {gone} already stopped; nothing to do")
    if not set(running) - set(indices):
        raise PlanError(
            f"{run.root}: stopping {sorted(set(indices))} would leave no job running "
            f"(active: {list(running)}); stop the run instead"
        )
    _request_stop(run, indices, reason)
    return indices


def _request_stop(run: RunDir, jobs: list[int], reason: str) -> None:
    """Leave a stop request for the manager (`JobController.poll` reads it)."""
    folder = _control(run) / "requests"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"stop-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
    write_json(folder / name, {"jobs": jobs, "reason": reason, "time": time.time()})


# ---------------------------------------------------------------------- manager
class JobController:
    """The manager's side: turns stop requests and halving rungs into active sets.

    ``poll(done)`` is called from the manager's loop with the number of iterations
    every stage has finished; it never blocks the workers except at a halving rung,
    where rank 0 waits for the decision.
    """

    def __init__(
        self, run: RunDir, config: RunConfig, instance: JapspInstance, *, total: int
    ) -> None:
        if config.sweep is None:
            raise PlanError("JobController needs a job-array run ([sweep])")
        self.run = run
        self.config = config
        self.instance = instance
        self.total = total
        self.version = current_version(run)
        self.active = read_active(run, self.version, config)
        self._seen: set[str] = set()
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        """Handle new stop requests and a pending halving rung; returns new events."""
        new: list[dict[str, Any]] = []
        folder = _control(self.run) / "requests"
        if folder.is_dir():
            for path in sorted(folder.glob("stop-*.json")):
                if path.name in self._seen:
                    continue
                self._seen.add(path.name)
                try:
                    request = read_json(path)
                    jobs = [int(j) for j in request["jobs"]]
                    reason = str(request.get("reason", "user"))
                except (OSError, PlanError, KeyError, TypeError, ValueError) as exc:
                    new.append({"event": "stop_rejected", "request": path.name, "why": str(exc)})
                    continue
                new.extend(self._stop(jobs, reason=reason, iteration=None))
        new.extend(self._halving())
        self.events.extend(new)
        return new

    def _halving(self) -> list[dict[str, Any]]:
        from adaptipe.runtime import checkpoint as ckpt
        from adaptipe.runtime.export import evaluate_jobs

        sweep = self.config.sweep
        assert sweep is not None
        if sweep.halving_every <= 0:
            return []
        found = ckpt.latest(self.run.checkpoints)
        if found is None:
            return []
        iteration = int(read_json(found / ckpt.COMMITTED)["iteration"])
        if (
            not is_rung(self.config, iteration, self.total)
            or rung_decided(self.run, iteration) is not None
        ):
            return []
        events: list[dict[str, Any]] = []
        if len(self.active.jobs) > 1:
            rows = evaluate_jobs(self.run.root, jobs=self.active.jobs, checkpoint=found)
            losses = {int(r["job"]): float(r["val_loss"]) for r in rows}
            keep = halving_survivors(losses, sweep.halving_keep)
            gone = [j for j in self.active.jobs if j not in keep]
            events.append(
                {
                    "event": "halving",
                    "iteration": iteration,
                    "val_loss": {str(j): v for j, v in losses.items()},
                    "kept": keep,
                }
            )
            events.extend(
                self._stop(
                    gone,
                    reason=f"successive halving at iteration {iteration}",
                    iteration=iteration,
                    losses=losses,
                )
            )
        write_json(_rung_path(self.run, iteration), {"version": self.version})
        return events

    def _stop(
        self,
        jobs: Sequence[int],
        *,
        reason: str,
        iteration: int | None,
        losses: dict[int, float] | None = None,
    ) -> list[dict[str, Any]]:
        newest = current_version(self.run)  # a plan committed by another hand (a partition)
        if newest != self.version:
            self.version, self.active = newest, read_active(self.run, newest, self.config)
        gone = [j for j in dict.fromkeys(jobs) if j in self.active.jobs]
        remaining = [j for j in self.active.jobs if j not in gone]
        if not gone:
            return []
        if not remaining:
            return [{"event": "stop_rejected", "jobs": list(gone), "why": "no job would remain"}]
        stopped = dict(self.active.stopped)
        for j in gone:
            info: dict[str, Any] = {"reason": reason, "decided_at": iteration}
            if losses is not None and j in losses:
                info["val_loss"] = losses[j]
            stopped[j] = info
        # The new version keeps what the newest says of the partition and window, also
        # when a re-partition was committed while the solver ran (the remaining jobs'
        # block costs are then that partition's, and solved again).
        jobs_before = self.active.jobs
        solved: dict[JapspInstance, Schedule] = {}

        def stop(current: PlanVersion) -> PlanVersion:
            if current.jobs != jobs_before:
                raise PlanError(f"{self.run.root}: the active jobs changed while re-planning")
            costs = current.block_costs(self.instance, remaining)
            if costs not in solved:
                solved[costs] = self._solve(costs)
            return replace(
                current,
                jobs=tuple(remaining),
                schedule=solved[costs],
                stopped=stopped,
                instance=costs if current.instance is not None else None,
            )

        active = commit_plan(self.run, stop)
        version = active.version
        self.version, self.active = version, active
        return [
            {
                "event": "stop",
                "jobs": list(gone),
                "reason": reason,
                "active": list(remaining),
                "version": version,
                "makespan": active.schedule.meta.get("makespan"),
            }
        ]

    def _solve(self, costs: JapspInstance) -> Schedule:
        from adaptipe.japsp.array import solve_array
        from adaptipe.runtime.jobarray import solve_settings
        from adaptipe.schedule.validate import validate

        schedule, _ = solve_array(costs, solve_settings(self.config))
        validate(schedule)
        return schedule
