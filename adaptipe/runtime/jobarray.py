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

from dataclasses import dataclass, replace
from typing import Any

from adaptipe.japsp.instance import JapspInstance
from adaptipe.models import ModelSpec
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.runtime.config import RunConfig
from adaptipe.schedule.types import Backward, Forward, Schedule

__all__ = ["JobArrayPlan", "plan_active", "plan_job_array", "window_for"]


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
    from adaptipe.profile.profiler import profile_model
    from adaptipe.runtime.binder import refuse_unbindable

    assert config.sweep is not None
    jobs = [config.jobs[j] for j in (active if active is not None else range(len(config.jobs)))]
    for index in range(spec.num_layers):  # before any worker starts: the binder's rule
        refuse_unbindable(index, spec.build_layer(index, seed=jobs[0].seed, device="meta"))
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
        forward,
        backward,
        names=[job.name for job in jobs],
        update=update,
        # Recomputation re-runs a block's forward right before its backward (Eq. 6).
        recompute=[list(row) for row in forward] if config.pipeline.recompute else None,
    )
    schedule, solution = _solve(config, instance)
    return JobArrayPlan(instance=instance, schedule=schedule, solution=solution, profiles=profiles)


def _solve(config: RunConfig, instance: JapspInstance) -> tuple[Schedule, dict[str, Any]]:
    """Solve for one round; (the solver's one-round schedule, the solution record).

    Workers unroll the schedule into windows with `window_for`, which picks the round
    order per window length; the record holds what it picks for full windows.
    """
    from adaptipe.japsp.compile import to_schedule
    from adaptipe.japsp.evaluate import evaluate
    from adaptipe.japsp.solve import solve
    from adaptipe.japsp.window import JITTER, best_window, expected_makespan

    assert config.sweep is not None
    result = solve(
        instance,
        solver=config.sweep.solver,
        time_limit_s=config.sweep.time_limit_s,
        seed=config.train.seed,
    )
    solution = result.to_json()
    schedule = to_schedule(instance, result.orders)
    meta: dict[str, Any] = {"makespan": result.makespan, "solver": result.solver}
    rounds = config.sweep.rounds(instance.num_jobs, instance.num_stages)
    budget = config.sweep.memory_budget
    orders, window = best_window(instance, result.orders, rounds, budget=budget)
    if rounds > 1 or orders != result.orders:
        meta.update(window=rounds, window_makespan=window.makespan, round_order=window.order)
        solution["window"] = {
            "rounds": rounds,
            "makespan": window.makespan,
            "per_iteration": window.makespan / rounds,
            "jittered_makespan": expected_makespan(instance, window, jitter=JITTER),
            "rule": window.rule,
            "round_order": window.order,
            "round_orders": [[f"{k}{j}" for k, j in stage] for stage in orders],
            "round_makespan": evaluate(instance, orders).makespan,
        }
    return replace(schedule, meta={**schedule.meta, **meta}), solution


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


def plan_active(config: RunConfig, instance: JapspInstance, jobs: list[int]) -> Schedule:
    """Re-plan an array for the jobs still running (sweep indices, in order).

    Uses the run's JAPSP instance restricted to those jobs' rows, so nothing is profiled
    again; the schedule numbers them 0..k-1 (see `adaptipe.runtime.control.ActiveSet`).
    """
    from adaptipe.schedule.validate import validate

    assert config.sweep is not None
    if not jobs or any(not 0 <= j < instance.num_jobs for j in jobs):
        raise ValueError(f"plan_active: jobs {jobs} must be a non-empty subset of the array")
    schedule, _ = _solve(config, instance.select(jobs))
    validate(schedule)
    return schedule
