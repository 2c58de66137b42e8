"""`validate`: is a `Schedule` complete, causal, deadlock-free and correctly versioned?

The simulator and the stage workers execute schedules blindly (sends are posted
non-blocking and buffered, receives block), so every property they rely on is checked
here, once, with messages of the form
``stage 2, instruction 14 Backward(job=0, microbatch=3, chunk=0, version=0): why``.

Checks, in the order they run:

1. structure: one list per worker, job / micro-batch / chunk in range, each transfer's
   ``peer`` is the worker holding the neighbouring virtual stage (virtual stage ``g``
   lives on worker ``g % S``), ``V > 1`` needs ``S >= 2``;
2. every ``(job, micro-batch, virtual stage)`` has exactly one `Forward` and one
   `Backward`, forward first, with exactly one `Recompute` between them iff
   ``recompute`` (GPipe re-materialisation, dissertation ch. 3 §3.1);
3. data dependencies: a forward (backward) is preceded on its worker by the receive of
   its input activation (output gradient), a send follows the compute that produces
   it, and sends and receives pair up one to one across workers;
5. optimizer steps, per worker and job: ``M // update_every`` of them, the ``k``-th
   after every local backward of micro-batches ``< k * update_every`` and before any
   backward of a later one (flushes for GPipe / 1F1B, ch. 3 §3.3; every micro-batch for
   PipeDream, ch. 2 §2.3; every ``m`` for 2BW, ch. 3 §3.2);
6. weight versions per ``weights``: ``sync`` (one version, the live weights: a
   forward of micro-batch ``m`` runs after exactly ``m // update_every`` steps of its job
   on its worker, so with ``update_every < M`` a window holds ``M // update_every``
   successive flushes, as job-array windows do), ``stash`` (PipeDream weight
   stashing, ch. 2 §2.3.2), ``vertical`` (vertical sync, ch. 2 §2.3.2), ``2bw``
   (double buffering, ch. 3 §3.2.1: version ``max(mb // m - 1, 0)``, two live);
4. deadlock freedom: the lists are executed with buffered sends and blocking receives
   until every worker finishes or none can advance.

Checks 1-3, 5 and 6 run in one pass per worker (`adaptipe.schedule.stagecheck`, so a
worker's errors are reported in instruction order, before any cross-worker error);
matching and the deadlock run (`adaptipe.schedule.walk`) follow.
"""

from __future__ import annotations

from adaptipe.errors import ScheduleError
from adaptipe.schedule.stagecheck import (
    Event,
    Shared,
    StageCheck,
    schedule_error,
    vertical_mismatch,
)
from adaptipe.schedule.types import Backward, Forward, Schedule
from adaptipe.schedule.walk import walk

__all__ = ["in_flight", "validate"]

_WEIGHTS = ("sync", "stash", "vertical", "2bw")


def _check_header(schedule: Schedule) -> None:
    where = f"schedule {schedule.name!r}"
    s_count, m_count = schedule.num_stages, schedule.num_microbatches
    v_count, jobs, u = schedule.num_chunks, schedule.num_jobs, schedule.update_every
    for field, value in (
        ("num_stages", s_count),
        ("num_microbatches", m_count),
        ("num_chunks", v_count),
        ("num_jobs", jobs),
        ("update_every", u),
    ):
        if value < 1:
            raise ScheduleError(f"{where}: {field} must be >= 1 (got {value})")
    if len(schedule.stages) != s_count:
        raise ScheduleError(
            f"{where}: stages must hold num_stages={s_count} instruction lists (got {len(schedule.stages)})"
        )
    if v_count > 1 and s_count < 2:
        raise ScheduleError(
            f"{where}: num_chunks={v_count} > 1 needs num_stages >= 2 (a worker cannot send to itself)"
        )
    if schedule.weights not in _WEIGHTS:
        raise ScheduleError(
            f"{where}: weights must be one of {', '.join(_WEIGHTS)} (got {schedule.weights!r})"
        )
    if m_count % u != 0:
        raise ScheduleError(
            f"{where}: num_microbatches={m_count} must be a multiple of update_every={u}"
        )
    match schedule.weights:
        case "stash" | "vertical" if u != 1:
            raise ScheduleError(
                f"{where}: weights={schedule.weights!r} (PipeDream) steps after every micro-batch, "
                f"so update_every must be 1 (got {u})"
            )
        case "2bw" if u < s_count:
            raise ScheduleError(
                f"{where}: weights='2bw' needs update_every >= num_stages={s_count} so at most "
                f"two weight versions are live (got {u})"
            )
        case _:
            pass


