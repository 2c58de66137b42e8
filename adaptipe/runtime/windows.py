"""Windows: the iterations a worker runs as one instruction list, and their executors.

One job runs one iteration at a time: its window is its plan's schedule. A job-array
runs windows of several iterations (`adaptipe.japsp.window`): round r of a job is its
micro-batch r of the window's schedule. Every worker unrolls the same one-round
schedule with the same block costs (the plan version's, which are the run's JAPSP
instance until a re-partition brings its own), so all agree on every window without
talking. A window ends early where a checkpoint, a halving rung, a
recorded switch or the traced range sits, so those land on a boundary.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from adaptipe.japsp.instance import JapspInstance
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.control import is_rung
from adaptipe.runtime.memory import MemoryManager, block_order
from adaptipe.runtime.planversion import PlanVersion, remap_jobs
from adaptipe.runtime.stage import StageExecutor
from adaptipe.runtime.stagestate import Stage
from adaptipe.runtime.transport import TensorSpec, Transport
from adaptipe.schedule.types import Schedule

__all__ = ["Windows", "memory_manager", "window_end"]


def window_end(config: RunConfig, it: int, total: int, window: int, edges: Collection[int]) -> int:
    """Where the window starting at ``it`` ends: ``window`` iterations later, or earlier
    at the run's end, a checkpoint, a halving rung or one of ``edges``."""
    every = config.train.checkpoint_every
    stop = min(it + window, total)
    for b in range(it + 1, stop):
        if (every > 0 and b % every == 0) or is_rung(config, b, total) or b in edges:
            return b
    return stop


class Windows:
    """A worker's executors, one per window length, for the plan version in force.

    Layer slots, per-job states, transport and negotiated shapes are shared; the memory
    manager follows whichever window runs. `connect` (after a shape handshake) and
    `adopt` (a new plan version) drop the executors built so far.
    """

    def __init__(
        self,
        config: RunConfig,
        instance: JapspInstance | None,
        stage: Stage,
        plan: PlanVersion,
    ) -> None:
        self.config = config
        self.num_jobs = len(config.jobs)
        self.budget = config.sweep.memory_budget if config.sweep is not None else 0
        self.instance = instance
        self.stage = stage
        self.plan = plan
        self._transport: Transport | None = None
        self._specs: dict[tuple[int, int], TensorSpec] = {}
        self._executors: dict[int, StageExecutor] = {}
        self._running: tuple[int, int] | None = None  # (plan version, rounds) in memory

    def connect(self, transport: Transport, specs: dict[tuple[int, int], TensorSpec]) -> None:
        """Use ``transport`` and the negotiated boundary ``specs`` from now on."""
        self._transport, self._specs = transport, specs
        self._executors.clear()
        self._running = None

    def adopt(self, plan: PlanVersion) -> None:
        """Run ``plan`` from the next window on (an iteration boundary)."""
        if plan.version != self.plan.version:
            self.plan = plan
            self._executors.clear()

    def interrupted(self) -> None:
        """The window was cut short: the next one re-seats the memory manager's order
        (it stopped part way through this one's)."""
        self._running = None

    def schedule(self) -> Schedule:
        """The plan's one-window schedule with sweep job indices (what runs)."""
        return remap_jobs(self.plan.schedule, self.plan.jobs, self.num_jobs)

    def length(self) -> int:
        """Iterations per full window for the plan in force."""
        if self.plan.window is not None:
            return self.plan.window
        sweep = self.config.sweep
        stages = self.plan.schedule.num_stages
        return sweep.rounds(len(self.plan.jobs), stages) if sweep is not None else 1

    def executor(self, rounds: int) -> StageExecutor:
        """The executor of a window of ``rounds`` iterations, now this stage's executor."""
        assert self._transport is not None, "connect() before the first window"
        ex = self._executors.get(rounds)
        if ex is None:
            ex = self.stage.build_executor(
                schedule=self._unrolled(rounds),
                transport=self._transport,
                boundary_specs=self._specs,
            )
            self._executors[rounds] = ex
        else:
            self.stage.switch_to(ex)
        key = (self.plan.version, rounds)
        if self.stage.memory is not None and key != self._running:
            self.stage.memory.reorder(block_order(ex.program))
        self._running = key
        return ex

    def first_order(self) -> list[tuple[int, int]]:
        """A one-iteration block order of the plan in force that fits the memory budget
        (where a rebuilt memory manager starts; each window then reorders it)."""
        from adaptipe.runtime.jobarray import window_for

        assert self.instance is not None, "job states are offloaded only in job-arrays"
        plan = self.plan
        local = window_for(plan.schedule, plan.block_costs(self.instance), 1, budget=self.budget)
        return block_order(remap_jobs(local, plan.jobs, self.num_jobs).stages[self.stage.rank])

    def _unrolled(self, rounds: int) -> Schedule:
        if self.instance is None:  # one job: one iteration per window
            return self.schedule()
        from adaptipe.runtime.jobarray import window_for

        plan = self.plan
        local = window_for(
            plan.schedule, plan.block_costs(self.instance), rounds, budget=self.budget
        )
        return remap_jobs(local, plan.jobs, self.num_jobs)


def memory_manager(
    config: RunConfig,
    stage: Stage,
    schedule: Schedule,
    instance: JapspInstance | None,
    device: torch.device,
) -> MemoryManager | None:
    """A memory manager when the sweep keeps fewer job states resident than it has jobs.

    It starts on the one-iteration order that fits the budget (the solver's order may
    not); each window then hands it that window's order.
    """
    from adaptipe.runtime.jobarray import window_for

    budget = config.sweep.memory_budget if config.sweep is not None else 0
    if stage.binder is None or instance is None or not 0 < budget < len(config.jobs):
        return None
    first = window_for(schedule, instance, 1, budget=budget)
    return MemoryManager(
        stage.binder, budget=budget, device=device, order=block_order(first.stages[stage.rank])
    )
