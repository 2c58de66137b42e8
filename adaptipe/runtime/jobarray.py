"""Plan a job-array run: per-job block costs -> JAPSP instance -> block order -> schedule.

Every job's block on a stage costs what its layers cost at the job's batch size, as
measured by the profiler (one profile per distinct batch size), plus its optimizer
step (the just-in-time update right after the job's backward block). The JAPSP solver
chosen in ``[sweep].solver`` orders the blocks; the order compiles to the one schedule
form that the simulator and the workers execute.

The run's schedule is the solver's order for one iteration. Workers unroll it into
windows of ``[sweep].window`` iterations (`window_for`; ``"auto"`` picks the length from
the jobs still running, `adaptipe.japsp.window.auto_window`), all alike, each time with
the round order (the solver's or a baseline's) that makes that window shortest within
the memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.japsp.array import ArrayCosts, SolveSettings, solve_array
from adaptipe.japsp.instance import JapspInstance
from adaptipe.models import ModelSpec
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.runtime.config import RunConfig
from adaptipe.schedule.types import Backward, Forward, Schedule

__all__ = ["JobArrayPlan", "plan_job_array", "solve_settings", "window_for"]


@dataclass(frozen=True, slots=True)
class JobArrayPlan:
    instance: JapspInstance
    schedule: Schedule
    solution: dict[str, Any]
    profiles: dict[int, Profile]
    costs: ArrayCosts


def plan_job_array(
    config: RunConfig, spec: ModelSpec, partition: Partition, *, active: list[int] | None = None
) -> JobArrayPlan:
    """Profile, build the JAPSP instance for the (active) jobs, solve and compile it."""
    from adaptipe.profile.profiler import profile_model
    from adaptipe.runtime.binder import refuse_unbindable

    assert config.sweep is not None
    jobs = [config.jobs[j] for j in (active if active is not None else range(len(config.jobs)))]
    for index in range(spec.num_layers):  # before any worker starts: the binder's rule
        try:
            refuse_unbindable(index, spec.build_layer(index, seed=jobs[0].seed, device="meta"))
        except PlanError as exc:
            raise PlanError(f"{config.source}: [sweep] with [model] {spec.name!r}: {exc}") from None
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
    costs = ArrayCosts.from_profiles(
        [profiles[job.batch_size] for job in jobs],
        names=[job.name for job in jobs],
        # Recomputation re-runs a block's forward right before its backward (Eq. 6).
        recompute=config.pipeline.recompute,
        settings=solve_settings(config),
    )
    instance = costs.instance(partition)
    schedule, solution = solve_array(instance, costs.settings)
    return JobArrayPlan(
        instance=instance, schedule=schedule, solution=solution, profiles=profiles, costs=costs
    )


def solve_settings(config: RunConfig) -> SolveSettings:
    """The ``[sweep]`` settings that order and unroll a job-array's blocks."""
    assert config.sweep is not None
    sweep = config.sweep
    return SolveSettings(
        solver=sweep.solver,
        time_limit_s=sweep.time_limit_s,
        seed=config.train.seed,
        window=sweep.window,
        memory_budget=sweep.memory_budget,
    )


def window_for(
    base: Schedule, instance: JapspInstance, rounds: int, *, budget: int = 0
) -> Schedule:
    """The schedule of a window of ``rounds`` iterations of job-array schedule ``base``.

    ``base`` is one round (``num_microbatches == 1``, the solver's order) and
    ``instance`` its jobs' costs (rows in ``base``'s job numbering); ``budget``: the
    memory budget (job states resident per stage, 0 = all). The round order is the best
    for this window length (`adaptipe.japsp.window.best_window`). Deterministic: every
    worker gets the same.
    """
    from adaptipe.japsp.window import best_window, window_schedule
    from adaptipe.schedule.validate import validate

    if base.num_microbatches != 1 or base.num_jobs != instance.num_jobs:
        raise ValueError(
            f"window_for: needs a one-round job-array schedule of {instance.num_jobs} jobs "
            f"(got {base.num_jobs} jobs, {base.num_microbatches} micro-batches)"
        )
    orders = [
        [
            ("F" if isinstance(ins, Forward) else "B", ins.job)
            for ins in stage
            if isinstance(ins, Forward | Backward)
        ]
        for stage in base.stages
    ]
    _, window = best_window(instance, orders, rounds, budget=budget)
    schedule = window_schedule(instance, window, name=base.name)
    validate(schedule)
    return schedule
