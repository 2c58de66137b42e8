"""Replicated stages (PipeDream's 1F1B-RR): one stage run by ``r`` data-parallel workers.

A stage replicated ``r`` ways runs as ``r`` workers; micro-batch ``m`` of the stage goes
to its replica ``m mod r`` (round robin, dissertation ch. 2 §2.3.1), so each send or
receive goes to the replica of the neighbouring stage that holds the same micro-batch.
A replica's instruction list is its stage's list restricted to its micro-batches, with
peers turned into worker ranks (`replica_program`); its `OptimizerStep` is preceded by an
all-reduce (sum) of the gradients over the stage's replicas, so every replica applies
the update one process would, and all of them hold the same weights afterwards.

Ranks (`ReplicaLayout`): replica 0 of stage ``s`` keeps rank ``s``, so ranks
``0..S-1`` are the stages as in an unreplicated run (its metrics, checkpoints, logs and
errors stay where they were); the further replicas follow from rank ``S`` on, stage by
stage.

Only synchronous schedules of one job without virtual stages are replicated
(`check_replicable`): a flush before each step is what lets the replicas' sum be the
one-process gradient. `validate_replicated` checks the replicas' lists the way
`adaptipe.schedule.validate` checks a schedule's: every send has its receive on the
replica that holds its micro-batch, and the lists (all-reduce included) run to the end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from adaptipe.errors import PlanError, ScheduleError
from adaptipe.schedule.types import (
    Backward,
    Forward,
    Instruction,
    OptimizerStep,
    Recompute,
    RecvActivation,
    RecvGradient,
    Schedule,
    SendActivation,
    SendGradient,
)
from adaptipe.schedule.validate import validate
from adaptipe.schedule.walk import walk

__all__ = [
    "REPLICATED_SCHEDULES",
    "ReplicaLayout",
    "check_replicable",
    "replica_events",
    "replica_program",
    "replica_view",
    "replica_walk",
    "validate_replicated",
]

REPLICATED_SCHEDULES = ("gpipe", "1f1b")
"""Schedules whose stages may be replicated: they flush before the one optimizer step."""


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """Which rank runs which replica of which stage (module doc: replica 0 is rank s)."""

    replicas: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.replicas or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.replicas
        ):
            raise PlanError(
                f"replicas must hold one integer >= 1 per stage (got {list(self.replicas)})"
            )

    @classmethod
    def of(cls, replicas: Sequence[int], num_stages: int) -> ReplicaLayout:
        """The layout of a run of ``num_stages`` workers whose partition holds
        ``replicas`` (per partition stage: all 1 for the virtual stages of ``interleaved``,
        whose partition has more stages than workers)."""
        if all(r == 1 for r in replicas):
            return cls((1,) * num_stages)
        if len(replicas) != num_stages:
            raise PlanError(
                f"replicas {list(replicas)} name {len(replicas)} stages but the schedule has "
                f"{num_stages} workers (one entry per stage)"
            )
        return cls(tuple(replicas))

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def world(self) -> int:
        """Worker processes in all."""
        return sum(self.replicas)

    @property
    def replicated(self) -> bool:
        return any(r > 1 for r in self.replicas)

    def rank(self, stage: int, replica: int) -> int:
        """The rank of ``replica`` of ``stage``."""
        if not 0 <= replica < self.replicas[stage]:
            raise IndexError(f"stage {stage} has {self.replicas[stage]} replicas (got {replica})")
        if replica == 0:
            return stage
        return self.num_stages + sum(r - 1 for r in self.replicas[:stage]) + replica - 1

    def place(self, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` of ``rank``."""
        if not 0 <= rank < self.world:
            raise IndexError(f"rank {rank} out of range 0..{self.world - 1}")
        if rank < self.num_stages:
            return rank, 0
        extra = rank - self.num_stages
        for stage, r in enumerate(self.replicas):
            if extra < r - 1:
                return stage, extra + 1
            extra -= r - 1
        raise AssertionError("unreachable")  # pragma: no cover

    def ranks(self, stage: int) -> tuple[int, ...]:
        """Every rank of ``stage``, replica 0 first."""
        return tuple(self.rank(stage, k) for k in range(self.replicas[stage]))

    def owner(self, stage: int, microbatch: int) -> int:
        """The rank of the replica of ``stage`` that runs ``microbatch`` (round robin)."""
        return self.rank(stage, microbatch % self.replicas[stage])


