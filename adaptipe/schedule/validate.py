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

Checks 1-3, 5 and 6 run in one pass per worker (so a worker's errors are reported in
instruction order, before any cross-worker error); matching and the deadlock run follow.
"""

from __future__ import annotations

from collections import deque

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

__all__ = ["in_flight", "validate"]

_ACT = 0
_GRAD = 1
_WEIGHTS = ("sync", "stash", "vertical", "2bw")

# A message between workers: (kind, job, microbatch, receiving virtual stage).
_Key = tuple[int, int, int, int]
# Where an instruction sits: (stage, index).
_Where = tuple[int, int]
# One worker's transfers in order, for the deadlock run: (is_recv, key, index).
_Event = tuple[bool, _Key, int]


def _err(stage: int, index: int, ins: object, why: str) -> ScheduleError:
    return ScheduleError(f"stage {stage}, instruction {index} {ins!r}: {why}")


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


class _Run:
    """State shared across the per-worker passes of one `validate` call."""

    __slots__ = ("first_versions", "pending", "recvs", "sends")

    def __init__(self) -> None:
        self.sends: dict[_Key, _Where] = {}
        self.recvs: dict[_Key, _Where] = {}
        # Vertical sync: (job, mb) -> version virtual stage 0 used, and the forwards to
        # compare with it once every worker has been read.
        self.first_versions: dict[tuple[int, int], int] = {}
        self.pending: list[_Where] = []


def _check_stage(schedule: Schedule, s: int, run: _Run) -> list[_Event]:
    """Checks 1-3, 5, 6 on worker ``s`` in one pass; returns its transfers in order."""
    s_count, m_count = schedule.num_stages, schedule.num_microbatches
    v_count, jobs, u = schedule.num_chunks, schedule.num_jobs, schedule.update_every
    mode, recompute = schedule.weights, schedule.recompute
    last = s_count * v_count - 1
    n_steps = m_count // u
    per_step = v_count * u
    prev_w, next_w = (s - 1) % s_count, (s + 1) % s_count
    fwd: dict[tuple[int, int, int], tuple[int, int]] = {}  # (j, m, c) -> (index, version)
    bwd: dict[tuple[int, int, int], int] = {}
    rec: dict[tuple[int, int, int], int] = {}
    got_act: set[tuple[int, int, int]] = set()
    got_grad: set[tuple[int, int, int]] = set()
    seen: dict[tuple[type, int, int, int], int] = {}  # transfers on this worker
    steps = [0] * jobs
    group_done = [[0] * n_steps for _ in range(jobs)]
    events: list[_Event] = []
    sends, recvs = run.sends, run.recvs
    i = 0
    ins: Instruction

    def fail(why: str) -> ScheduleError:
        return _err(s, i, ins, why)

    def check_range(j: int, m: int, c: int) -> None:
        if not 0 <= j < jobs:
            raise fail(f"job {j} out of range (num_jobs={jobs})")
        if not 0 <= m < m_count:
            raise fail(f"micro-batch {m} out of range (num_microbatches={m_count})")
        if not 0 <= c < v_count:
            raise fail(f"chunk {c} out of range (num_chunks={v_count})")

    def check_transfer(j: int, m: int, c: int, peer: int, *, to_next: bool) -> int:
        """Range, duplicate and peer checks; returns the virtual stage of ``c``."""
        if not (0 <= j < jobs and 0 <= m < m_count and 0 <= c < v_count):
            check_range(j, m, c)
        tkey = (type(ins), j, m, c)
        if tkey in seen:
            raise fail(
                f"second {type(ins).__name__} of this micro-batch and chunk on this stage "
                f"(first at instruction {seen[tkey]})"
            )
        seen[tkey] = i
        g = c * s_count + s
        if to_next and g == last:
            raise fail(
                f"virtual stage {g} is the last one (it computes the loss): no {type(ins).__name__}"
            )
        if not to_next and g == 0:
            raise fail(f"virtual stage 0 reads the input: no {type(ins).__name__}")
        want = next_w if to_next else prev_w
        if peer != want:
            raise fail(
                f"peer must be stage {want}, which holds virtual stage {g + 1 if to_next else g - 1}"
            )
        return g

    for i, ins in enumerate(schedule.stages[s]):
        match ins:
            case Forward(j, m, c, v):
                if not (0 <= j < jobs and 0 <= m < m_count and 0 <= c < v_count):
                    check_range(j, m, c)
                key = (j, m, c)
                if key in fwd:
                    raise fail(
                        f"second Forward of this micro-batch and chunk on this stage (first at instruction {fwd[key][0]})"
                    )
                g = c * s_count + s
                if g > 0 and key not in got_act:
                    raise fail(
                        f"no earlier RecvActivation of its input (virtual stage {g} gets it from stage {prev_w})"
                    )
                done = steps[j]
                if mode == "sync":
                    if v != 0:
                        raise fail(
                            f"weights='sync' has one weight version, so version must be 0, not {v}"
                        )
                    if done != m // u:
                        raise fail(
                            f"weights='sync': micro-batch {m} belongs to flush {m // u + 1} "
                            f"(update_every={u}), so exactly {m // u} OptimizerStep(s) of job {j} "
                            f"must run before it on this stage, not {done}"
                        )
                elif mode == "stash":
                    if v != done:
                        raise fail(
                            f"weight stashing: a Forward uses the newest weights, version {done} "
                            f"({done} OptimizerStep(s) of job {j} ran before it on this stage), not {v}"
                        )
                elif mode == "vertical":
                    if v > done:
                        raise fail(
                            f"vertical sync: version {v} does not exist yet on this stage "
                            f"(only {done} OptimizerStep(s) of job {j} ran before it)"
                        )
                    if g == 0:
                        if v != done:
                            raise fail(
                                f"vertical sync: virtual stage 0 uses the newest weights, version {done} "
                                f"({done} OptimizerStep(s) of job {j} ran before it), not {v}"
                            )
                        run.first_versions[(j, m)] = v
                    elif (want := run.first_versions.get((j, m))) is None:
                        run.pending.append((s, i))  # stage 0 comes later in this list
                    elif v != want:
                        raise fail(_vertical_mismatch(v, want))
                else:
                    want = max(m // u - 1, 0)
                    if v != want:
                        raise fail(
                            f"PipeDream-2BW: micro-batch {m} uses version "
                            f"max({m} // update_every={u} - 1, 0) = {want}, not {v}"
                        )
                    if not done - 1 <= v <= done:
                        raise fail(_two_bw_live(v, done, j))
                fwd[key] = (i, v)
            case Backward(j, m, c, v):
                if not (0 <= j < jobs and 0 <= m < m_count and 0 <= c < v_count):
                    check_range(j, m, c)
                key = (j, m, c)
                if key in bwd:
                    raise fail(
                        f"second Backward of this micro-batch and chunk on this stage (first at instruction {bwd[key]})"
                    )
                f = fwd.get(key)
                if f is None:
                    raise fail("no earlier Forward of this micro-batch and chunk on this stage")
                g = c * s_count + s
                if g < last and key not in got_grad:
                    raise fail(
                        f"no earlier RecvGradient of its output gradient (virtual stage {g} gets it from stage {next_w})"
                    )
                if recompute and key not in rec:
                    raise fail(
                        f"recompute=True but no Recompute between its Forward (instruction {f[0]}) and it"
                    )
                if v != f[1]:
                    raise fail(
                        f"version {v} differs from version {f[1]} its Forward (instruction {f[0]}) used; "
                        "a Backward must use the weights of its Forward"
                    )
                done = steps[j]
                if mode == "2bw" and not done - 1 <= v <= done:
                    raise fail(_two_bw_live(v, done, j))
                grp = m // u
                if done < grp:
                    raise fail(
                        f"micro-batch {m} belongs to step {grp + 1} (update_every={u}) but only {done} "
                        f"OptimizerStep(s) of job {j} ran before it; OptimizerStep {grp} must come first"
                    )
                if done > grp:
                    raise fail(
                        f"comes after OptimizerStep {grp + 1} of job {j}, which must follow the "
                        f"Backwards of all micro-batches < {(grp + 1) * u}"
                    )
                group_done[j][grp] += 1
                bwd[key] = i
            case Recompute(j, m, c, v):
                if not recompute:
                    raise fail("the schedule has recompute=False, so it must not contain Recompute")
                if not (0 <= j < jobs and 0 <= m < m_count and 0 <= c < v_count):
                    check_range(j, m, c)
                key = (j, m, c)
                if key in rec:
                    raise fail(
                        f"second Recompute of this micro-batch and chunk on this stage (first at instruction {rec[key]})"
                    )
                f = fwd.get(key)
                if f is None:
                    raise fail("no earlier Forward of this micro-batch and chunk on this stage")
                if key in bwd:
                    raise fail(
                        f"comes after its Backward (instruction {bwd[key]}); it must sit between Forward and Backward"
                    )
                if v != f[1]:
                    raise fail(
                        f"version {v} differs from version {f[1]} its Forward (instruction {f[0]}) used"
                    )
                rec[key] = i
            case SendActivation(j, m, c, p):
                g = check_transfer(j, m, c, p, to_next=True)
                if (j, m, c) not in fwd:
                    raise fail("no earlier Forward of this micro-batch and chunk on this stage")
                sends[(_ACT, j, m, g + 1)] = (s, i)
                events.append((False, (_ACT, j, m, g + 1), i))
            case RecvActivation(j, m, c, p):
                g = check_transfer(j, m, c, p, to_next=False)
                got_act.add((j, m, c))
                recvs[(_ACT, j, m, g)] = (s, i)
                events.append((True, (_ACT, j, m, g), i))
            case SendGradient(j, m, c, p):
                g = check_transfer(j, m, c, p, to_next=False)
                if (j, m, c) not in bwd:
                    raise fail("no earlier Backward of this micro-batch and chunk on this stage")
                sends[(_GRAD, j, m, g - 1)] = (s, i)
                events.append((False, (_GRAD, j, m, g - 1), i))
            case RecvGradient(j, m, c, p):
                g = check_transfer(j, m, c, p, to_next=True)
                got_grad.add((j, m, c))
                recvs[(_GRAD, j, m, g)] = (s, i)
                events.append((True, (_GRAD, j, m, g), i))
            case OptimizerStep(j):
                if not 0 <= j < jobs:
                    raise fail(f"job {j} out of range (num_jobs={jobs})")
                k = steps[j] + 1
                if k > n_steps:
                    raise fail(
                        f"OptimizerStep {k} of job {j}, but there must be exactly "
                        f"num_microbatches // update_every = {n_steps}"
                    )
                if group_done[j][k - 1] != per_step:
                    raise fail(
                        f"OptimizerStep {k} of job {j} must follow the Backwards of all micro-batches "
                        f"< {k * u} on this stage; only {group_done[j][k - 1]} of the {per_step} "
                        f"Backwards of micro-batches [{(k - 1) * u}, {k * u}) ran before it"
                    )
                steps[j] = k
            case _:
                raise fail("not a schedule instruction")

    # Completeness: every (job, mb, chunk) forwarded and backwarded exactly once here.
    expected = jobs * m_count * v_count
    if len(bwd) != expected:
        for key, (i, _v) in fwd.items():
            if key not in bwd:
                raise _err(
                    s,
                    i,
                    schedule.stages[s][i],
                    "never backwarded: no Backward of this micro-batch and chunk follows on this stage",
                )
        for j in range(jobs):
            for m in range(m_count):
                for c in range(v_count):
                    if (j, m, c) not in fwd:
                        raise ScheduleError(
                            f"stage {s}: no Forward or Backward of job {j}, micro-batch {m}, chunk {c} "
                            f"(virtual stage {c * s_count + s}); every micro-batch must pass through "
                            "every virtual stage"
                        )
    for j in range(jobs):
        if steps[j] != n_steps:
            raise ScheduleError(
                f"stage {s}: {steps[j]} OptimizerStep(s) of job {j}, but there must be exactly "
                f"num_microbatches // update_every = {m_count} // {u} = {n_steps}"
            )
    return events


def _two_bw_live(v: int, done: int, job: int) -> str:
    return (
        f"PipeDream-2BW keeps two weight versions: after {done} OptimizerStep(s) of job {job} on this "
        f"stage only versions {max(done - 1, 0)} and {done} are live, not {v}"
    )


def _vertical_mismatch(v: int, want: int) -> str:
    return (
        "vertical sync: every stage uses the version virtual stage 0 used for this "
        f"micro-batch ({want}), not {v}"
    )


def _check_vertical(schedule: Schedule, run: _Run) -> None:
    first = run.first_versions
    for s, i in run.pending:
        ins = schedule.stages[s][i]
        assert isinstance(ins, Forward)
        want = first[(ins.job, ins.microbatch)]
        if ins.version != want:
            raise _err(s, i, ins, _vertical_mismatch(ins.version, want))


def _check_pairs(schedule: Schedule, run: _Run) -> None:
    sends, recvs = run.sends, run.recvs
    if sends.keys() == recvs.keys():
        return
    names = (("SendActivation", "RecvActivation"), ("SendGradient", "RecvGradient"))
    for key, (s, i) in recvs.items():
        if key not in sends:
            p = schedule.stages[s][i]
            peer = getattr(p, "peer", -1)
            raise _err(
                s,
                i,
                p,
                f"stage {peer} never sends this (no matching {names[key[0]][0]} there), so this receive would block forever",
            )
    for key, (s, i) in sends.items():
        if key not in recvs:
            p = schedule.stages[s][i]
            peer = getattr(p, "peer", -1)
            raise _err(
                s, i, p, f"stage {peer} never receives this (no matching {names[key[0]][1]} there)"
            )


def _check_deadlock(schedule: Schedule, events: list[list[_Event]]) -> None:
    """Run the transfers with buffered sends and blocking receives (event driven)."""
    s_count = schedule.num_stages
    pos = [0] * s_count
    arrived: set[_Key] = set()
    waiting: dict[_Key, int] = {}
    ready = deque(range(s_count))
    while ready:
        s = ready.popleft()
        ev = events[s]
        p, n = pos[s], len(ev)
        while p < n:
            is_recv, key, _i = ev[p]
            if is_recv:
                if key not in arrived:
                    waiting[key] = s
                    break
            else:
                arrived.add(key)
                w = waiting.pop(key, None)
                if w is not None:
                    ready.append(w)
            p += 1
        pos[s] = p
    blocked = [s for s in range(s_count) if pos[s] < len(events[s])]
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
    run = _Run()
    events = [_check_stage(schedule, s, run) for s in range(schedule.num_stages)]
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
