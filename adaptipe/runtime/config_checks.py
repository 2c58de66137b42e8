"""The checks of a run config that read several sections at once (the model against
the pipeline, the partition against the stages, ...): `check_cross`, run last by
`adaptipe.runtime.config` on a parsed config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptipe.errors import PlanError
from adaptipe.plan.api import PLANNERS
from adaptipe.plan.partition import Partition
from adaptipe.runtime.replica_checks import check_replicas
from adaptipe.serial import read_json

if TYPE_CHECKING:
    from adaptipe.models import ModelSpec
    from adaptipe.runtime.config import RunConfig

__all__ = ["check_cross"]


def _fail(source: str, where: str, message: str) -> PlanError:
    return PlanError(f"{source}: {where} {message}")


def check_cross(config: RunConfig, spec: ModelSpec) -> None:
    """Checks across sections: everything a run would otherwise trip over after starting."""
    src, data, pipe = config.source, config.data, config.pipeline
    _check_clip(config)
    if pipe.replicas:
        check_replicas(config, pipe.replicas, f"{src}: [pipeline].replicas")
    if config.train.stage_memory_mb is not None and not config.train.telemetry:
        raise _fail(
            src, "[train].stage_memory_mb",
            "asks the manager to move layers off a stage near its limit, which it hears "
            "through telemetry, and [train].telemetry = false turns that off; set "
            "[train].telemetry = true",
        )  # fmt: skip
    if config.sweep is not None:
        # A job-array runs each job's whole mini-batch as one block; its order comes from
        # the JAPSP solver, not from [pipeline].schedule.
        if data.microbatches != 1:
            raise _fail(
                src, "[data].microbatches", f"must be 1 with a [sweep] (got {data.microbatches})"
            )
        if pipe.virtual != 1:
            raise _fail(
                src,
                "[pipeline].virtual",
                f"must be 1 with a [sweep]: a job's block is its whole stage (got {pipe.virtual})",
            )
        if pipe.batch_weight_grads:
            raise _fail(
                src,
                "[pipeline].batch_weight_grads",
                "has nothing to batch with a [sweep]: each job's mini-batch is one block",
            )
        if pipe.stages > spec.num_layers:
            raise _fail(
                src,
                "[pipeline].stages",
                f"must be <= the {spec.num_layers} layers of {spec.name!r}",
            )
        _check_partition(config, spec, pipe.stages)
        return
    if data.batch_size % data.microbatches:
        raise _fail(
            src,
            "[data].microbatches",
            f"must divide batch_size {data.batch_size} (got {data.microbatches})",
        )
    if pipe.batch_weight_grads and pipe.schedule in ("pipedream", "2bw"):
        raise _fail(
            src,
            "[pipeline].batch_weight_grads",
            f"needs a synchronous schedule (gpipe, 1f1b, interleaved; got {pipe.schedule!r})",
        )
    try:
        pipe.schedule_for(data.microbatches)  # kept for `resolve_plans`
    except PlanError as exc:
        raise PlanError(f"{src}: [pipeline]: {exc}") from None
    total = pipe.stages * pipe.virtual
    if total > spec.num_layers:
        raise _fail(
            src,
            "[pipeline].stages",
            f"times virtual ({pipe.stages} x {pipe.virtual} = {total}) must be <= the "
            f"{spec.num_layers} layers of model {spec.name!r}",
        )
    _check_partition(config, spec, total)


def _check_partition(config: RunConfig, spec: ModelSpec, total: int) -> None:
    src, pipe = config.source, config.pipeline
    if pipe.partition in PLANNERS:
        return
    try:
        if isinstance(pipe.partition, tuple):
            part = Partition(model=spec.name, num_layers=spec.num_layers, bounds=pipe.partition)
        else:
            part = Partition.from_json(read_json(pipe.partition), source=pipe.partition)
    except PlanError as exc:
        raise PlanError(f"{src}: [pipeline].partition: {exc}") from None
    if (part.model, part.num_layers) != (spec.name, spec.num_layers):
        raise _fail(
            src,
            "[pipeline].partition",
            f"covers {part.num_layers} layers of model {part.model!r} but the config's model "
            f"{spec.name!r} has {spec.num_layers}",
        )
    if part.num_stages != total:
        raise _fail(
            src,
            "[pipeline].partition",
            f"has {part.num_stages} stages but stages x virtual = {total}",
        )


def _check_clip(config: RunConfig) -> None:
    """Clipping by the global norm needs a synchronous schedule (one step per flush)."""
    jobs = config.sweep.jobs if config.sweep is not None else ()
    if not config.optimizer.clip_grad_norm and not any(j.optimizer.clip_grad_norm for j in jobs):
        return
    where = "[optimizer].clip_grad_norm"
    if config.pipeline.schedule in ("pipedream", "2bw"):
        raise _fail(
            config.source, where,
            f"needs a synchronous schedule (gpipe, 1f1b, interleaved); "
            f"[pipeline].schedule = {config.pipeline.schedule!r} steps per micro-batch group",
        )  # fmt: skip