def check_replicable(schedule: Schedule, layout: ReplicaLayout, *, source: str = "") -> None:
    """Raise `PlanError` unless ``schedule``'s stages can run replicated as ``layout`` says.

    ``source`` names where the replicas came from (``"run.toml: [pipeline].replicas"``).
    """
    where = source or "replicas"
    reps = list(layout.replicas)
    if layout.num_stages != schedule.num_stages:
        raise PlanError(
            f"{where}: {reps} names {layout.num_stages} stages but the schedule has "
            f"{schedule.num_stages} (one entry per stage)"
        )
    if not layout.replicated:
        return
    if schedule.name not in REPLICATED_SCHEDULES or schedule.weights != "sync":
        raise PlanError(
            f"{where}: {reps} replicates a stage, which runs with the schedules "
            f"{', '.join(REPLICATED_SCHEDULES)} only (they flush before the step the "
            f"replicas all-reduce for); got schedule {schedule.name!r}"
        )
    if schedule.num_chunks != 1 or schedule.num_jobs != 1:
        raise PlanError(
            f"{where}: {reps} replicates a stage, which needs one job and no virtual stages "
            f"(got {schedule.num_jobs} jobs, {schedule.num_chunks} chunks per worker)"
        )
    most = max(layout.replicas)
    if schedule.num_microbatches < most:
        raise PlanError(
            f"{where}: {reps} gives a stage {most} replicas but an iteration has only "
            f"{schedule.num_microbatches} micro-batches; every replica needs one "
            f"(allowed: replicas <= [data].microbatches = {schedule.num_microbatches})"
        )


def replica_program(
    schedule: Schedule, layout: ReplicaLayout, rank: int
) -> tuple[Instruction, ...]:
    """The instruction list ``rank`` runs: its stage's, restricted to its micro-batches,
    with each transfer's peer the rank of the neighbour's replica holding the micro-batch."""
    stage, replica = layout.place(rank)
    r = layout.replicas[stage]
    out: list[Instruction] = []
    for ins in schedule.stages[stage]:
        if isinstance(ins, OptimizerStep):
            out.append(ins)
        elif ins.microbatch % r == replica:
            if isinstance(ins, SendActivation | RecvActivation | SendGradient | RecvGradient):
                ins = replace(ins, peer=layout.owner(ins.peer, ins.microbatch))
            out.append(ins)
    return tuple(out)


def replica_view(schedule: Schedule, layout: ReplicaLayout, rank: int) -> Schedule:
    """``schedule`` as ``rank``'s executor runs it: its stage's list is ``rank``'s
    `replica_program` (the other lists, and every count, stay the stage-level ones)."""
    stage, _ = layout.place(rank)
    program = replica_program(schedule, layout, rank)
    stages = tuple(program if s == stage else lst for s, lst in enumerate(schedule.stages))
    return replace(schedule, stages=stages)


_Key = tuple[str, int, int, int, int]  # (kind, sender, receiver, job, micro-batch)


def _token(ins: Instruction, rank: int) -> tuple[str, _Key] | None:
    """``("post"|"wait", key)`` of a transfer; a key names sender, receiver and payload."""
    match ins:
        case SendActivation(job=j, microbatch=m, peer=p):
            return "post", ("act", rank, p, j, m)
        case RecvActivation(job=j, microbatch=m, peer=p):
            return "wait", ("act", p, rank, j, m)
        case SendGradient(job=j, microbatch=m, peer=p):
            return "post", ("grad", rank, p, j, m)
        case RecvGradient(job=j, microbatch=m, peer=p):
            return "wait", ("grad", p, rank, j, m)
        case _:
            return None


Event = tuple[Instruction, str, Hashable]
"""One step of a replica's walk: its instruction, ``"post"``, ``"wait"`` or ``""``, and
the token posted or waited for (a transfer's `_Key`, or an all-reduce arrival)."""


