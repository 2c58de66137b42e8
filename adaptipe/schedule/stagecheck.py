"""One worker's pass of `adaptipe.schedule.validate`: checks 1-3, 5 and 6 in instruction order.

`StageCheck` reads a worker's list once; what the later cross-worker checks need (its
sends and receives, vertical-sync versions) goes into the `Shared` of the whole call.
"""

from __future__ import annotations

import itertools
from collections.abc import Container

from adaptipe.errors import ScheduleError
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

__all__ = [
    "ACT",
    "GRAD",
    "Event",
    "Key",
    "Shared",
    "StageCheck",
    "Where",
    "schedule_error",
    "vertical_mismatch",
]

ACT = 0
GRAD = 1

# A message between workers: (kind, job, microbatch, receiving virtual stage).
Key = tuple[int, int, int, int]
# (job, microbatch, chunk) on one worker.
Cell = tuple[int, int, int]
# Where an instruction sits: (stage, index).
Where = tuple[int, int]
# One worker's transfers in order, for the deadlock run: (is_recv, key, index).
Event = tuple[bool, Key, int]


def schedule_error(stage: int, index: int, ins: object, why: str) -> ScheduleError:
    return ScheduleError(f"stage {stage}, instruction {index} {ins!r}: {why}")


class Shared:
    """State shared across the per-worker passes of one `validate` call."""

    __slots__ = ("first_versions", "pending", "recvs", "sends")

    def __init__(self) -> None:
        self.sends: dict[Key, Where] = {}
        self.recvs: dict[Key, Where] = {}
        # Vertical sync: (job, mb) -> version virtual stage 0 used, and the forwards to
        # compare with it once every worker has been read.
        self.first_versions: dict[tuple[int, int], int] = {}
        self.pending: list[Where] = []


