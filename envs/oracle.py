"""The oracle: the best any controller could have done on a trace, the upper bound every
controller is reported against.

It knows the whole trace (the true slowdowns and bandwidths, and what comes next) and
chooses, step by step, the partition to train each step on, by a dynamic programme
over (step, partition): the least total seconds of the episode is

    T[t][c] = step_s[t][c] + min over c' of (T[t - 1][c'] + switch_s[t][c' -> c]),

with ``step_s`` the simulator's seconds of step ``t``'s iterations on ``c`` (noise-free,
preemption stalls included) and ``switch_s`` the migration cost model's stall of the
move at the start of step ``t``, priced as `Episode.switch_cost` prices it. The steps
before the first observation (``warm_steps``) run on the initial plan, as they do for
every controller. A fixed number of samples in the least time is the highest mean
throughput. The partitions are all of them when there are at most ``limit`` (the zoo
GPT on 4 stages has 455), else DynPipe's best per step on the true conditions and
their AutoPipe neighbours.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from adaptipe.envs.episode import _FREE_BPS, EpisodeSettings, initial_bounds
from adaptipe.envs.trace import Trace
from adaptipe.sim.conditions import iteration_times
from adaptipe.sim.migration import layer_owners

__all__ = ["OraclePlan", "all_partitions", "oracle"]

Bounds = tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class OraclePlan:
    """The partition of every step, and the episode it gives."""

    steps: tuple[Bounds, ...]
    seconds: float  # the episode's, stalls included
    samples: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def switches(self) -> int:
        return sum(1 for a, b in itertools.pairwise(self.steps) if a != b)


def all_partitions(layers: int, stages: int) -> list[Bounds]:
    """Every partition of ``layers`` layers into ``stages`` non-empty contiguous stages."""
    return [(0, *cuts, layers) for cuts in itertools.combinations(range(1, layers), stages - 1)]


def oracle(
    trace: Trace,
    settings: EpisodeSettings,
    *,
    warm_steps: int,
    initial: Sequence[int] | None = None,
    limit: int = 1000,
) -> OraclePlan:
    """The best plan for ``trace`` (see the module doc)."""
    costs = settings.layer_costs()
    layers, stages, k = costs.num_layers, settings.stages, settings.iterations_per_step
    start = tuple(initial) if initial is not None else initial_bounds(settings)
    parts = all_partitions(layers, stages)
    if len(parts) > limit:
        parts = _shortlist(trace, settings, start)
    if start not in parts:
        parts.append(start)
    slow, bws = trace.slowdowns(), trace.bandwidths()
    n = trace.iterations
    steps = math.ceil(n / k)
    stall = np.array([row.stall_s() for row in trace.rows])
    step_s = np.empty((steps, len(parts)))
    for j, bounds in enumerate(parts):
        times = iteration_times(costs, bounds, slow, bws) + stall
        step_s[:, j] = np.add.reduceat(times, np.arange(0, n, k))
    owners = np.array([layer_owners(b) for b in parts])  # (P, L)
    state = np.array(
        [x.param_bytes + x.optimizer_bytes for x in settings.profile.layers], dtype=np.float64
    )
    cost = settings.cost
    # T over partitions, with the warm steps pinned to the initial plan.
    first = min(warm_steps, steps)
    j0 = parts.index(start)
    total = np.full(len(parts), np.inf)
    total[j0] = step_s[:first, j0].sum()
    back = np.zeros((steps, len(parts)), dtype=np.int64)
    back[:first] = j0
    matrices: dict[bytes, npt.NDArray[np.float64]] = {}  # by the links' bandwidths
    for t in range(first, steps):
        key = bws[t * k].tobytes()
        if key not in matrices:
            matrices[key] = _switch_matrix(
                owners, state, bws[t * k], stages, cost.fixed_s, cost.efficiency
            )
        switch = matrices[key]
        options = total[:, None] + switch  # [from, to]
        back[t] = np.argmin(options, axis=0)
        total = options[back[t], np.arange(len(parts))] + step_s[t]
    best = int(np.argmin(total))
    plan = [best]
    for t in range(steps - 1, 0, -1):
        plan.append(int(back[t][plan[-1]]))
    plan.reverse()
    return OraclePlan(
        steps=tuple(parts[j] for j in plan),
        seconds=float(total[best]),
        samples=n * costs.samples_per_iteration,
    )


def _switch_matrix(
    owners: npt.NDArray[np.int64],
    state: npt.NDArray[np.float64],
    bandwidth: npt.NDArray[np.float64],
    stages: int,
    fixed_s: float,
    efficiency: float,
) -> npt.NDArray[np.float64]:
    """``[from, to]`` stall seconds: the moving layers' state over the slowest link any
    of them crosses (`Episode.switch_cost`'s rule), 0 on the diagonal."""
    bw = np.where(np.isfinite(bandwidth), bandwidth, _FREE_BPS)
    # slowest[a, b]: the least bandwidth over the links between stages a and b
    slowest = np.full((stages, stages), np.inf)
    for a in range(stages):
        for b in range(a + 1, stages):
            slowest[a, b] = slowest[b, a] = bw[a:b].min()
    old, new = owners[:, None, :], owners[None, :, :]
    moving = old != new  # (P, P, L)
    nbytes = moving @ state
    link = np.where(moving, slowest[old, new], np.inf).min(axis=2)
    out = np.where(nbytes > 0, fixed_s + nbytes / (efficiency * link), 0.0)
    return np.asarray(out, dtype=np.float64)


def _shortlist(trace: Trace, settings: EpisodeSettings, start: Bounds) -> list[Bounds]:
    """DynPipe's best partition per step on the true conditions, and its neighbours."""
    from adaptipe.controllers.observation import Observation
    from adaptipe.controllers.replan import best_partition

    profile, k = settings.profile, settings.iterations_per_step
    slow, bws = trace.slowdowns(), trace.bandwidths()
    found: set[Bounds] = {start}
    for t in range(0, trace.iterations, k):
        obs = Observation.from_profile(
            profile,
            start,
            microbatches=settings.microbatches,
            link_bandwidth_Bps={
                f"{s}-{s + 1}": float(bws[t, s]) for s in range(settings.stages - 1)
            },
        )
        best, _ = best_partition(obs, tuple(slow[t : t + k].mean(axis=0)))
        found.add(best)
        for s in range(1, len(best) - 1):
            for d in (-1, 1):
                moved = list(best)
                moved[s] += d
                if moved[s - 1] < moved[s] < moved[s + 1]:
                    found.add(tuple(moved))
    return sorted(found)
