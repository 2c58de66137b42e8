"""A worker's side of plan versions: agree at every boundary on the version in force.

Rank 0 reads the newest committed version (at a halving rung it first waits for the
manager's decision, which makes the survivors deterministic; at a scripted re-partition,
``[[adapt.repartition]]``, it commits that partition first, in a job-array with the
block order solved for it) and broadcasts it; every
rank then reads that version's immutable file. Rank 0 records where each version came
into force, so a resumed run replays the switch at the iteration it happened
(`PlanFollower.replay_edges`). When the workers cannot take a version's partition on (a
failed migration, `PlanFollower.failed`), its record is withdrawn and the version is
committed again with the partition before under a new number, so the newest version
always says what runs.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.control import is_rung, rung_decided
from adaptipe.runtime.partition_plan import for_partition
from adaptipe.runtime.planversion import (
    PlanVersion,
    adoptions,
    commit_plan,
    current_version,
    forget_adoption,
    read_active,
    record_adoption,
)
from adaptipe.runtime.rundir import RunDir

__all__ = ["PlanFollower"]


class PlanFollower:
    """Agree on the plan version at each window boundary; `at_boundary` returns the
    new `PlanVersion` when it changed (the first call returns the one in force)."""

    def __init__(
        self,
        run: RunDir,
        config: RunConfig,
        *,
        rank: int,
        total: int,
        device: Any,
        wait_s: float,
        poll_s: float = 0.02,
        group: Any = None,
    ) -> None:
        self.run, self.config, self.rank, self.total = run, config, rank, total
        self.device = device
        self.group = group  # a CPU (gloo) group beside NCCL: no device sync per boundary
        self.wait_s, self.poll_s = wait_s, poll_s
        self.active: PlanVersion | None = None
        self._previous: PlanVersion | None = None
        self._proposed: PlanVersion | None = None
        # Switches made before (a resumed run replays them); rank 0 adds new ones.
        self.history = adoptions(run)
        self.scripted = {r.iteration: r.bounds for r in config.adapt.repartition}

    def replay_edges(self, start: int) -> set[int]:
        """Iterations after ``start`` where a recorded or scripted switch happens
        (windows end there)."""
        return {it for it in [*self.history.values(), *self.scripted] if it > start}

    def at_boundary(self, iteration: int) -> PlanVersion | None:
        proposed = self.propose(iteration)
        if proposed is not None:
            self.take(proposed, iteration)
        return proposed

    def propose(self, iteration: int) -> PlanVersion | None:
        """The version every worker agrees is the newest at ``iteration``, when it is not
        the one in force; nothing is recorded until `take` (a streamed migration proposes
        at every boundary until the layers have crossed, then takes)."""
        version = self._agree(iteration)
        if self.active is not None and version == self.active.version:
            return None
        if self._proposed is None or self._proposed.version != version:
            self._proposed = read_active(self.run, version, self.config)
        return self._proposed

    def take(self, plan: PlanVersion, iteration: int) -> None:
        """``plan`` (from `propose`) is in force from ``iteration`` on (rank 0 records it)."""
        if self.rank == 0 and plan.version > 0 and plan.version not in self.history:
            record_adoption(self.run, plan.version, iteration)
            self.history[plan.version] = iteration
        self._previous, self.active = self.active, plan

    def replaying(self, plan: PlanVersion) -> bool:
        """Whether ``plan`` came into force before (a resumed run replays its switch at
        the recorded iteration; every worker read the same history at start)."""
        return plan.version in self.history

    def _agree(self, iteration: int) -> int:
        import torch
        import torch.distributed as dist

        version = -1
        if self.rank == 0:
            # the newest version recorded in force by now (this run's or an earlier one's)
            recorded = max((v for v, it in self.history.items() if it <= iteration), default=0)
            if any(it >= iteration for it in self.history.values()):  # replaying
                version = recorded
            else:
                many = self.active is None or len(self.active.jobs) > 1
                if many and is_rung(self.config, iteration, self.total):
                    self._wait_for_rung(iteration)
                if iteration in self.scripted:
                    self._commit_scripted(iteration)
                # Versions only go forward: a torn active.json reads as 0.
                version = max(current_version(self.run), recorded)
                if self.active is not None:
                    version = max(version, self.active.version)
        box = torch.tensor([version], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(box, src=0, group=self.group)
        return int(box.item())

    def pending(self) -> bool:
        """Rank 0: a version newer than any in force or recorded has been committed (the
        workers take it on at their next iteration boundary)."""
        newest = max([self.active.version if self.active is not None else 0, *self.history])
        return current_version(self.run) > newest

    def failed(self, iteration: int) -> PlanVersion:
        """The workers could not take on the partition of the version `at_boundary`
        returned (a failed migration): the rest of it stands, with the partition before,
        committed again under a new number by rank 0 and agreed by every worker (the
        newest version always says what runs). Returns it."""
        import torch
        import torch.distributed as dist

        assert self.active is not None
        # At the first boundary (a fresh start or a resume) the stages hold the run's own
        # partition: that is the one to keep.
        previous = self._previous
        before = previous.partition if previous is not None else None
        version = -1
        if self.rank == 0:
            if self.history.get(self.active.version) == iteration:
                forget_adoption(self.run, self.active.version)
                del self.history[self.active.version]

            def restore(newest: PlanVersion) -> PlanVersion:
                if previous is not None and previous.jobs == newest.jobs:
                    # the order and costs that ran before the attempt
                    return replace(
                        newest,
                        partition=before,
                        schedule=previous.schedule,
                        instance=previous.instance,
                    )
                return for_partition(self.run, newest, before)

            version = commit_plan(self.run, restore).version
            record_adoption(self.run, version, iteration)
            self.history[version] = iteration
        box = torch.tensor([version], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(box, src=0, group=self.group)
        self.active = read_active(self.run, int(box.item()), self.config)
        return self.active

    def _commit_scripted(self, iteration: int) -> None:
        """Commit ``[[adapt.repartition]]``'s partition for ``iteration`` (rank 0)."""
        base = self.run.read_partition()
        partition = Partition(
            model=base.model,
            num_layers=base.num_layers,
            bounds=self.scripted[iteration],
            planner="adapt.repartition",
        )
        commit_plan(self.run, lambda newest: for_partition(self.run, newest, partition))

    def _wait_for_rung(self, iteration: int) -> None:
        deadline = time.monotonic() + self.wait_s
        while rung_decided(self.run, iteration) is None:
            if time.monotonic() > deadline:
                raise PlanError(
                    f"successive halving: no decision for iteration {iteration} from the "
                    f"manager within {self.wait_s:.0f} s (is `adaptipe train` still running?)"
                )
            time.sleep(self.poll_s)