def replica_events(schedule: Schedule, layout: ReplicaLayout) -> list[list[Event]]:
    """Per rank, its `replica_program` as walk steps: a send posts its transfer, a receive
    waits for it, and the `OptimizerStep` of a replicated stage posts its arrival at the
    all-reduce and then waits for every other replica's (so none leaves before all came).
    """
    steps: list[list[Event]] = []
    for rank in range(layout.world):
        stage, replica = layout.place(rank)
        r = layout.replicas[stage]
        events: list[Event] = []
        done: dict[int, int] = {}
        for ins in replica_program(schedule, layout, rank):
            token = _token(ins, rank)
            if token is not None:
                events.append((ins, *token))
            elif isinstance(ins, OptimizerStep) and r > 1:
                n = done[ins.job] = done.get(ins.job, 0) + 1
                events.append((ins, "post", ("reduce", stage, ins.job, n, replica)))
                for other in range(r):
                    if other != replica:
                        events.append((ins, "wait", ("reduce", stage, ins.job, n, other)))
            else:
                events.append((ins, "", None))
        steps.append(events)
    return steps


def replica_walk(
    schedule: Schedule, layout: ReplicaLayout, steps: Sequence[Sequence[Event]] | None = None
) -> list[tuple[int, int]]:
    """The ``(rank, step)`` order `walk` runs `replica_events` in; `ScheduleError` when
    some replica cannot finish (a deadlock)."""
    steps = replica_events(schedule, layout) if steps is None else steps
    waits = [{i: key for i, (_, kind, key) in enumerate(ev) if kind == "wait"} for ev in steps]
    posts = [{i: key for i, (_, kind, key) in enumerate(ev) if kind == "post"} for ev in steps]
    order, pc = walk([len(ev) for ev in steps], waits, posts)
    blocked = [rank for rank, ev in enumerate(steps) if pc[rank] < len(ev)]
    if blocked:
        parts = []
        for rank in blocked:
            stage, replica = layout.place(rank)
            parts.append(
                f"rank {rank} (stage {stage} replica {replica}) at {steps[rank][pc[rank]][0]}"
            )
        raise ScheduleError(
            f"replicated schedule {schedule.name!r} with replicas {list(layout.replicas)} "
            "deadlocks: blocked " + "; ".join(parts)
        )
    return order


def validate_replicated(schedule: Schedule, layout: ReplicaLayout) -> None:
    """Raise `ScheduleError` unless every replica's list is sound and they run to the end.

    Checks `check_replicable` and `validate` (the stage-level schedule), then, over the
    `replica_program` of every rank: each compute instruction is its replica's micro-batch,
    each send has exactly one receive on its peer naming the sender (and the other way
    round), and the walk of `replica_events` (buffered sends, blocking receives, the
    all-reduce before each `OptimizerStep`) finishes (`replica_walk`).
    """
    try:
        check_replicable(schedule, layout)
    except PlanError as exc:
        raise ScheduleError(str(exc)) from None
    validate(schedule)
    steps = replica_events(schedule, layout)
    counts: dict[str, Counter[_Key]] = {"post": Counter(), "wait": Counter()}
    for rank, events in enumerate(steps):
        stage, replica = layout.place(rank)
        for i, (ins, _, _) in enumerate(events):
            mine = layout.replicas[stage]
            if isinstance(ins, Forward | Backward | Recompute) and ins.microbatch % mine != replica:
                why = f"micro-batch {ins.microbatch} is not its own"
                raise _error(rank, layout, i, ins, why)
            transfer = _token(ins, rank)
            if transfer is not None:
                counts[transfer[0]][transfer[1]] += 1
    posts, waits = counts["post"], counts["wait"]
    for key in sorted(set(posts) | set(waits), key=repr):
        if posts[key] != 1 or waits[key] != 1:
            kind, src, dst, job, mb = key
            raise ScheduleError(
                f"replicated schedule {schedule.name!r}: the {kind} of job {job} micro-batch "
                f"{mb} from rank {src} to rank {dst} is sent {posts[key]} and received "
                f"{waits[key]} times (each must be once)"
            )
    replica_walk(schedule, layout, steps)


def _error(
    rank: int, layout: ReplicaLayout, index: int, ins: Instruction, why: str
) -> ScheduleError:
    stage, replica = layout.place(rank)
    return ScheduleError(
        f"rank {rank} (stage {stage} replica {replica}) instruction {index} {ins}: {why}"
    )
