"""Plan versions: the partition, schedule, active jobs and window the workers run.

The manager (or a user, through `commit_plan`) *commits* a new version; every worker
*adopts* it at the same iteration boundary (rank 0 reads the newest version and
broadcasts it, `adaptipe.runtime.follower.PlanFollower`), and the boundary is recorded so
that a resumed run replays the switch where it happened. A version that changes the
partition moves layers between stages at that boundary (`adaptipe.runtime.migration`, or
through a checkpoint written there, as ``[adapt].method`` says; in a job-array it also
carries the block costs and order solved for that partition,
`adaptipe.runtime.partition_plan`); one that changes the active jobs stops jobs of a
job-array (`adaptipe.runtime.control`).

Files under ``RUN_DIR/control/``::

    active-NNNN.json   version N: jobs, stopped jobs, schedule, partition, block costs
                       (immutable)
    active.json        {"version": N}: the newest version (the commit point)
    adopted-NNNN.json  {"version": N, "iteration": I}: the workers switched to version N
                       at the boundary before iteration I

Version 0 is the run's own plan (``schedule.json``, ``partition.json``, every job).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptipe.errors import PlanError
from adaptipe.japsp.instance import JapspInstance
from adaptipe.plan.partition import Partition
from adaptipe.runtime.rundir import RunDir
from adaptipe.schedule.types import Instruction, Schedule
from adaptipe.serial import read_json, write_json

if TYPE_CHECKING:
    from adaptipe.runtime.config import RunConfig

__all__ = [
    "ActiveSet",
    "PlanVersion",
    "adoptions",
    "commit_plan",
    "current_version",
    "forget_adoption",
    "plan_history",
    "read_active",
    "record_adoption",
    "remap_jobs",
    "replans",
    "restore_history",
]

ACTIVE_KIND = "active_set"
ACTIVE_VERSION = 1


@dataclass(frozen=True, slots=True)
class PlanVersion:
    """What the workers run from one boundary on: which jobs train, the schedule that
    orders their blocks, the partition of the layers and the window length.

    ``schedule`` numbers the active jobs 0..k-1 (it is an ordinary, validated schedule);
    ``jobs[i]`` is the sweep index of its job ``i``. `global_schedule` gives the same
    instruction lists with sweep indices, which is what the workers execute.
    ``partition`` None keeps the run's partition; ``window`` None keeps the run's rule
    (``[sweep].window``). ``instance`` (job-arrays) holds the active jobs' block costs
    under this version's partition, in ``schedule``'s job numbering; None: the run's
    ``japsp-instance.json`` (the costs under the run's own partition) holds them.
    """

    version: int
    jobs: tuple[int, ...]
    schedule: Schedule
    stopped: dict[int, dict[str, Any]] = field(default_factory=dict)  # job -> why, when
    partition: Partition | None = None
    window: int | None = None
    instance: JapspInstance | None = None

    def block_costs(self, base: JapspInstance, jobs: Sequence[int] | None = None) -> JapspInstance:
        """The block costs of ``jobs`` (sweep indices; default: this version's active
        jobs, in order) under this version's partition. ``base`` is the run's instance
        (every job, sweep numbering), which holds them where ``instance`` is None."""
        chosen = list(self.jobs if jobs is None else jobs)
        if self.instance is None:
            return base.select(chosen)
        return self.instance.select([self.jobs.index(j) for j in chosen])

    def global_schedule(self, num_jobs: int) -> Schedule:
        return remap_jobs(self.schedule, self.jobs, num_jobs)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": ACTIVE_KIND,
            "version": ACTIVE_VERSION,
            "active_version": self.version,
            "jobs": list(self.jobs),
            "stopped": {str(j): info for j, info in sorted(self.stopped.items())},
            "schedule": self.schedule.to_json(),
            **({"partition": self.partition.to_json()} if self.partition is not None else {}),
            **({"window": self.window} if self.window is not None else {}),
            **({"instance": self.instance.to_json()} if self.instance is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "active set") -> PlanVersion:
        if not isinstance(data, dict) or data.get("kind") != ACTIVE_KIND:
            raise PlanError(f"{source}: not an active-set file")
        try:
            jobs = tuple(int(j) for j in data["jobs"])
            stopped = {int(j): dict(v) for j, v in data.get("stopped", {}).items()}
            version = int(data["active_version"])
            window = None if data.get("window") is None else int(data["window"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{source}: malformed active set ({exc})") from None
        if window is not None and window < 1:
            raise PlanError(f"{source}: window must be >= 1 (got {window})")
        schedule = Schedule.from_json(data["schedule"], source=f"{source}: schedule")
        if schedule.num_jobs != len(jobs):
            raise PlanError(
                f"{source}: the schedule has {schedule.num_jobs} jobs but {len(jobs)} are active"
            )
        partition = (
            Partition.from_json(data["partition"], source=f"{source}: partition")
            if data.get("partition") is not None
            else None
        )
        instance = (
            JapspInstance.from_json(data["instance"], source=f"{source}: instance")
            if data.get("instance") is not None
            else None
        )
        if instance is not None and instance.num_jobs != len(jobs):
            raise PlanError(
                f"{source}: the instance has {instance.num_jobs} jobs but {len(jobs)} are active"
            )
        return cls(
            version=version,
            jobs=jobs,
            schedule=schedule,
            stopped=stopped,
            partition=partition,
            window=window,
            instance=instance,
        )


def remap_jobs(schedule: Schedule, jobs: Sequence[int], num_jobs: int) -> Schedule:
    """``schedule`` with its job ``i`` renamed ``jobs[i]``, in an array of ``num_jobs``.

    The result is for execution only: jobs not in ``jobs`` have no instructions, which
    the validator (it checks every job of ``num_jobs``) would rightly reject.
    """
    if len(jobs) != schedule.num_jobs or len(set(jobs)) != len(jobs):
        raise PlanError(f"remap_jobs: {list(jobs)} must name {schedule.num_jobs} distinct jobs")
    if any(not 0 <= j < num_jobs for j in jobs):
        raise PlanError(f"remap_jobs: jobs {list(jobs)} must lie in 0..{num_jobs - 1}")

    def rename(ins: Instruction) -> Instruction:
        return replace(ins, job=jobs[ins.job])

    return replace(
        schedule,
        num_jobs=num_jobs,
        stages=tuple(tuple(rename(i) for i in stage) for stage in schedule.stages),
        meta={**schedule.meta, "jobs": list(jobs)},
    )


def _version_path(run: RunDir, version: int) -> Path:
    return _control(run) / f"active-{version:04d}.json"


def _adopted_path(run: RunDir, version: int) -> Path:
    return _control(run) / f"adopted-{version:04d}.json"


def adoptions(run: RunDir) -> dict[int, int]:
    """``{version: iteration}``: when the workers switched to each version (not 0)."""
    out: dict[int, int] = {}
    for path in sorted(_control(run).glob("adopted-*.json")):
        try:
            data = read_json(path)
            out[int(data["version"])] = int(data["iteration"])
        except (OSError, PlanError, KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{path}: not an adoption record ({exc})") from None
    return out


def replans(run: RunDir) -> list[dict[str, Any]]:
    """The switches the workers made, in order: ``{"iteration", "jobs" (how many train
    on), "window" (iterations per full window), "round_order" (a key of
    `adaptipe.japsp.window.ROUND_ORDERS`)}``, read from the run directory as written."""
    out = []
    for version, iteration in sorted(adoptions(run).items(), key=lambda item: item[1]):
        path = _version_path(run, version)
        try:
            data = read_json(path)
            meta = data["schedule"].get("meta", {})
            row = {
                "iteration": iteration,
                "jobs": len(data["jobs"]),
                "window": int(meta.get("window", 1)),
                "round_order": str(meta.get("round_order", "given")),
            }
        except (OSError, PlanError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"{path}: not an active set ({exc})") from None
        out.append(row)
    return out


def current_version(run: RunDir) -> int:
    """The newest committed version (0: the run's own plan), as ``active.json`` says."""
    try:
        return int(read_json(_control(run) / "active.json")["version"])
    except (OSError, PlanError, KeyError, TypeError, ValueError):
        return 0


def _newest_file(run: RunDir) -> int:
    """The highest version with a file (a commit whose pointer may not be written yet)."""
    found = [int(p.stem.split("-")[1]) for p in _control(run).glob("active-[0-9]*.json")]
    return max([current_version(run), *found])


def read_active(run: RunDir, version: int, config: RunConfig | None = None) -> PlanVersion:
    """Active-set ``version``; version 0 is every job with the run's ``schedule.json``."""
    if version == 0:
        jobs = len(config.jobs) if config is not None else _job_count(run)
        return PlanVersion(version=0, jobs=tuple(range(jobs)), schedule=run.read_schedule())
    path = _version_path(run, version)
    return PlanVersion.from_json(read_json(path), source=str(path))


ActiveSet = PlanVersion
"""A plan version read for its active jobs (the name job-array code has used)."""


def _job_count(run: RunDir) -> int:
    """How many jobs the run trains, read from its saved config without building it (no
    model, no torch: `adaptipe repartition` and `adaptipe stop` answer at once)."""
    data = read_json(run.config_json)
    sweep = data.get("sweep") if isinstance(data, dict) else None
    if not isinstance(sweep, dict):
        return 1
    jobs = sweep.get("jobs")
    if not isinstance(jobs, list) or not jobs:
        raise PlanError(f"{run.config_json}: [sweep] lists no jobs")
    return len(jobs)


def _control(run: RunDir) -> Path:
    return run.root / "control"


def plan_history(run: RunDir, upto: int) -> list[dict[str, Any]]:
    """The versions the workers had switched to by iteration ``upto``, in order, each
    ``{"version", "iteration", "plan"}`` (the version file's content): what a checkpoint
    of that iteration records, so that a resume can replay the switches from it alone."""
    out = []
    for version, iteration in sorted(adoptions(run).items(), key=lambda item: item[1]):
        if iteration <= upto:
            plan = read_json(_version_path(run, version))
            out.append({"version": version, "iteration": iteration, "plan": plan})
    return out


def restore_history(run: RunDir, history: Sequence[Any], *, source: str) -> list[int]:
    """Put a checkpoint's plan history (`plan_history`) back into ``run``'s control
    folder where it is missing; returns the versions restored.

    A version file or adoption record that is there but says otherwise is an error
    (the checkpoint is from another run): nothing is overwritten.
    """
    restored = []
    for entry in history:
        try:
            version, iteration = int(entry["version"]), int(entry["iteration"])
            plan = PlanVersion.from_json(entry["plan"], source=f"{source}: version {version}")
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{source}: malformed plan history ({exc})") from None
        path = _version_path(run, version)
        _control(run).mkdir(parents=True, exist_ok=True)
        if not _create(path, entry["plan"], strict=False) and read_active(run, version) != plan:
            raise PlanError(
                f"{source}: plan version {version} differs from {path}; the checkpoint is "
                "not from this run"
            )
        recorded = adoptions(run).get(version)
        if recorded is None:
            record_adoption(run, version, iteration)
            restored.append(version)
        elif recorded != iteration:
            raise PlanError(
                f"{source}: plan version {version} came into force at iteration {iteration}, "
                f"but {_adopted_path(run, version)} says {recorded}; the checkpoint is not "
                "from this run"
            )
        if current_version(run) < version:
            write_json(_control(run) / "active.json", {"version": version})
    return restored


def record_adoption(run: RunDir, version: int, iteration: int) -> None:
    """Say that the workers switched to ``version`` at the boundary before ``iteration``."""
    write_json(_adopted_path(run, version), {"version": version, "iteration": iteration})


def forget_adoption(run: RunDir, version: int) -> None:
    """Withdraw the record that the workers switched to ``version`` (they could not)."""
    _adopted_path(run, version).unlink(missing_ok=True)


def commit_plan(
    run: RunDir,
    plan: PlanVersion | Callable[[PlanVersion], PlanVersion],
    *,
    strict: bool = True,
) -> PlanVersion:
    """Commit the run's next version; the workers adopt it at their next boundary.
    Returns it with its version number.

    ``plan`` is the whole version, or an edit of the newest one (``lambda current:
    replace(current, partition=...)``), applied again if another writer commits first:
    each version file is created once (never overwritten), so concurrent writers (the
    manager's stops, a user's re-partition) each get a number of their own and neither
    undoes the other.

    Raises `PlanError` when the plan cannot run on the workers as they are: a partition
    for another model or stage count, a schedule for other stages, chunks or
    micro-batches, or a partition change under an asynchronous schedule, whose weight
    versions it would break.
    """
    edit = plan if callable(plan) else (lambda _current: plan)
    base_schedule = run.read_schedule()
    for _ in range(1000):
        newest = _newest_file(run)
        committed = replace(edit(read_active(run, newest)), version=newest + 1)
        _check_runnable(run, committed, base_schedule)
        path = _version_path(run, committed.version)
        if not _create(path, committed.to_json(), strict=strict):
            continue  # another writer took this number: edit its version instead
        if current_version(run) < committed.version:  # the pointer only goes forward
            write_json(_control(run) / "active.json", {"version": committed.version})
        return committed
    raise PlanError(f"{run.root}: could not commit a plan version (too many writers at once)")


def _check_runnable(run: RunDir, plan: PlanVersion, base: Schedule) -> None:
    sched = plan.schedule
    shape = (sched.num_stages, sched.num_chunks, sched.num_microbatches)
    if shape != (base.num_stages, base.num_chunks, base.num_microbatches):
        raise PlanError(
            f"{run.root}: the new schedule has {shape[0]} stages, {shape[1]} chunks and "
            f"{shape[2]} micro-batches; the workers run {base.num_stages}, {base.num_chunks} "
            f"and {base.num_microbatches} (stage processes, their transport and data do not "
            "change)"
        )
    if plan.instance is not None and (
        plan.instance.num_jobs,
        plan.instance.num_stages,
    ) != (len(plan.jobs), sched.num_stages):
        raise PlanError(
            f"{run.root}: the new block costs are for {plan.instance.num_jobs} jobs on "
            f"{plan.instance.num_stages} stages; the plan runs {len(plan.jobs)} jobs on "
            f"{sched.num_stages}"
        )
    if plan.partition is None:
        return
    layers = run.read_partition().num_layers
    if plan.partition.num_layers != layers:
        raise PlanError(
            f"{run.root}: the new partition covers {plan.partition.num_layers} layers, "
            f"the model has {layers}"
        )
    if plan.partition.num_stages != sched.num_virtual_stages:
        raise PlanError(
            f"{run.root}: the new partition has {plan.partition.num_stages} stages, the "
            f"schedule {sched.num_virtual_stages} (stage processes do not change)"
        )
    if sched.weights != "sync":
        raise PlanError(
            f"{run.root}: a partition cannot change under an asynchronous schedule "
            f"(weights={sched.weights!r}); use gpipe, 1f1b or interleaved"
        )


def _create(path: Path, data: Any, *, strict: bool) -> bool:
    """Write ``path`` whole if it does not exist yet; False if it does (no overwrite)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_json(tmp, data, strict=strict)
    try:
        os.link(tmp, path)  # atomic and exclusive: fails if a version file is there
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True
