"""Everything a run executes, resolved from its config before any worker starts.

The partition comes from `adaptipe.plan.resolve`; the schedule (`adaptipe.schedule`) and
a sweep's job-array plan (`adaptipe.runtime.jobarray`, over `adaptipe.japsp`) live in
layers above `adaptipe.plan`, so putting them together for a `RunConfig` happens here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.models import ModelSpec
from adaptipe.plan.partition import Partition
from adaptipe.plan.resolve import resolve_partition
from adaptipe.profile.types import Profile
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.replica_checks import with_replicas
from adaptipe.schedule.replicate import ReplicaLayout, validate_replicated
from adaptipe.schedule.types import Schedule
from adaptipe.schedule.validate import validate
from adaptipe.sim.replicas import replicated_one_f_one_b

__all__ = ["Plans", "resolve_plans"]


@dataclass(frozen=True, slots=True)
class Plans:
    """Everything a run executes, resolved from its config before any worker starts."""

    partition: Partition
    schedule: Schedule
    profile: Profile | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more plan files: name -> JSON


def resolve_plans(config: RunConfig) -> Plans:
    """The partition and schedule a config asks for (profiling first if a planner needs it)."""
    spec = config.model.spec()
    _check_batch_sizes(config, spec)  # before profiling, which would draw a batch this big
    p = config.pipeline
    num = p.stages * p.virtual
    partition, profile = resolve_partition(
        spec,
        partition=p.partition,
        num_stages=num,
        microbatch=config.jobs[0].batch_size // config.data.microbatches,
        device=config.train.device,
        optimizer=config.jobs[0].optimizer.profile_kind,
        bandwidth=p.bandwidth,
        source=f"{config.source}: [pipeline].partition",
        shape=f"stages x virtual = {p.stages} x {p.virtual}",
    )
    named = f"{config.source}: [pipeline].partition = {p.partition!r}"
    partition = with_replicas(config, partition, source=named)
    if config.sweep is not None:
        from adaptipe.runtime.jobarray import plan_job_array

        planned = plan_job_array(config, spec, partition)
        validate(planned.schedule)
        extra = {
            "japsp-instance.json": planned.instance.to_json(),
            "japsp-solution.json": planned.solution,
            # per-layer costs and solver settings: a re-partition's instance and order
            "japsp-costs.json": planned.costs.to_json(),
        }
        first = planned.profiles[config.jobs[0].batch_size]
        return Plans(partition, planned.schedule, profile or first, extra)
    # The same build that loading the config checked (`PipelineSection.schedule_for`).
    schedule = p.schedule_for(config.data.microbatches)
    layout = ReplicaLayout.of(partition.replicas, p.stages)
    if layout.replicated and p.schedule == "1f1b":  # warm-ups for the replicas
        schedule = replicated_one_f_one_b(
            p.stages, config.data.microbatches, layout.replicas, recompute=p.recompute
        )
    validate(schedule)
    if layout.replicated:
        validate_replicated(schedule, layout)
    return Plans(partition, schedule, profile)


def _check_batch_sizes(config: RunConfig, spec: ModelSpec) -> None:
    samples = len(spec.dataset(split=config.data.split))
    for job in config.jobs:
        if job.batch_size > samples:
            where = f"[sweep] job {job.name!r}" if config.sweep is not None else "[data]"
            raise PlanError(
                f"{config.source}: {where} batch_size = {job.batch_size} is more than the "
                f"{samples} samples of {spec.name}'s {config.data.split} split (allowed: "
                f"1..{samples})"
            )
