"""Time a schedule whose stages are replicated (`adaptipe.schedule.replicate`).

The replicas' instruction lists are the runtime's (`replica_events`), run in the order
of `replica_walk`: a compute instruction advances its worker's clock by its stage's
time, a send posts its transfer ``transfer_s`` ahead of the sender's clock, a receive
waits for it, and the optimizer step of a replicated stage starts when the last of its
replicas arrives and takes the all-reduce's time before the update. With every stage
unreplicated and free links this is `adaptipe.sim.engine.simulate`'s timing (a test
holds them equal); links here are not shared (no FIFO per link), which is optimistic
only when transfers cost something.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.schedule.onefoneb import one_f_one_b
from adaptipe.schedule.replicate import (
    ReplicaLayout,
    check_replicable,
    replica_events,
    replica_walk,
)
from adaptipe.schedule.types import (
    Backward,
    Forward,
    OptimizerStep,
    Recompute,
    RecvActivation,
    RecvGradient,
    Schedule,
    SendActivation,
    SendGradient,
)
from adaptipe.sim.costs import CostModel

__all__ = [
    "WARMUP_RULES",
    "ReplicaSim",
    "compare_replicas",
    "replicated_one_f_one_b",
    "replicated_throughput",
]

WARMUP_RULES = ("stages", "workers", "workers-less-replicas")
"""How `replicated_one_f_one_b` may count stage ``s``'s warm-up forwards: ``stages`` as
unreplicated (``S - s - 1``), ``workers`` (``W_s - 1``, with ``W_s`` the workers of
stages ``s..S-1``: PipeDream's NOAM generalised) or ``workers-less-replicas``
(``W_s - r_s``)."""


@dataclass(frozen=True, slots=True)
class ReplicaSim:
    """One simulated iteration of a replicated pipeline.

    Attributes:
        replicas: per stage, its replicas.
        makespan_s: from the first instruction to the last worker's step.
        samples_per_s: the iteration's samples over its makespan.
        busy_s: per rank, seconds of compute and update (all-reduce excluded).
    """

    replicas: tuple[int, ...]
    makespan_s: float
    samples_per_s: float
    busy_s: tuple[float, ...]

    @property
    def workers(self) -> int:
        return sum(self.replicas)


def _per_stage(name: str, value: float | Sequence[float], stages: int) -> list[float]:
    values = [float(value)] * stages if isinstance(value, int | float) else list(value)
    if len(values) != stages or any(v < 0 for v in values):
        raise PlanError(f"{name} must hold one time >= 0 per stage ({stages}); got {values}")
    return values


def replicated_throughput(
    schedule: Schedule,
    replicas: Sequence[int],
    *,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    update_s: float | Sequence[float] = 0.0,
    allreduce_s: float | Sequence[float] = 0.0,
    transfer_s: float = 0.0,
    samples_per_microbatch: int = 1,
) -> ReplicaSim:
    """Simulate one iteration of ``schedule`` with stage ``s`` replicated ``replicas[s]``
    ways; per-stage times are seconds per micro-batch (``update_s`` and ``allreduce_s``
    per step; ``allreduce_s`` counts on replicated stages only)."""
    layout = ReplicaLayout(tuple(replicas))
    check_replicable(schedule, layout, source="replicated_throughput")
    stages = schedule.num_stages
    fwd = _per_stage("forward_s", forward_s, stages)
    bwd = _per_stage("backward_s", backward_s, stages)
    upd = _per_stage("update_s", update_s, stages)
    red = _per_stage("allreduce_s", allreduce_s, stages)
    steps = replica_events(schedule, layout)
    clock = [0.0] * layout.world
    busy = [0.0] * layout.world
    waited = [0] * layout.world
    posted: dict[Hashable, float] = {}
    for rank, i in replica_walk(schedule, layout, steps):
        ins, kind, key = steps[rank][i]
        stage = layout.place(rank)[0]
        r = layout.replicas[stage]
        match ins:
            case Forward() | Recompute() | Backward():
                spent = bwd[stage] if isinstance(ins, Backward) else fwd[stage]
                clock[rank] += spent
                busy[rank] += spent
            case SendActivation() | SendGradient():
                posted[key] = clock[rank] + transfer_s
            case RecvActivation() | RecvGradient():
                clock[rank] = max(clock[rank], posted[key])
            case OptimizerStep() if kind == "post":
                posted[key] = clock[rank]
            case OptimizerStep():
                if kind == "wait":
                    clock[rank] = max(clock[rank], posted[key])
                    waited[rank] += 1
                if r == 1 or waited[rank] % (r - 1) == 0:  # the last arrival: reduce, step
                    clock[rank] += upd[stage] + (red[stage] if r > 1 else 0.0)
                    busy[rank] += upd[stage]
    makespan = max(clock)
    samples = schedule.num_microbatches * samples_per_microbatch
    return ReplicaSim(
        replicas=layout.replicas,
        makespan_s=makespan,
        samples_per_s=samples / makespan if makespan > 0 else float("inf"),
        busy_s=tuple(busy),
    )


def _warmups(rule: str, replicas: Sequence[int]) -> list[int]:
    stages = len(replicas)
    downstream = [sum(replicas[s:]) for s in range(stages)]
    if rule == "stages":
        return [stages - s - 1 for s in range(stages)]
    if rule == "workers":
        return [w - 1 for w in downstream]
    return [w - r for w, r in zip(downstream, replicas, strict=True)]


def replicated_one_f_one_b(
    stages: int, microbatches: int, replicas: Sequence[int], *, recompute: bool = False
) -> Schedule:
    """1F1B (PipeDream-Flush) for stages replicated ``replicas`` ways.

    The replicas of a stage split its micro-batches, so the stage may keep more of them
    in flight than an unreplicated one; how many pays depends on the replicas of every
    stage after it. Each rule of `WARMUP_RULES` is simulated on a balanced pipeline (a
    stage's times proportional to its replicas: each worker equally loaded, what the
    planner's replication aims for) and the fastest is kept, the fewest warm-ups on a
    tie (less activation memory); ``meta["warmup_rule"]`` names it. Unreplicated, this is
    `one_f_one_b`.
    """
    if all(r == 1 for r in replicas):
        return one_f_one_b(stages, microbatches, recompute=recompute)
    best: tuple[tuple[float, int], str, Schedule] | None = None
    for rule in WARMUP_RULES:
        warm = _warmups(rule, replicas)
        schedule = one_f_one_b(stages, microbatches, recompute=recompute, warmups=warm)
        sim = replicated_throughput(
            schedule,
            replicas,
            forward_s=[float(r) for r in replicas],
            backward_s=[2.0 * r for r in replicas],
        )
        key = (round(sim.makespan_s, 9), sum(schedule.meta["warmup"]))
        if best is None or key < best[0]:
            best = (key, rule, schedule)
    assert best is not None
    _, rule, schedule = best
    return replace(schedule, meta={**schedule.meta, "warmup_rule": rule})


def compare_replicas(
    schedule: Schedule, replicas: Sequence[int], costs: CostModel
) -> dict[str, Any]:
    """``schedule`` (one job, no virtual stages) with its stages replicated ``replicas``
    ways against the same stages unreplicated, under ``costs``: compute and updates per
    stage (times the slowdown), a ring all-reduce of each replicated stage's parameters
    (``2 (r - 1) / r`` of them over the link) and, for every transfer, the largest
    boundary's activation time. A ``1f1b`` schedule runs with the replicas' warm-ups
    (`replicated_one_f_one_b`), as ``adaptipe train`` does."""
    stages = schedule.num_stages
    if schedule.num_chunks != 1 or costs.num_vstages != stages:
        raise PlanError("replicated stages: the schedule must have one chunk per stage")
    slow = costs.slowdowns(stages)
    fwd = costs.array("forward_s")[0] * slow
    bwd = (
        costs.array("backward_s")[0]
        + (costs.array("recompute_s")[0] if schedule.recompute else 0.0)
    ) * slow
    upd = costs.array("update_s")[0] * slow
    params = costs.array("param_bytes")
    bw, lat = costs.bandwidth_Bps, costs.latency_s
    red = [
        lat + 2 * (r - 1) / r * float(params[s]) / bw if r > 1 else 0.0
        for s, r in enumerate(replicas)
    ]
    acts = costs.array("activation_bytes")[0]
    transfer = max(
        (costs.transfer_s(s, s + 1, float(acts[s])) for s in range(stages - 1)), default=0.0
    )
    times: dict[str, Any] = {
        "forward_s": fwd.tolist(),
        "backward_s": bwd.tolist(),
        "update_s": upd.tolist(),
        "transfer_s": transfer,
        "samples_per_microbatch": costs.samples_per_microbatch,
    }
    base = replicated_throughput(schedule, (1,) * stages, **times)
    run = schedule
    if schedule.name == "1f1b":
        run = replicated_one_f_one_b(
            stages, schedule.num_microbatches, replicas, recompute=schedule.recompute
        )
    got = replicated_throughput(run, replicas, allreduce_s=red, **times)
    return {
        "replicas": list(got.replicas),
        "workers": got.workers,
        "makespan": got.makespan_s,
        "unreplicated_makespan": base.makespan_s,
        "speedup": base.makespan_s / got.makespan_s if got.makespan_s > 0 else math.inf,
        "allreduce_s": red,
        "warmup": run.meta.get("warmup"),
        "warmup_rule": run.meta.get("warmup_rule"),
    }
