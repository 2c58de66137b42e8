"""`validate`: mutations of valid schedules are caught, with the right stage and reason."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from adaptipe.errors import ScheduleError
from adaptipe.schedule.build import SCHEDULE_NAMES, build_schedule
from adaptipe.schedule.gpipe import gpipe
from adaptipe.schedule.interleaved import interleaved
from adaptipe.schedule.onefoneb import one_f_one_b
from adaptipe.schedule.pipedream import pipedream
from adaptipe.schedule.twobw import two_bw
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
from adaptipe.schedule.validate import in_flight, validate

FAST = settings(max_examples=150, deadline=None)
TRANSFERS = (SendActivation, RecvActivation, SendGradient, RecvGradient)


@st.composite
def schedules(
    draw: st.DrawFn, names: tuple[str, ...] = SCHEDULE_NAMES, min_stages: int = 1
) -> Schedule:
    """A small valid schedule from any generator (S in 1..6, M in 1..12)."""
    name = draw(st.sampled_from(names))
    recompute = draw(st.booleans())
    kw: dict[str, Any] = {"recompute": recompute}
    if name == "interleaved":
        s = draw(st.integers(max(2, min_stages), 4))
        kw["chunks"] = draw(st.integers(2, 3))
        m = s * draw(st.integers(1, 12 // s))
    elif name == "2bw":
        s = draw(st.integers(min_stages, 6))
        every = draw(st.integers(s, 12))
        kw["update_every"] = every
        m = every * draw(st.integers(1, 12 // every))
    else:
        s = draw(st.integers(min_stages, 6))
        m = draw(st.integers(1, 12))
        if name == "pipedream":
            kw["vertical_sync"] = draw(st.booleans())
    return build_schedule(name, stages=s, microbatches=m, **kw)


def with_stage(schedule: Schedule, s: int, stage: list[Instruction]) -> Schedule:
    stages = list(schedule.stages)
    stages[s] = tuple(stage)
    return dataclasses.replace(schedule, stages=tuple(stages))


def error_of(schedule: Schedule) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    return str(info.value)


def names_stage(message: str, s: int) -> bool:
    return re.search(rf"\bstage {s}\b", message) is not None


def pick(
    data: st.DataObject, schedule: Schedule, kinds: tuple[type, ...] | None = None
) -> tuple[int, int]:
    """A (stage, index) of an instruction of one of ``kinds`` (any when None)."""
    spots = [
        (s, i)
        for s, stage in enumerate(schedule.stages)
        for i, ins in enumerate(stage)
        if kinds is None or isinstance(ins, kinds)
    ]
    assume(spots)
    return data.draw(st.sampled_from(spots))


def find(stage: tuple[Instruction, ...], cls: type[Any], ins: Any) -> int:
    """Index of the ``cls`` instruction of the same job / micro-batch / chunk as ``ins``."""
    want = (cls, ins.job, ins.microbatch, ins.chunk)
    for i, other in enumerate(stage):
        if (
            type(other),
            other.job,
            *(getattr(other, "microbatch", -1), getattr(other, "chunk", -1)),
        ) == want:
            return i
    raise AssertionError(f"no {cls.__name__} for {ins}")


# ---------------------------------------------------------------- mutations


@FAST
@given(schedules(), st.data())
def test_drop_any_instruction(schedule: Schedule, data: st.DataObject) -> None:
    s, i = pick(data, schedule)
    dropped = schedule.stages[s][i]
    stage = list(schedule.stages[s])
    del stage[i]
    message = error_of(with_stage(schedule, s, stage))
    assert names_stage(message, s), message
    assert type(dropped).__name__ in message, message


@FAST
@given(schedules(), st.data())
def test_duplicate_any_instruction(schedule: Schedule, data: st.DataObject) -> None:
    s, i = pick(data, schedule)
    copy = schedule.stages[s][i]
    stage = list(schedule.stages[s])
    stage.insert(data.draw(st.integers(i + 1, len(stage))), copy)
    message = error_of(with_stage(schedule, s, stage))
    assert names_stage(message, s), message
    assert type(copy).__name__ in message, message
    if not isinstance(copy, OptimizerStep):
        assert "second" in message, message


@FAST
@given(schedules(), st.data())
def test_forward_moved_after_its_backward(schedule: Schedule, data: st.DataObject) -> None:
    s, i = pick(data, schedule, (Forward,))
    stage = list(schedule.stages[s])
    fwd = stage[i]
    b = find(schedule.stages[s], Backward, fwd)
    stage.insert(b + 1, fwd)
    del stage[i]
    message = error_of(with_stage(schedule, s, stage))
    assert names_stage(message, s), message
    assert "no earlier Forward" in message, message


@FAST
@given(schedules(min_stages=2), st.data())
def test_recv_activation_moved_after_its_forward(schedule: Schedule, data: st.DataObject) -> None:
    s, i = pick(data, schedule, (RecvActivation,))
    stage = list(schedule.stages[s])
    recv = stage[i]
    f = find(schedule.stages[s], Forward, recv)
    stage.insert(f + 1, recv)
    del stage[i]
    message = error_of(with_stage(schedule, s, stage))
    assert names_stage(message, s), message
    assert "no earlier RecvActivation" in message, message


@FAST
@given(schedules(min_stages=2), st.data())
def test_changed_peer(schedule: Schedule, data: st.DataObject) -> None:
    s, i = pick(data, schedule, TRANSFERS)
    ins = schedule.stages[s][i]
    assert isinstance(ins, TRANSFERS)
    peer = data.draw(st.integers(0, schedule.num_stages - 1).filter(lambda p: p != ins.peer))
    stage = list(schedule.stages[s])
    stage[i] = dataclasses.replace(ins, peer=peer)
    message = error_of(with_stage(schedule, s, stage))
    assert names_stage(message, s), message
    assert f"peer must be stage {ins.peer}" in message, message


@FAST
@given(schedules(), st.data())
def test_changed_version(schedule: Schedule, data: st.DataObject) -> None:
    s, i = pick(data, schedule, (Forward, Backward, Recompute))
    ins = schedule.stages[s][i]
    assert isinstance(ins, Forward | Backward | Recompute)
    version = data.draw(st.integers(0, ins.version + 3).filter(lambda v: v != ins.version))
    stage = list(schedule.stages[s])
    stage[i] = dataclasses.replace(ins, version=version)
    message = error_of(with_stage(schedule, s, stage))
    assert names_stage(message, s), message
    assert "version" in message, message


@FAST
@given(schedules(("pipedream", "2bw")), st.data())
def test_changed_forward_version_in_stash_and_2bw(schedule: Schedule, data: st.DataObject) -> None:
    s, i = pick(data, schedule, (Forward,))
    ins = schedule.stages[s][i]
    assert isinstance(ins, Forward)
    stage = list(schedule.stages[s])
    stage[i] = dataclasses.replace(ins, version=ins.version + 1)
    message = error_of(with_stage(schedule, s, stage))
    assert message.startswith(f"stage {s}, instruction {i} Forward("), message
    reason = {"stash": "weight stashing", "vertical": "vertical sync", "2bw": "PipeDream-2BW"}
    assert reason[schedule.weights] in message, message


@FAST
@given(schedules(), st.data())
def test_removed_optimizer_step(schedule: Schedule, data: st.DataObject) -> None:
    s, i = pick(data, schedule, (OptimizerStep,))
    stage = list(schedule.stages[s])
    del stage[i]
    message = error_of(with_stage(schedule, s, stage))
    assert names_stage(message, s), message
    assert "OptimizerStep" in message, message


@FAST
@given(schedules(), st.data())
def test_optimizer_step_moved_too_early(schedule: Schedule, data: st.DataObject) -> None:
    s, i = pick(data, schedule, (OptimizerStep,))
    stage = list(schedule.stages[s])
    # Move the step before the Backward right before it (always one of its micro-batches).
    b = max(k for k in range(i) if isinstance(stage[k], Backward))
    step = stage.pop(i)
    stage.insert(b, step)
    message = error_of(with_stage(schedule, s, stage))
    assert message.startswith(f"stage {s}, instruction {b} OptimizerStep(job=0)"), message
    assert "must follow the Backwards" in message, message


@FAST
@given(schedules(min_stages=2), st.data())
def test_recv_gradient_hoisted_makes_cyclic_wait(schedule: Schedule, data: st.DataObject) -> None:
    """Waiting for a gradient before sending the activation it depends on: a cycle."""
    s, i = pick(data, schedule, (RecvGradient,))
    stage = list(schedule.stages[s])
    stage.insert(0, stage.pop(i))
    message = error_of(with_stage(schedule, s, stage))
    assert message.startswith("deadlock"), message
    assert f"stage {s}, instruction 0 RecvGradient(" in message, message


def test_two_worker_cycle_names_both_waits() -> None:
    schedule = one_f_one_b(2, 2)
    # Worker 1 waits for micro-batch 1 before micro-batch 0 is done; worker 0 only sends
    # micro-batch 1 after receiving micro-batch 0's gradient: a cycle through both.
    w0 = list(schedule.stages[0])
    w1 = list(schedule.stages[1])
    assert w1[:4] == [
        RecvActivation(0, 0, 0, 0),
        Forward(0, 0),
        Backward(0, 0),
        SendGradient(0, 0, 0, 0),
    ]
    w0 = [
        Forward(0, 0),
        SendActivation(0, 0, 0, 1),
        RecvGradient(0, 0, 0, 1),
        Backward(0, 0),
        Forward(0, 1),
        SendActivation(0, 1, 0, 1),
        RecvGradient(0, 1, 0, 1),
        Backward(0, 1),
        OptimizerStep(0),
    ]
    w1 = [
        RecvActivation(0, 0, 0, 0),
        RecvActivation(0, 1, 0, 0),
        *[x for x in w1 if x != RecvActivation(0, 1, 0, 0)][1:],
    ]
    bad = dataclasses.replace(schedule, stages=(tuple(w0), tuple(w1)))
    message = error_of(bad)
    assert message.startswith("deadlock"), message
    assert (
        "stage 0, instruction 2 RecvGradient(job=0, microbatch=0, chunk=0, peer=1) waits for stage 1"
        in message
    )
    assert (
        "stage 1, instruction 1 RecvActivation(job=0, microbatch=1, chunk=0, peer=0) waits for stage 0"
        in message
    )


# ---------------------------------------------------------------- exact messages, structure


def test_message_names_stage_instruction_and_reason() -> None:
    schedule = gpipe(3, 4)
    stage = list(schedule.stages[2])
    f = stage.index(Forward(0, 3))
    del stage[f]
    stage.insert(stage.index(Backward(0, 3)) + 1, Forward(0, 3))
    message = error_of(with_stage(schedule, 2, stage))
    i = stage.index(Backward(0, 3))
    assert message == (
        f"stage 2, instruction {i} Backward(job=0, microbatch=3, chunk=0, version=0): "
        "no earlier Forward of this micro-batch and chunk on this stage"
    )


def test_missing_send_names_both_stages() -> None:
    schedule = one_f_one_b(3, 2)
    stage = [x for x in schedule.stages[1] if x != SendActivation(0, 1, 0, 2)]
    message = error_of(with_stage(schedule, 1, stage))
    assert message.startswith("stage 2, instruction ")
    assert "RecvActivation(job=0, microbatch=1, chunk=0, peer=1)" in message
    assert "stage 1 never sends this" in message


def test_recompute_forbidden_without_recompute() -> None:
    schedule = one_f_one_b(2, 2)
    stage = list(schedule.stages[1])
    stage.insert(stage.index(Backward(0, 0)), Recompute(0, 0))
    assert "recompute=False" in error_of(with_stage(schedule, 1, stage))


def test_interleaved_peer_wraps_around() -> None:
    schedule = interleaved(2, 2, 2)
    validate(schedule)
    # Worker 0 chunk 1 is virtual stage 2: its input comes from worker 1 (virtual stage 1).
    stage = list(schedule.stages[0])
    i = stage.index(RecvActivation(0, 0, 1, 1))
    stage[i] = RecvActivation(0, 0, 1, 0)
    assert "peer must be stage 1, which holds virtual stage 1" in error_of(
        with_stage(schedule, 0, stage)
    )


def test_chunk_and_microbatch_out_of_range() -> None:
    schedule = gpipe(1, 2)
    stage = list(schedule.stages[0])
    stage[0] = Forward(0, 5)
    assert "micro-batch 5 out of range (num_microbatches=2)" in error_of(
        with_stage(schedule, 0, stage)
    )
    stage[0] = Forward(0, 0, 1)
    assert "chunk 1 out of range (num_chunks=1)" in error_of(with_stage(schedule, 0, stage))
    stage[0] = Forward(3, 0)
    assert "job 3 out of range (num_jobs=1)" in error_of(with_stage(schedule, 0, stage))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"num_stages": 3}, "num_stages=3"),
        ({"update_every": 1}, "weights='sync'"),
        ({"update_every": 3}, "multiple of update_every=3"),
        ({"weights": "stash"}, "update_every must be 1"),
        ({"weights": "2bw", "update_every": 1}, "update_every >= num_stages=2"),
    ],
)
def test_header_errors(change: dict[str, Any], needle: str) -> None:
    schedule = dataclasses.replace(one_f_one_b(2, 4), **change)
    assert needle in error_of(schedule)


def test_chunks_need_two_stages() -> None:
    schedule = dataclasses.replace(gpipe(1, 2), num_chunks=2)
    assert "num_chunks=2 > 1 needs num_stages >= 2" in error_of(schedule)


def test_missing_micro_batch_everywhere() -> None:
    schedule = gpipe(2, 3)
    stages = tuple(
        tuple(x for x in stage if getattr(x, "microbatch", None) != 2) for stage in schedule.stages
    )
    message = error_of(dataclasses.replace(schedule, stages=stages))
    assert message.startswith("stage 0, instruction ")
    assert "OptimizerStep 1 of job 0 must follow the Backwards of all micro-batches < 3" in message
    # A job missing altogether (no step to trip over first).
    message = error_of(dataclasses.replace(schedule, num_jobs=2))
    assert message.startswith("stage 0: no Forward or Backward of job 1, micro-batch 0, chunk 0")


def test_vertical_sync_version_must_match_stage_zero() -> None:
    schedule = pipedream(3, 6, vertical_sync=True)
    validate(schedule)
    # Stage-local stashing on worker 2 is valid PipeDream but not vertical sync.
    stash = pipedream(3, 6)
    bad = dataclasses.replace(schedule, stages=(*schedule.stages[:2], stash.stages[2]))
    message = error_of(bad)
    assert message.startswith("stage 2, instruction ")
    assert "vertical sync" in message


def test_two_bw_third_live_version_rejected() -> None:
    """A 2BW schedule with update_every < S would need three versions."""
    schedule = two_bw(4, 8, update_every=4)
    forged = dataclasses.replace(schedule, update_every=2)
    with pytest.raises(ScheduleError):
        validate(forged)


def test_json_with_bad_schedule_is_rejected() -> None:
    data = one_f_one_b(2, 2).to_json()
    data["stages"][0].pop(0)
    with pytest.raises(ScheduleError):
        Schedule.from_json(data)


# ---------------------------------------------------------------- in_flight, speed


def test_in_flight_counts_chunks() -> None:
    assert in_flight(gpipe(2, 5)) == [5, 5]
    assert in_flight(one_f_one_b(4, 2)) == [2, 2, 2, 1]
    schedule = interleaved(4, 8, 2)
    assert in_flight(schedule) == [w + 1 for w in schedule.meta["warmup"]]


def test_all_schedules_validate_at_size() -> None:
    for schedule in (
        gpipe(8, 64),
        one_f_one_b(8, 64, recompute=True),
        pipedream(8, 64),
        pipedream(8, 64, vertical_sync=True),
        two_bw(8, 64),
        two_bw(8, 64, update_every=16),
        interleaved(8, 64, 4),
    ):
        validate(schedule)
