"""Which runs may replicate stages, and the partition that carries the replicas.

Replicas come from ``[pipeline].replicas`` or from a partition file that `adaptipe plan`
wrote (its ``replicas``); `with_replicas` puts the run's on its partition, which is how
they reach the workers. What replicated stages do not run is refused here, before any
worker starts, with the field that asks for it and why (`check_replicas`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from adaptipe.errors import PlanError
from adaptipe.plan.partition import Partition
from adaptipe.schedule.replicate import REPLICATED_SCHEDULES

if TYPE_CHECKING:
    from adaptipe.runtime.config import RunConfig

__all__ = ["check_replicas", "with_replicas"]


def check_replicas(config: RunConfig, replicas: tuple[int, ...], where: str) -> None:
    """Raise `PlanError` unless ``config`` can run its stages replicated ``replicas`` ways.

    ``where`` names the file and field the replicas came from.
    """
    pipe = config.pipeline
    if len(replicas) != pipe.stages:
        raise PlanError(
            f"{where} = {list(replicas)} must hold one entry per stage ([pipeline].stages = "
            f"{pipe.stages})"
        )
    if all(r == 1 for r in replicas):
        return
    why = f"{where} = {list(replicas)} replicates a stage"
    refusals = [
        (
            config.sweep is not None,
            "[sweep]",
            "job-arrays switch per-job states on each stage; replicas would each need "
            "every job's state (train the jobs unreplicated)",
        ),
        (
            pipe.schedule not in REPLICATED_SCHEDULES,
            f"[pipeline].schedule = {pipe.schedule!r}",
            f"replicas all-reduce their gradients before one step per flush, which only "
            f"the synchronous schedules have (allowed: {', '.join(REPLICATED_SCHEDULES)})",
        ),
        (
            pipe.virtual != 1,
            f"[pipeline].virtual = {pipe.virtual}",
            "interleaved virtual stages are not replicated (allowed: 1)",
        ),
        (
            config.data.microbatches < max(replicas),
            f"[data].microbatches = {config.data.microbatches}",
            f"every replica needs a micro-batch (allowed: >= {max(replicas)})",
        ),
        (
            bool(config.adapt.repartition) or config.adapt.controller != "none",
            "[adapt]",
            "moving layers between replicated stages is not supported (every replica would "
            "have to take the layer); remove [[adapt.repartition]] and set "
            '[adapt].controller = "none"',
        ),
        (
            config.train.stage_memory_mb is not None,
            "[train].stage_memory_mb",
            "the memory guard moves layers off a stage, which replicated stages do not "
            "support; remove it",
        ),
    ]
    for refused, field, reason in refusals:
        if refused:
            raise PlanError(f"{why}, which {field} does not allow: {reason}")


def with_replicas(config: RunConfig, partition: Partition, *, source: str) -> Partition:
    """``partition`` with the run's replicas: ``[pipeline].replicas`` when set, else its own
    (a plan file's); checked by `check_replicas`. ``source`` names the partition."""
    asked = config.pipeline.replicas
    own = partition.replicas
    if asked:
        if any(r > 1 for r in own) and tuple(own) != tuple(asked):
            raise PlanError(
                f"{config.source}: [pipeline].replicas = {list(asked)} differs from the "
                f"replicas {list(own)} of {source}; give them in one place"
            )
        check_replicas(config, tuple(asked), f"{config.source}: [pipeline].replicas")
        if any(r > 1 for r in asked):  # (all 1: the partition's, per virtual stage too)
            partition = replace(partition, replicas=tuple(asked))
    elif any(r > 1 for r in own):
        check_replicas(config, own, f"{source}: replicas")
    return partition
