"""A plan version for another partition: the partition and, in a job-array, the block
costs and block order solved for it.

A job's block on a stage costs what that stage's layers cost, so moving layers changes
the JAPSP instance, and the order solved for the old instance may no longer be the
best. `for_partition` builds the instance of the new partition from the per-layer costs
the run measured before it started (``japsp-costs.json``, `adaptipe.japsp.array`) and
solves it again with the run's solver settings. Nothing here imports torch: the
request (``adaptipe repartition``), a scripted re-partition (rank 0, at the boundary)
and the withdrawal of a failed one all plan the same way.

Every job still trains exactly as alone under any order, so a run directory written
before per-layer costs were kept (no ``japsp-costs.json``) keeps the order it has:
exact, just not re-optimised.
"""

from __future__ import annotations

from dataclasses import replace

from adaptipe.japsp.array import ArrayCosts, solve_array
from adaptipe.plan.partition import Partition
from adaptipe.runtime.planversion import PlanVersion
from adaptipe.runtime.rundir import RunDir
from adaptipe.schedule.validate import validate
from adaptipe.serial import load_json_file

__all__ = ["COSTS_FILE", "array_costs", "for_partition"]

COSTS_FILE = "japsp-costs.json"


def array_costs(run: RunDir) -> ArrayCosts | None:
    """The run's per-layer job costs (None: one job, or a run directory without them)."""
    path = run.root / COSTS_FILE
    if not path.exists():
        return None
    return load_json_file(path, ArrayCosts.from_json)


def for_partition(run: RunDir, current: PlanVersion, partition: Partition | None) -> PlanVersion:
    """``current`` with ``partition`` (None: the run's own), re-planned for it.

    In a job-array the active jobs' block costs under ``partition`` replace the old ones
    and the solver orders them again (its settings come from the run's ``[sweep]``); the
    window rule stays. One job: only the partition changes.
    """
    costs = array_costs(run)
    if costs is None:
        return replace(current, partition=partition)
    layers = partition if partition is not None else run.read_partition()
    instance = costs.instance(layers, current.jobs)
    schedule, _ = solve_array(instance, costs.settings)
    validate(schedule)
    return replace(current, partition=partition, schedule=schedule, instance=instance)
