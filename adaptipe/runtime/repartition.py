"""Ask a running pipeline to take on another partition: `repartition`, and
``adaptipe repartition RUN_DIR --bounds 0,3,8``.

The request is a plan version with the new partition (in a job-array, with the block
order solved again for it, `adaptipe.runtime.partition_plan`), committed in the run
directory;
the workers adopt it at their next boundary and move the layers there (live, or through
a checkpoint, as ``[adapt].method`` says). Nothing here imports torch, so the request
leaves at once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from adaptipe.errors import PlanError
from adaptipe.plan.partition import Partition
from adaptipe.runtime.control import has_finished
from adaptipe.runtime.partition_plan import for_partition
from adaptipe.runtime.planversion import (
    PlanVersion,
    adoptions,
    commit_plan,
    current_version,
    read_active,
)
from adaptipe.runtime.rundir import RunDir
from adaptipe.serial import read_json

__all__ = ["repartition"]


def repartition(run_dir: str | os.PathLike[str], bounds: Sequence[int]) -> PlanVersion:
    """Commit layer ``bounds`` (as ``[pipeline].partition`` takes them) for the run in
    ``run_dir``; returns the committed version.

    Refused, with what is wrong and what is allowed: bounds that are not a partition of
    this model for this pipeline, a run that has finished, and a request while another
    re-partition is committed but not yet adopted.
    """
    run = RunDir(Path(run_dir))
    if not run.config_json.exists():
        raise PlanError(f"{run.root}: not a run directory (no config.json)")
    _refuse_finished(run)
    current = read_active(run, current_version(run))
    base = run.read_partition()
    if max(base.replicas) > 1:
        raise PlanError(
            f"{run.partition_json}: replicas {list(base.replicas)} replicate a stage, and "
            "layers do not move on a replicated pipeline (every replica would have to take "
            "the layer); train it unreplicated to re-partition"
        )
    in_force = _partition_in_force(run)
    if current.partition != in_force:
        pending = current.partition.bounds if current.partition is not None else base.bounds
        raise PlanError(
            f"{run.root}: a re-partition to {list(pending)} (version {current.version}) is "
            "committed and not yet adopted; ask again once the workers have moved"
        )
    allowed = (
        f"allowed: {base.num_stages + 1} increasing layer indices from 0 to "
        f"{base.num_layers}, e.g. {list(base.bounds)}"
    )
    try:
        partition = Partition(
            model=base.model,
            num_layers=base.num_layers,
            bounds=tuple(int(b) for b in bounds),
            planner="repartition",
        )
    except PlanError as exc:
        raise PlanError(
            f"{run.root}: bounds {list(bounds)} are not a partition of this model ({exc}); "
            f"{allowed}"
        ) from None
    if partition.num_stages != base.num_stages:
        raise PlanError(
            f"{run.root}: bounds {list(bounds)} make {partition.num_stages} stage(s), the "
            f"pipeline runs {base.num_stages} (stage processes do not change); {allowed}"
        )
    now = in_force.bounds if in_force is not None else base.bounds
    if partition.bounds == now:
        raise PlanError(f"{run.root}: the stages already hold {list(now)}; nothing to move")
    return commit_plan(run, lambda newest: for_partition(run, newest, partition))


def _partition_in_force(run: RunDir) -> Partition | None:
    """The partition of the newest adopted version (None: the run's own)."""
    adopted = adoptions(run)
    if not adopted:
        return None
    return read_active(run, max(adopted)).partition


def _refuse_finished(run: RunDir) -> None:
    data = read_json(run.config_json)
    iterations = data.get("train", {}).get("iterations") if isinstance(data, dict) else None
    if has_finished(run, iterations if isinstance(iterations, int) else None):
        raise PlanError(
            f"{run.root}: the run has finished (see {run.summary.name}); there is nothing "
            "left to re-partition"
        )
