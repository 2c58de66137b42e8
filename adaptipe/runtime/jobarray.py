"""Plan a job-array run: per-job block costs -> JAPSP instance -> block order -> schedule.

Every job's block on a stage costs what its layers cost at the job's batch size, as
measured by the profiler (one profile per distinct batch size), plus its optimizer
step (the just-in-time update right after the job's backward block). The JAPSP solver
chosen in ``[sweep].solver`` orders the blocks; the order compiles to the one schedule
form that the simulator and the workers execute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaptipe.japsp.instance import JapspInstance
from adaptipe.models import ModelSpec
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.runtime.config import RunConfig
from adaptipe.schedule.types import Schedule

__all__ = ["JobArrayPlan", "plan_active", "plan_job_array"]


@dataclass(frozen=True, slots=True)
class JobArrayPlan:
    instance: JapspInstance
    schedule: Schedule
    solution: dict[str, Any]
    profiles: dict[int, Profile]


def plan_job_array(
    config: RunConfig, spec: ModelSpec, partition: Partition, *, active: list[int] | None = None
) -> JobArrayPlan:
    """Profile, build the JAPSP instance for the (active) jobs, solve and compile it."""
    from adaptipe.japsp.compile import to_schedule
    from adaptipe.japsp.solve import solve
    from adaptipe.profile.profiler import profile_model

    assert config.sweep is not None
    jobs = [config.jobs[j] for j in (active if active is not None else range(len(config.jobs)))]
    profiles: dict[int, Profile] = {}
    for job in jobs:
        if job.batch_size not in profiles:
            profiles[job.batch_size] = profile_model(
                spec,
                microbatch=job.batch_size,
                repeats=3,
                warmup=1,
                threads=1,
                device=config.train.device,
                optimizer=job.optimizer.profile_kind,
            )
    forward: list[list[float]] = []
    backward: list[list[float]] = []
    update: list[list[float]] = []
    for job in jobs:
        layers = profiles[job.batch_size].layers
        stages = [list(partition.layers(s)) for s in range(partition.num_stages)]
        forward.append([sum(layers[i].forward_s for i in st) for st in stages])
        backward.append([sum(layers[i].backward_s for i in st) for st in stages])
        update.append([sum(layers[i].update_s for i in st) for st in stages])
    instance = JapspInstance.build(
        forward, backward, names=[job.name for job in jobs], update=update
    )
    result = solve(
        instance,
        solver=config.sweep.solver,
        time_limit_s=config.sweep.time_limit_s,
        seed=config.train.seed,
    )
    schedule = to_schedule(instance, result.orders)
    return JobArrayPlan(
        instance=instance, schedule=schedule, solution=result.to_json(), profiles=profiles
    )


def plan_active(config: RunConfig, instance: JapspInstance, jobs: list[int]) -> Schedule:
    """Re-plan an array for the jobs still running (sweep indices, in order).

    Uses the run's JAPSP instance restricted to those jobs' rows, so nothing is profiled
    again; the schedule numbers them 0..k-1 (see `adaptipe.runtime.control.ActiveSet`).
    """
    from dataclasses import replace

    from adaptipe.japsp.compile import to_schedule
    from adaptipe.japsp.solve import solve
    from adaptipe.schedule.validate import validate

    assert config.sweep is not None
    if not jobs or any(not 0 <= j < instance.num_jobs for j in jobs):
        raise ValueError(f"plan_active: jobs {jobs} must be a non-empty subset of the array")

    def rows(table: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return tuple(table[j] for j in jobs)

    sub = replace(
        instance,
        names=tuple(instance.names[j] for j in jobs),
        forward=rows(instance.forward),
        backward=rows(instance.backward),
        comm=rows(instance.comm),
        switch=rows(instance.switch),
        update=rows(instance.update),
        recompute=rows(instance.recompute),
    )
    result = solve(
        sub,
        solver=config.sweep.solver,
        time_limit_s=config.sweep.time_limit_s,
        seed=config.train.seed,
    )
    schedule = to_schedule(sub, result.orders)
    validate(schedule)
    return replace(
        schedule, meta={**schedule.meta, "makespan": result.makespan, "solver": result.solver}
    )