def _check_vertical(schedule: Schedule, run: Shared) -> None:
    first = run.first_versions
    for s, i in run.pending:
        ins = schedule.stages[s][i]
        assert isinstance(ins, Forward)
        want = first[(ins.job, ins.microbatch)]
        if ins.version != want:
            raise schedule_error(s, i, ins, vertical_mismatch(ins.version, want))


def _check_pairs(schedule: Schedule, run: Shared) -> None:
    sends, recvs = run.sends, run.recvs
    if sends.keys() == recvs.keys():
        return
    names = (("SendActivation", "RecvActivation"), ("SendGradient", "RecvGradient"))
    for key, (s, i) in recvs.items():
        if key not in sends:
            p = schedule.stages[s][i]
            peer = getattr(p, "peer", -1)
            raise schedule_error(
                s,
                i,
                p,
                f"stage {peer} never sends this (no matching {names[key[0]][0]} there), so this receive would block forever",
            )
    for key, (s, i) in sends.items():
        if key not in recvs:
            p = schedule.stages[s][i]
            peer = getattr(p, "peer", -1)
            raise schedule_error(
                s, i, p, f"stage {peer} never receives this (no matching {names[key[0]][1]} there)"
            )


def _check_deadlock(schedule: Schedule, events: list[list[Event]]) -> None:
    """Run the transfers with buffered sends and blocking receives (`walk`)."""
    waits = [{p: key for p, (is_recv, key, _) in enumerate(ev) if is_recv} for ev in events]
    posts = [{p: key for p, (is_recv, key, _) in enumerate(ev) if not is_recv} for ev in events]
    _, pos = walk([len(ev) for ev in events], waits, posts)
    blocked = [s for s in range(schedule.num_stages) if pos[s] < len(events[s])]
    if blocked:
        parts = []
        for s in blocked:
            i = events[s][pos[s]][2]
            ins = schedule.stages[s][i]
            parts.append(
                f"stage {s}, instruction {i} {ins!r} waits for stage {getattr(ins, 'peer', -1)}"
            )
        raise ScheduleError(
            "deadlock (sends buffered, receives blocking): no stage can advance; "
            + "; ".join(parts)
        )


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` unless ``schedule`` passes every check in the module doc."""
    _check_header(schedule)
    run = Shared()
    events = [StageCheck(schedule, s, run).check() for s in range(schedule.num_stages)]
    if schedule.weights == "vertical":
        _check_vertical(schedule, run)
    _check_pairs(schedule, run)
    _check_deadlock(schedule, events)


def in_flight(schedule: Schedule) -> list[int]:
    """Per worker, the most ``(job, micro-batch, chunk)`` forwarded but not yet backwarded
    at any point (the activation stashes a worker holds; ch. 3 §3.3 memory model)."""
    peaks: list[int] = []
    for stage in schedule.stages:
        live: set[tuple[int, int, int]] = set()
        peak = 0
        for ins in stage:
            match ins:
                case Forward(j, m, c):
                    live.add((j, m, c))
                    peak = max(peak, len(live))
                case Backward(j, m, c):
                    live.discard((j, m, c))
                case _:
                    pass
        peaks.append(peak)
    return peaks
