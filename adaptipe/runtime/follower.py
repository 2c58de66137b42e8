"""A worker's side of plan versions: agree at every boundary on the version in force.

Rank 0 reads the newest committed version (at a halving rung it first waits for the
manager's decision, which makes the survivors deterministic) and broadcasts it; every
rank then reads that version's immutable file. A resumed run replays the recorded
switches at the iterations they happened (`PlanFollower.replay_edges` ends windows
there).
"""

from __future__ import annotations

import time
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.control import is_rung, rung_decided
from adaptipe.runtime.planversion import (
    PlanVersion,
    adoptions,
    current_version,
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
    ) -> None:
        self.run, self.config, self.rank, self.total = run, config, rank, total
        self.device = device
        self.wait_s, self.poll_s = wait_s, poll_s
        self.active: PlanVersion | None = None
        # Switches made before (a resumed run replays them); rank 0 adds new ones.
        self.history = adoptions(run)

    def replay_edges(self, start: int) -> set[int]:
        """Iterations after ``start`` where a recorded switch happens (windows end there)."""
        return {it for it in self.history.values() if it > start}

    def at_boundary(self, iteration: int) -> PlanVersion | None:
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
                # Versions only go forward: a torn active.json reads as 0.
                version = max(current_version(self.run), recorded)
                if self.active is not None:
                    version = max(version, self.active.version)
        box = torch.tensor([version], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(box, src=0)
        version = int(box.item())
        if self.active is not None and version == self.active.version:
            return None
        if self.rank == 0 and version > 0 and version not in self.history:
            record_adoption(self.run, version, iteration)
            self.history[version] = iteration
        self.active = read_active(self.run, version, self.config)
        return self.active

    def _wait_for_rung(self, iteration: int) -> None:
        deadline = time.monotonic() + self.wait_s
        while rung_decided(self.run, iteration) is None:
            if time.monotonic() > deadline:
                raise PlanError(
                    f"successive halving: no decision for iteration {iteration} from the "
                    f"manager within {self.wait_s:.0f} s (is `adaptipe train` still running?)"
                )
            time.sleep(self.poll_s)
