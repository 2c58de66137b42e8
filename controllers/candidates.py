"""Candidate partitions a re-partitioning controller chooses among, scored by the
simulator under the conditions it observed.

Two families, after the papers the controllers follow:

- **AutoPipe's moves** (`autopipe_moves`): "we limit the new partition solution to only
  change the two workers' tasks in comparison to the old one" (AutoPipe §4.2). With
  contiguous stages that is one boundary between two adjacent stages shifted, each stage
  keeping a layer: boundary k may go to b[k+1] - b[k-1] - 2 new places, fewer than 2 L
  moves in all (18 for 16 layers in 4 equal stages), O(L) to list (the paper's O(L^2)).
- **DynPipe's condensed partitions** (`dynpipe_candidates`): the top-k layers by
  present computation and communication time become block ends (Algorithm 2,
  `adaptipe.plan.condense`) and every partition whose cuts lie on block boundaries is a
  candidate: C(k - 1, S - 1) of them (35 for k = 8 blocks, 4 stages).

`score` runs every candidate through the simulator at once
(`adaptipe.sim.conditions.first_iteration_times`: one iteration, one walk of the
schedule for all of them) with stage ``s`` at ``slowdowns[s]`` over the observed link
bandwidths; `top_k` is the best k of both families but the partition in force, for an
environment's action space. `top_k` first ranks every candidate by DynPipe's analytic
cycle time (`adaptipe.controllers.replan.predicted_time`) and simulates only the best
``k + screen``. On the reference GPT (``envs/profiles/gpt.json``, 16 layers, 2-4 stages,
4-16 micro-batches, random slowdowns and links, 80 cases) ``screen = 8`` missed the
simulator's best once, by 1.6%; ``screen = 4``: 3 misses of at most 2.7%; ``screen =
12``: none. Simulating a candidate at a time (0.4 ms each), k = 4 took about 5 ms with
``screen = 8`` and 13 ms for all ~55; simulated together, 0.5 ms and 0.6 ms (CPU time,
the held-out decisions of ``bench/bench_decision.py``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import numpy as np

from adaptipe.controllers.observation import Observation
from adaptipe.controllers.replan import best_partition
from adaptipe.errors import PlanError
from adaptipe.plan.condense import condense
from adaptipe.plan.dynpipe import cycle_time
from adaptipe.profile.types import LayerProfile, Profile
from adaptipe.sim.conditions import LayerCosts, first_iteration_times
from adaptipe.sim.migration import layer_owners

__all__ = [
    "BLOCKS",
    "FAMILIES",
    "SCREEN",
    "Bounds",
    "autopipe_moves",
    "candidates",
    "dynpipe_candidates",
    "layer_costs",
    "link_bandwidths",
    "score",
    "top_k",
]

Bounds = tuple[int, ...]

FAMILIES = ("autopipe", "dynpipe", "planner")
"""Candidate families: AutoPipe's two-worker moves, DynPipe's condensed partitions, and
the planner's single best partition (`adaptipe.controllers.replan.best_partition`, any
partition at all: for controllers that may restart)."""

BLOCKS = 8  # DynPipe's top-k: C(7, S - 1) partitions, 35 for 4 stages
SCREEN = 8  # candidates beyond k that the analytic ranking passes to the simulator


def layer_costs(obs: Observation, *, schedule: str = "1f1b") -> LayerCosts:
    """The simulator's per-layer costs from an observation's profiled seconds.

    An observation carries per layer only ``boundary_bytes[i]``: layer i's output plus
    the gradient into layer i + 1, what a cut after layer i carries both ways (DynPipe
    Eq. 7). Half goes forward, half backward: the gradient into layer i + 1 is taken
    with respect to its input, which is layer i's output, so the two have one shape and
    (in one dtype) one size. The last layer's output never crosses a cut.
    """
    n = obs.num_layers
    half = [b // 2 for b in obs.boundary_bytes]
    return LayerCosts(
        forward_s=tuple(obs.layer_forward_s),
        backward_s=tuple(obs.layer_backward_s),
        activation_bytes=tuple(obs.boundary_bytes[i] - half[i] for i in range(n)),
        gradient_bytes=(0, *half[: n - 1]),
        microbatches=obs.microbatches,
        schedule=schedule,
    )


def link_bandwidths(obs: Observation, stages: int | None = None) -> tuple[float, ...]:
    """Per stage boundary: the observed bandwidth (`Observation.boundary_bandwidth_Bps`:
    the slower direction; inf where unmeasured)."""
    count = (obs.num_stages if stages is None else stages) - 1
    return tuple(obs.boundary_bandwidth_Bps(s) for s in range(count))


def autopipe_moves(bounds: Sequence[int]) -> list[Bounds]:
    """Every partition that changes exactly two stages' layers from ``bounds``: one
    inner boundary moved between its neighbours, in boundary then position order."""
    _check_bounds(bounds, "autopipe_moves")
    out: list[Bounds] = []
    for k in range(1, len(bounds) - 1):
        for cut in range(bounds[k - 1] + 1, bounds[k + 1]):
            if cut != bounds[k]:
                out.append((*bounds[:k], cut, *bounds[k + 1 :]))
    return out


def dynpipe_candidates(
    obs: Observation,
    stages: int,
    top_k: int,
    *,
    slowdowns: Sequence[float] | None = None,
) -> list[Bounds]:
    """Every partition into ``stages`` whose cuts lie on the boundaries of DynPipe's
    ``top_k`` blocks (Algorithm 2), in lexicographic order.

    Layers are ranked by their present time: forward + backward seconds times the
    slowdown of the stage holding them now (``slowdowns``, per stage of the partition in
    force; default none), plus what a cut after them carries over the slowest link.
    With ``top_k`` >= the layer count every partition is a candidate.
    """
    n = obs.num_layers
    if isinstance(stages, bool) or not 1 <= stages <= n:
        raise PlanError(f"dynpipe_candidates: stages must be in 1..{n} (got {stages})")
    if isinstance(top_k, bool) or not stages <= top_k:
        raise PlanError(
            f"dynpipe_candidates: top_k must be >= the {stages} stages (got {top_k}): "
            "a partition cuts only between blocks"
        )
    slow = _slowdowns(obs, slowdowns, "dynpipe_candidates")
    links = link_bandwidths(obs)
    # condense ranks by compute + activation_bytes / bandwidth: give it the bytes a cut
    # carries both ways, and the stage's slowdown folded into the layer's seconds
    owner = layer_owners(obs.bounds)
    profile = Profile(
        model="observed",
        microbatch=1,
        device="observed",
        layers=tuple(
            LayerProfile(
                name=f"layer{i}",
                kind="Layer",
                forward_s=slow[owner[i]] * obs.layer_forward_s[i],
                backward_s=slow[owner[i]] * obs.layer_backward_s[i],
                activation_bytes=obs.boundary_bytes[i],
                gradient_bytes=0,
                saved_bytes=0,
                param_bytes=0,
                optimizer_bytes=0,
                num_params=0,
            )
            for i in range(n)
        ),
    )
    blocks = condense(profile, top_k, bandwidth_Bps=min(links, default=math.inf)).block_bounds
    inner = blocks[1:-1]
    return [(0, *cut, n) for cut in itertools.combinations(inner, stages - 1)]


def score(
    obs: Observation, candidates: Iterable[Sequence[int]], slowdowns: Sequence[float]
) -> list[tuple[Bounds, float]]:
    """Each candidate with its simulated seconds for one iteration (``obs.microbatches``
    micro-batches), stage ``s`` at ``slowdowns[s]`` times its layers' profiled seconds,
    over the observed link bandwidths; best first, ties by bounds. Duplicates are scored
    once. All candidates share one walk of the schedule
    (`adaptipe.sim.conditions.first_iteration_times`)."""
    slow = tuple(float(v) for v in slowdowns)
    unique = list(dict.fromkeys(tuple(int(b) for b in cand) for cand in candidates))
    for bounds in unique:
        if len(bounds) - 1 != len(slow):
            raise PlanError(
                f"score: {len(slow)} slowdowns for the {len(bounds) - 1} stages of {list(bounds)}"
            )
    if not unique:
        return []
    count = len(unique)
    times = first_iteration_times(
        layer_costs(obs),
        unique,
        np.broadcast_to(np.asarray(slow, dtype=np.float64), (count, len(slow))),
        np.broadcast_to(
            np.asarray(link_bandwidths(obs, len(slow)), dtype=np.float64),
            (count, len(slow) - 1),
        ),
    )
    out = list(zip(unique, times.tolist(), strict=True))
    out.sort(key=lambda bs: (bs[1], bs[0]))
    return out


def top_k(
    obs: Observation,
    slowdowns: Sequence[float],
    k: int,
    *,
    include: Sequence[str] = ("autopipe", "dynpipe"),
    blocks: int = BLOCKS,
    screen: int | None = SCREEN,
) -> list[tuple[Bounds, float]]:
    """The best ``k`` distinct candidates of the families in ``include`` (`FAMILIES`)
    for the stage count in force, scored (`score`), never the partition in force; fewer
    when fewer exist. ``blocks``: DynPipe's top-k (capped at the layer count);
    ``screen``: how many beyond ``k`` the analytic ranking passes to the simulator
    (None: simulate them all). Deterministic: ties go to the smaller bounds."""
    if isinstance(k, bool) or k < 1:
        raise PlanError(f"top_k: k must be an integer >= 1 (got {k!r})")
    if screen is not None and screen < 0:
        raise PlanError(f"top_k: screen must be >= 0 or None (got {screen})")
    slow = _slowdowns(obs, slowdowns, "top_k")
    found = set(candidates(obs, slow, include=include, blocks=blocks))
    found.discard(tuple(obs.bounds))
    ranked = sorted(found)
    if screen is not None and len(ranked) > k + screen:
        ranked = _screen(obs, ranked, slow, k + screen)
    return score(obs, ranked, slow)[:k]


def _screen(
    obs: Observation, ranked: list[Bounds], slow: Sequence[float], keep: int
) -> list[Bounds]:
    """The ``keep`` best of ``ranked`` by DynPipe's analytic time, ties by bounds: what
    ranking by `replan.predicted_time` gives, each stage's layer sum computed once (in
    its order, so rounding and ties stay the same)."""
    work = [f + b for f, b in zip(obs.layer_forward_s, obs.layer_backward_s, strict=True)]
    bws = link_bandwidths(obs)
    sums: dict[tuple[int, int], float] = {}

    def layers(a: int, b: int) -> float:
        hit = sums.get((a, b))
        if hit is None:
            hit = sums[(a, b)] = sum(work[a:b])
        return hit

    def predicted(bounds: Bounds) -> float:
        total = slow[0] * layers(bounds[0], bounds[1])
        for s in range(1, len(bounds) - 1):
            comm = obs.boundary_bytes[bounds[s] - 1] / bws[s - 1]
            total = cycle_time(total, comm, slow[s] * layers(bounds[s], bounds[s + 1]))
        return total

    return sorted(ranked, key=lambda b: (predicted(b), b))[:keep]


def candidates(
    obs: Observation,
    slowdowns: Sequence[float],
    *,
    include: Sequence[str] = ("autopipe", "dynpipe"),
    blocks: int = BLOCKS,
) -> list[Bounds]:
    """The candidates of the families in ``include`` for the stage count in force, in
    family order, possibly repeated and possibly the partition in force."""
    bad = [f for f in include if f not in FAMILIES]
    if bad or not include:
        raise PlanError(f"candidates: include must name some of {FAMILIES} (got {list(include)})")
    stages = obs.num_stages
    out: list[Bounds] = []
    if "autopipe" in include:
        out += autopipe_moves(obs.bounds)
    if "dynpipe" in include and stages <= min(blocks, obs.num_layers):
        top = min(blocks, obs.num_layers)
        out += dynpipe_candidates(obs, stages, top, slowdowns=slowdowns)
    if "planner" in include:
        out.append(best_partition(obs, slowdowns)[0])
    return out


def _slowdowns(obs: Observation, slowdowns: Sequence[float] | None, who: str) -> tuple[float, ...]:
    """Per stage in force: the given slowdowns, checked (None: all 1)."""
    if slowdowns is None:
        return (1.0,) * obs.num_stages
    slow = tuple(float(v) for v in slowdowns)
    if len(slow) != obs.num_stages or not all(v > 0 and math.isfinite(v) for v in slow):
        raise PlanError(
            f"{who}: slowdowns must be {obs.num_stages} finite factors > 0, one per stage "
            f"in force (got {list(slow)})"
        )
    return slow


def _check_bounds(bounds: Sequence[int], who: str) -> None:
    if len(bounds) < 2 or bounds[0] != 0 or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise PlanError(
            f"{who}: {list(bounds)} is not a partition (increasing layer bounds from 0)"
        )