class StageCheck:
    """Checks 1-3, 5 and 6 on worker ``s``, in one pass over its instructions (`check`)."""

    def __init__(self, schedule: Schedule, s: int, run: Shared) -> None:
        self.schedule, self.s, self.run = schedule, s, run
        self.s_count, self.m_count = schedule.num_stages, schedule.num_microbatches
        self.v_count, self.jobs = schedule.num_chunks, schedule.num_jobs
        self.u, self.mode = schedule.update_every, schedule.weights
        self.last = self.s_count * self.v_count - 1
        self.n_steps = self.m_count // self.u
        self.per_step = self.v_count * self.u
        self.prev_w, self.next_w = (s - 1) % self.s_count, (s + 1) % self.s_count
        self.fwd: dict[Cell, tuple[int, int]] = {}  # (j, m, c) -> (index, version)
        self.bwd: dict[Cell, int] = {}
        self.rec: dict[Cell, int] = {}
        self.got_act: set[Cell] = set()
        self.got_grad: set[Cell] = set()
        self.seen: dict[tuple[type, int, int, int], int] = {}  # transfers on this worker
        self.steps = [0] * self.jobs
        self.group_done = [[0] * self.n_steps for _ in range(self.jobs)]
        self.events: list[Event] = []
        self.i = 0
        self.ins: Instruction | None = None

    def fail(self, why: str) -> ScheduleError:
        return schedule_error(self.s, self.i, self.ins, why)

    def check_range(self, j: int, m: int, c: int) -> None:
        if not 0 <= j < self.jobs:
            raise self.fail(f"job {j} out of range (num_jobs={self.jobs})")
        if not 0 <= m < self.m_count:
            raise self.fail(f"micro-batch {m} out of range (num_microbatches={self.m_count})")
        if not 0 <= c < self.v_count:
            raise self.fail(f"chunk {c} out of range (num_chunks={self.v_count})")

    def instruction(self, i: int, ins: Instruction) -> None:
        self.i, self.ins = i, ins
        match ins:
            case Forward(j, m, c, v):
                self.forward(j, m, c, v)
            case Backward(j, m, c, v):
                self.backward(j, m, c, v)
            case Recompute(j, m, c, v):
                self.recompute(j, m, c, v)
            case SendActivation(j, m, c, p):
                self.send(ACT, j, m, c, p, after=self.fwd, what="Forward")
            case RecvActivation(j, m, c, p):
                self.recv(ACT, j, m, c, p, got=self.got_act)
            case SendGradient(j, m, c, p):
                self.send(GRAD, j, m, c, p, after=self.bwd, what="Backward")
            case RecvGradient(j, m, c, p):
                self.recv(GRAD, j, m, c, p, got=self.got_grad)
            case OptimizerStep(j):
                self.optimizer_step(j)
            case _:
                raise self.fail("not a schedule instruction")

    def forward(self, j: int, m: int, c: int, v: int) -> None:
        self.check_range(j, m, c)
        key = (j, m, c)
        if key in self.fwd:
            raise self.fail(
                f"second Forward of this micro-batch and chunk on this stage (first at instruction {self.fwd[key][0]})"
            )
        g = c * self.s_count + self.s
        if g > 0 and key not in self.got_act:
            raise self.fail(
                f"no earlier RecvActivation of its input (virtual stage {g} gets it from stage {self.prev_w})"
            )
        self.forward_version(j, m, g, v)
        self.fwd[key] = (self.i, v)

    def forward_version(self, j: int, m: int, g: int, v: int) -> None:
        """Check 6: the weight version a Forward of virtual stage ``g`` uses."""
        done, u = self.steps[j], self.u
        if self.mode == "sync":
            if v != 0:
                raise self.fail(
                    f"weights='sync' has one weight version, so version must be 0, not {v}"
                )
            if done != m // u:
                raise self.fail(
                    f"weights='sync': micro-batch {m} belongs to flush {m // u + 1} "
                    f"(update_every={u}), so exactly {m // u} OptimizerStep(s) of job {j} "
                    f"must run before it on this stage, not {done}"
                )
        elif self.mode == "stash":
            if v != done:
                raise self.fail(
                    f"weight stashing: a Forward uses the newest weights, version {done} "
                    f"({done} OptimizerStep(s) of job {j} ran before it on this stage), not {v}"
                )
        elif self.mode == "vertical":
            if v > done:
                raise self.fail(
                    f"vertical sync: version {v} does not exist yet on this stage "
                    f"(only {done} OptimizerStep(s) of job {j} ran before it)"
                )
            if g == 0:
                if v != done:
                    raise self.fail(
                        f"vertical sync: virtual stage 0 uses the newest weights, version {done} "
                        f"({done} OptimizerStep(s) of job {j} ran before it), not {v}"
                    )
                self.run.first_versions[(j, m)] = v
            elif (want := self.run.first_versions.get((j, m))) is None:
                self.run.pending.append((self.s, self.i))  # stage 0 comes later in this list
            elif v != want:
                raise self.fail(vertical_mismatch(v, want))
        else:
            want = max(m // u - 1, 0)
            if v != want:
                raise self.fail(
                    f"PipeDream-2BW: micro-batch {m} uses version "
                    f"max({m} // update_every={u} - 1, 0) = {want}, not {v}"
                )
            if not done - 1 <= v <= done:
                raise self.fail(two_bw_live(v, done, j))

    def backward(self, j: int, m: int, c: int, v: int) -> None:
        self.check_range(j, m, c)
        key = (j, m, c)
        if key in self.bwd:
            raise self.fail(
                f"second Backward of this micro-batch and chunk on this stage (first at instruction {self.bwd[key]})"
            )
        f = self.fwd.get(key)
        if f is None:
            raise self.fail("no earlier Forward of this micro-batch and chunk on this stage")
        g = c * self.s_count + self.s
        if g < self.last and key not in self.got_grad:
            raise self.fail(
                f"no earlier RecvGradient of its output gradient (virtual stage {g} gets it from stage {self.next_w})"
            )
        if self.schedule.recompute and key not in self.rec:
            raise self.fail(
                f"recompute=True but no Recompute between its Forward (instruction {f[0]}) and it"
            )
        if v != f[1]:
            raise self.fail(
                f"version {v} differs from version {f[1]} its Forward (instruction {f[0]}) used; "
                "a Backward must use the weights of its Forward"
            )
        done, u = self.steps[j], self.u
        if self.mode == "2bw" and not done - 1 <= v <= done:
            raise self.fail(two_bw_live(v, done, j))
        grp = m // u
        if done < grp:
            raise self.fail(
                f"micro-batch {m} belongs to step {grp + 1} (update_every={u}) but only {done} "
                f"OptimizerStep(s) of job {j} ran before it; OptimizerStep {grp} must come first"
            )
        if done > grp:
            raise self.fail(
                f"comes after OptimizerStep {grp + 1} of job {j}, which must follow the "
                f"Backwards of all micro-batches < {(grp + 1) * u}"
            )
        self.group_done[j][grp] += 1
        self.bwd[key] = self.i

    def recompute(self, j: int, m: int, c: int, v: int) -> None:
        if not self.schedule.recompute:
            raise self.fail("the schedule has recompute=False, so it must not contain Recompute")
        self.check_range(j, m, c)
        key = (j, m, c)
        if key in self.rec:
            raise self.fail(
                f"second Recompute of this micro-batch and chunk on this stage (first at instruction {self.rec[key]})"
            )
        f = self.fwd.get(key)
        if f is None:
            raise self.fail("no earlier Forward of this micro-batch and chunk on this stage")
        if key in self.bwd:
            raise self.fail(
                f"comes after its Backward (instruction {self.bwd[key]}); it must sit between Forward and Backward"
            )
        if v != f[1]:
            raise self.fail(
                f"version {v} differs from version {f[1]} its Forward (instruction {f[0]}) used"
            )
        self.rec[key] = self.i

    def transfer(self, j: int, m: int, c: int, peer: int, *, to_next: bool) -> int:
        """Range, duplicate and peer checks; returns the virtual stage of ``c``."""
        self.check_range(j, m, c)
        name = type(self.ins).__name__
        tkey = (type(self.ins), j, m, c)
        if tkey in self.seen:
            raise self.fail(
                f"second {name} of this micro-batch and chunk on this stage "
                f"(first at instruction {self.seen[tkey]})"
            )
        self.seen[tkey] = self.i
        g = c * self.s_count + self.s
        if to_next and g == self.last:
            raise self.fail(f"virtual stage {g} is the last one (it computes the loss): no {name}")
        if not to_next and g == 0:
            raise self.fail(f"virtual stage 0 reads the input: no {name}")
        want = self.next_w if to_next else self.prev_w
        if peer != want:
            raise self.fail(
                f"peer must be stage {want}, which holds virtual stage {g + 1 if to_next else g - 1}"
            )
        return g

    def send(
        self, kind: int, j: int, m: int, c: int, peer: int, *, after: Container[Cell], what: str
    ) -> None:
        """A send: its checks, then the message it posts, kept for pairing and the deadlock run."""
        g = self.transfer(j, m, c, peer, to_next=kind == ACT)
        if (j, m, c) not in after:
            raise self.fail(f"no earlier {what} of this micro-batch and chunk on this stage")
        key = (kind, j, m, g + 1 if kind == ACT else g - 1)
        self.run.sends[key] = (self.s, self.i)
        self.events.append((False, key, self.i))

    def recv(self, kind: int, j: int, m: int, c: int, peer: int, *, got: set[Cell]) -> None:
        g = self.transfer(j, m, c, peer, to_next=kind == GRAD)
        got.add((j, m, c))
        key = (kind, j, m, g)
        self.run.recvs[key] = (self.s, self.i)
        self.events.append((True, key, self.i))

    def optimizer_step(self, j: int) -> None:
        if not 0 <= j < self.jobs:
            raise self.fail(f"job {j} out of range (num_jobs={self.jobs})")
        k, u = self.steps[j] + 1, self.u
        if k > self.n_steps:
            raise self.fail(
                f"OptimizerStep {k} of job {j}, but there must be exactly "
                f"num_microbatches // update_every = {self.n_steps}"
            )
        done = self.group_done[j][k - 1]
        if done != self.per_step:
            raise self.fail(
                f"OptimizerStep {k} of job {j} must follow the Backwards of all micro-batches "
                f"< {k * u} on this stage; only {done} of the {self.per_step} "
                f"Backwards of micro-batches [{(k - 1) * u}, {k * u}) ran before it"
            )
        self.steps[j] = k

    def check(self) -> list[Event]:
        """Check every instruction in order, then completeness; returns the transfers."""
        for i, ins in enumerate(self.schedule.stages[self.s]):
            self.instruction(i, ins)
        self.complete()
        return self.events

    def complete(self) -> None:
        """Every (job, mb, chunk) forwarded and backwarded exactly once; every step there."""
        s, s_count, m_count, u = self.s, self.s_count, self.m_count, self.u
        if len(self.bwd) != self.jobs * m_count * self.v_count:
            for key, (i, _v) in self.fwd.items():
                if key not in self.bwd:
                    raise schedule_error(
                        s,
                        i,
                        self.schedule.stages[s][i],
                        "never backwarded: no Backward of this micro-batch and chunk follows on this stage",
                    )
            for j, m, c in itertools.product(range(self.jobs), range(m_count), range(self.v_count)):
                if (j, m, c) not in self.fwd:
                    raise ScheduleError(
                        f"stage {s}: no Forward or Backward of job {j}, micro-batch {m}, chunk {c} "
                        f"(virtual stage {c * s_count + s}); every micro-batch must pass through "
                        "every virtual stage"
                    )
        for j in range(self.jobs):
            if self.steps[j] != self.n_steps:
                raise ScheduleError(
                    f"stage {s}: {self.steps[j]} OptimizerStep(s) of job {j}, but there must be exactly "
                    f"num_microbatches // update_every = {m_count} // {u} = {self.n_steps}"
                )


def two_bw_live(v: int, done: int, job: int) -> str:
    return (
        f"PipeDream-2BW keeps two weight versions: after {done} OptimizerStep(s) of job {job} on this "
        f"stage only versions {max(done - 1, 0)} and {done} are live, not {v}"
    )


def vertical_mismatch(v: int, want: int) -> str:
    return (
        "vertical sync: every stage uses the version virtual stage 0 used for this "
        f"micro-batch ({want}), not {v}"
    )
