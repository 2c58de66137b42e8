"""Gradient clipping by the global norm in a job-array: per job, over every stage.

One job clips as `adaptipe.runtime.recipe.GlobalClip` does, with an all-reduce at its
only step. A job-array steps each job on each stage at that job's own place in the
stage's program (after its last local backward), in an order that differs from stage
to stage, so one collective per job could deadlock. Instead, at each of a job's
optimizer steps, a stage sends the squared norms of its own layers of that job (a
float64 vector over the model's layers, zeros elsewhere) to every other stage,
non-blocking, on a gloo group of its own; the step itself is applied once the other
stages' vectors are in:

- at the step (where a memory manager offloads job states: they stay resident until
  then), unless waiting there would deadlock;
- else just before the job's next forward on this stage, or at the window's end,
  whichever comes first: nothing waits where it would idle the pipeline. A deferred
  step with offloaded states lets the state go at the step and applies the step once
  the state is back (its gradients travel with it).

Before a window runs, its programs are walked with the norm messages added
(`plan_waits`, on `adaptipe.schedule.walk`), and each step waits at its place only
where that cannot deadlock; waits deferred to the end never deadlock. Every entry of the summed vector comes from one stage, so the
norm, summed in layer order, is bitwise the one job alone computes, on any partition.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from adaptipe.errors import ScheduleError
from adaptipe.schedule.types import (
    Forward,
    Instruction,
    OptimizerStep,
    RecvActivation,
    RecvGradient,
    Schedule,
    SendActivation,
    SendGradient,
)
from adaptipe.schedule.walk import walk

from .recipe import clip_coefficient, global_norm, params_sq_norm

__all__ = ["JobClip", "NormExchange", "check_waits", "job_clip", "plan_waits"]

_TAG_STEPS = 4096  # a job's steps per window: at most its micro-batches
_PLANS_KEPT = 8  # window schedules whose wait placement is remembered


class NormExchange:
    """Non-blocking sends and blocking gathers of per-layer squared norms between the
    stage processes (gloo point-to-point on ``group``)."""

    def __init__(self, group: Any, rank: int, world: int, num_jobs: int) -> None:
        self.group, self.rank, self.num_jobs = group, rank, num_jobs
        self.peers = [r for r in range(world) if r != rank]
        self._sends: list[tuple[Any, Tensor]] = []

    def _tag(self, epoch: int, job: int, k: int) -> int:
        return ((epoch % 4) * self.num_jobs + job) * _TAG_STEPS + k

    def send(self, epoch: int, job: int, k: int, vector: Tensor) -> None:
        import torch.distributed as dist

        for peer in self.peers:
            work = dist.isend(vector, peer, group=self.group, tag=self._tag(epoch, job, k))
            self._sends.append((work, vector))

    def gather(self, epoch: int, job: int, k: int, size: int) -> list[Tensor]:
        import torch.distributed as dist

        tag = self._tag(epoch, job, k)
        bufs = [torch.zeros(size, dtype=torch.float64) for _ in self.peers]
        works = [
            dist.irecv(buf, peer, group=self.group, tag=tag)
            for buf, peer in zip(bufs, self.peers, strict=True)
        ]
        for work in works:
            if work is not None:  # None only off the group
                work.wait()
        return bufs

    def flush(self) -> None:
        for work, _ in self._sends:
            if work is not None:
                work.wait()
        self._sends.clear()


@dataclass(slots=True)
class _Pending:
    k: int
    local: Tensor
    apply: Callable[[float | None], None]


class JobClip:
    """Clips each job's gradients by its whole-model norm before its steps (module doc).

    Args:
        max_norms: per job, its ``clip_grad_norm`` (0: that job does not clip).
        num_layers: the model's layers.
        exchange: how the vectors travel (`NormExchange`; tests pass their own).
    """

    def __init__(self, max_norms: Sequence[float], num_layers: int, exchange: NormExchange) -> None:
        self.max_norms, self.num_layers, self.exchange = list(max_norms), num_layers, exchange
        self.epoch = 0
        self.last_norm: dict[int, float] = {}
        self._steps: dict[int, int] = {}
        self._pending: dict[int, _Pending] = {}
        # the last few windows' placements, keyed by their schedule (held, so that its
        # id is not reused while the entry lives)
        self._plans: dict[tuple[int, bool], tuple[Schedule, list[set[tuple[int, int]]]]] = {}
        self._here: set[tuple[int, int]] = set()  # (job, k) steps applied where they are

    def plan(self, schedule: Schedule, *, at_step: bool) -> None:
        """Place this stage's waits for ``schedule`` (a window's): at the steps where
        ``at_step`` asks and that cannot deadlock, the rest deferred (module doc)."""
        key = (id(schedule), at_step)
        if key not in self._plans:
            clipped = {j for j, n in enumerate(self.max_norms) if n}
            self._plans[key] = (schedule, plan_waits(schedule, clipped, at_step=at_step))
            while len(self._plans) > _PLANS_KEPT:
                del self._plans[next(iter(self._plans))]  # the oldest
        self._here = self._plans[key][1][self.exchange.rank]

    def step(
        self,
        job: int,
        layers: Sequence[tuple[int, Sequence[Tensor]]],
        apply: Callable[[float | None], None],
        release: Callable[[], None] | None = None,
    ) -> None:
        """At ``job``'s optimizer step: send the squared norms of this stage's
        ``layers`` (index, parameters in registration order); ``apply(coef)`` the step, its gradients scaled by
        ``coef`` (None: as they are), now or later (`plan`). A step applied later calls
        ``release`` now (the memory manager may offload the job's state meanwhile)."""
        if not self.max_norms[job]:
            apply(None)
            return
        self.complete(job)  # an earlier step of the job still waiting (never in valid lists)
        k = self._steps.get(job, 0)
        self._steps[job] = k + 1
        local = torch.zeros(self.num_layers, dtype=torch.float64)
        for index, params in layers:
            local[index] = params_sq_norm(params)
        self.exchange.send(self.epoch, job, k, local)
        self._pending[job] = _Pending(k, local, apply)
        if (job, k) in self._here:
            self.complete(job)
        elif release is not None:
            release()

    def complete(self, job: int) -> None:
        """Apply ``job``'s waiting step, if any, once every stage's norms are in."""
        pending = self._pending.pop(job, None)
        if pending is None:
            return
        total = pending.local.clone()
        for other in self.exchange.gather(self.epoch, job, pending.k, self.num_layers):
            total += other  # each entry is one stage's, plus zeros: exact in any order
        norm = global_norm(dict(enumerate(total.tolist())), self.num_layers)
        self.last_norm[job] = norm
        coef = clip_coefficient(norm, self.max_norms[job])
        pending.apply(coef)

    def end_window(self) -> None:
        """Apply every step still waiting, in the order they were taken."""
        for job in sorted(self._pending, key=lambda j: self._pending[j].k):
            self.complete(job)
        self.exchange.flush()
        self.epoch += 1
        self._steps.clear()


def plan_waits(
    schedule: Schedule, clipped: set[int], *, at_step: bool
) -> list[set[tuple[int, int]]]:
    """Per stage, the ``(job, k)`` steps (a job's k-th in the window) that wait for the
    norms where they are: all where ``at_step`` and the walk finishes, less those a
    stage is stuck at, until it does; none otherwise."""
    here = [_steps(schedule, s, clipped) if at_step else set() for s in range(schedule.num_stages)]
    while True:
        why, stuck = _walk(schedule, clipped, here)
        if why is None:
            return here
        moved = False
        for stage, token in stuck:
            if token[0] == "norm" and (token[2], token[3]) in here[stage]:
                here[stage].discard((token[2], token[3]))
                moved = True
        if not moved:  # deferred to the ends: only a schedule that deadlocks anyway
            raise ScheduleError(f"clipping in a job-array: the norm waits deadlock ({why})")


def check_waits(schedule: Schedule, clipped: set[int], *, at_step: bool) -> str | None:
    """Walk with every wait at its step (``at_step``) or every one deferred: None if
    every list finishes, else where the stages stop."""
    here = [_steps(schedule, s, clipped) if at_step else set() for s in range(schedule.num_stages)]
    return _walk(schedule, clipped, here)[0]


def _steps(schedule: Schedule, stage: int, clipped: set[int]) -> set[tuple[int, int]]:
    seen: dict[int, int] = {}
    for ins in schedule.stages[stage]:
        if isinstance(ins, OptimizerStep) and ins.job in clipped:
            seen[ins.job] = seen.get(ins.job, 0) + 1
    return {(j, k) for j, n in seen.items() for k in range(n)}


def _walk(
    schedule: Schedule, clipped: set[int], here: list[set[tuple[int, int]]]
) -> tuple[str | None, list[tuple[int, Any]]]:
    """Buffered sends, blocking receives (`walk`), the norm messages included."""
    events = [_events(schedule, s, clipped, here[s]) for s in range(schedule.num_stages)]
    waits = [{i: tok for i, (is_wait, tok) in enumerate(ev) if is_wait} for ev in events]
    posts = [{i: tok for i, (is_wait, tok) in enumerate(ev) if not is_wait} for ev in events]
    _, pos = walk([len(ev) for ev in events], waits, posts)
    stuck = [(s, events[s][p][1]) for s, p in enumerate(pos) if p < len(events[s])]
    why = "; ".join(f"stage {s} waits for {tok}" for s, tok in stuck) if stuck else None
    return why, stuck


def _events(
    schedule: Schedule, stage: int, clipped: set[int], here: set[tuple[int, int]]
) -> list[tuple[bool, Any]]:
    """One stage's waits (True) and posts (False), with the norm messages."""
    others = [s for s in range(schedule.num_stages) if s != stage]
    out: list[tuple[bool, Any]] = []
    steps: dict[int, int] = {}
    waiting: dict[int, int] = {}  # job -> its deferred step

    def norms_in(job: int, k: int) -> None:
        out.extend((True, ("norm", s, job, k)) for s in others)

    program: Sequence[Instruction] = schedule.stages[stage]
    for ins in program:
        if isinstance(ins, Forward) and ins.job in waiting:
            norms_in(ins.job, waiting.pop(ins.job))
        token = _transfer(schedule, stage, ins)
        if token is not None:
            out.append(token)
        if isinstance(ins, OptimizerStep) and ins.job in clipped:
            k = steps.get(ins.job, 0)
            steps[ins.job] = k + 1
            out.append((False, ("norm", stage, ins.job, k)))
            if (ins.job, k) in here:
                norms_in(ins.job, k)
            else:
                waiting[ins.job] = k
    for job, k in sorted(waiting.items(), key=lambda item: item[1]):
        norms_in(job, k)
    return out


def _transfer(schedule: Schedule, stage: int, ins: Instruction) -> tuple[bool, Any] | None:
    match ins:
        case SendActivation(job=j, microbatch=m, chunk=c):
            return False, ("act", j, m, schedule.vstage(stage, c) + 1)
        case RecvActivation(job=j, microbatch=m, chunk=c):
            return True, ("act", j, m, schedule.vstage(stage, c))
        case SendGradient(job=j, microbatch=m, chunk=c):
            return False, ("grad", j, m, schedule.vstage(stage, c))
        case RecvGradient(job=j, microbatch=m, chunk=c):
            return True, ("grad", j, m, schedule.vstage(stage, c) + 1)
    return None


def job_clip(max_norms: Mapping[int, float], num_layers: int) -> JobClip | None:
    """The job-array clipper ``[optimizer]`` / ``[[sweep.jobs]]`` ``clip_grad_norm``
    asks for over every stage process (None: no job clips). Every stage calls it once,
    in the same order as its other groups."""
    norms = [float(max_norms[j]) for j in sorted(max_norms)]
    if not any(norms):
        return None
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    exchange = NormExchange(group, dist.get_rank(), dist.get_world_size(), len(norms))
    return JobClip(norms, num_layers, exchange)
