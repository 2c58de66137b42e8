"""Schedule generators: every schedule validates, has the right shape, orders and versions."""

from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptipe.errors import PlanError
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

FAST = settings(max_examples=120, deadline=None)


@st.composite
def schedules(draw: st.DrawFn, names: tuple[str, ...] = SCHEDULE_NAMES) -> Schedule:
    """Any generator's schedule with S in 1..8 and M in 1..24 (their constraints obeyed)."""
    name = draw(st.sampled_from(names))
    recompute = draw(st.booleans())
    kw: dict[str, Any] = {"recompute": recompute}
    if name == "interleaved":
        s = draw(st.integers(2, 8))
        kw["chunks"] = draw(st.integers(2, 4))
        m = s * draw(st.integers(1, 24 // s))
    elif name == "2bw":
        s = draw(st.integers(1, 8))
        every = draw(st.one_of(st.none(), st.integers(s, 24)))
        kw["update_every"] = every
        m = (every or s) * draw(st.integers(1, 24 // (every or s)))
    else:
        s = draw(st.integers(1, 8))
        m = draw(st.integers(1, 24))
        if name == "pipedream":
            kw["vertical_sync"] = draw(st.booleans())
    return build_schedule(name, stages=s, microbatches=m, **kw)


def compute_order(stage: tuple[Instruction, ...]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for ins in stage:
        match ins:
            case Forward(microbatch=m):
                out.append(("F", m))
            case Backward(microbatch=m):
                out.append(("B", m))
            case _:
                pass
    return out


def makespan(schedule: Schedule) -> Fraction:
    """Finish time with forward 1/V, backward 2/V per chunk and free, buffered messages."""
    s_count, v_count = schedule.num_stages, schedule.num_chunks
    pos = [0] * s_count
    clock = [Fraction(0)] * s_count
    arrived: dict[tuple[str, int, int], Fraction] = {}
    moved = True
    while moved:
        moved = False
        for s in range(s_count):
            stage = schedule.stages[s]
            while pos[s] < len(stage):
                ins = stage[pos[s]]
                match ins:
                    case Forward():
                        clock[s] += Fraction(1, v_count)
                    case Backward():
                        clock[s] += Fraction(2, v_count)
                    case SendActivation(microbatch=m, chunk=c):
                        arrived[("A", m, c * s_count + s + 1)] = clock[s]
                    case SendGradient(microbatch=m, chunk=c):
                        arrived[("G", m, c * s_count + s - 1)] = clock[s]
                    case (
                        RecvActivation(microbatch=m, chunk=c) | RecvGradient(microbatch=m, chunk=c)
                    ):
                        key = ("A" if isinstance(ins, RecvActivation) else "G", m, c * s_count + s)
                        if key not in arrived:
                            break
                        clock[s] = max(clock[s], arrived[key])
                    case _:
                        pass
                pos[s] += 1
                moved = True
    assert all(pos[s] == len(schedule.stages[s]) for s in range(s_count))
    return max(clock)


# ---------------------------------------------------------------- every schedule validates


@FAST
@given(schedules())
def test_every_generated_schedule_validates(schedule: Schedule) -> None:
    validate(schedule)


@FAST
@given(schedules())
def test_instruction_counts(schedule: Schedule) -> None:
    s_count, m, v = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    for s, stage in enumerate(schedule.stages):
        counts = Counter(type(ins) for ins in stage)
        first, last = s == 0, s == s_count - 1
        assert counts[Forward] == m * v
        assert counts[Backward] == m * v
        assert counts[Recompute] == (m * v if schedule.recompute else 0)
        assert counts[RecvActivation] == m * (v - first)
        assert counts[SendGradient] == m * (v - first)
        assert counts[SendActivation] == m * (v - last)
        assert counts[RecvGradient] == m * (v - last)
        assert counts[OptimizerStep] == m // schedule.update_every
        assert len(stage) == sum(counts.values())


@FAST
@given(schedules(("gpipe", "1f1b", "pipedream", "2bw")))
def test_in_flight(schedule: Schedule) -> None:
    s_count, m = schedule.num_stages, schedule.num_microbatches
    if schedule.name == "gpipe":
        assert in_flight(schedule) == [m] * s_count
    else:
        assert in_flight(schedule) == [min(s_count - s, m) for s in range(s_count)]


@FAST
@given(schedules(("interleaved",)))
def test_interleaved_in_flight_is_warmup_plus_one(schedule: Schedule) -> None:
    total = schedule.num_microbatches * schedule.num_chunks
    assert in_flight(schedule) == [min(w + 1, total) for w in schedule.meta["warmup"]]


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_bubble_ratio(stages: int, chunks: int) -> None:
    """Uniform chunks: bubble (S - 1) / (V * M + S - 1) (ch. 4 §4.2.2)."""
    for m in range(stages, 3 * stages + 1, stages):
        schedule = one_f_one_b(stages, m) if chunks == 1 else interleaved(stages, m, chunks)
        total = makespan(schedule)
        assert (total - 3 * m) / total == Fraction(stages - 1, chunks * m + stages - 1)
        if chunks == 1:  # GPipe has the same bubble as 1F1B, with M in flight instead
            assert makespan(gpipe(stages, m)) == total


# ---------------------------------------------------------------- weight versions


def test_pipedream_stash_versions_by_rule() -> None:
    for s_count in range(1, 9):
        for m_count in (1, s_count, 3 * s_count + 1):
            schedule = pipedream(s_count, m_count)
            assert schedule.weights == "stash" and schedule.update_every == 1
            assert schedule.meta["in_flight"] == s_count
            for s, stage in enumerate(schedule.stages):
                done = 0
                fwd: dict[int, int] = {}
                for ins in stage:
                    match ins:
                        case OptimizerStep():
                            done += 1
                        case Forward(microbatch=m, version=v):
                            assert v == done == max(m - (s_count - s - 1), 0)
                            fwd[m] = v
                        case Backward(microbatch=m, version=v) | Recompute(microbatch=m, version=v):
                            assert v == fwd[m]
                        case _:
                            pass


@FAST
@given(st.integers(1, 8), st.integers(1, 24), st.booleans())
def test_pipedream_vertical_sync_same_version_everywhere(
    s_count: int, m_count: int, rc: bool
) -> None:
    schedule = pipedream(s_count, m_count, vertical_sync=True, recompute=rc)
    assert schedule.weights == "vertical"
    for stage in schedule.stages:
        for ins in stage:
            if isinstance(ins, Forward | Backward | Recompute):
                assert ins.version == max(ins.microbatch - s_count + 1, 0)


@FAST
@given(schedules(("2bw",)))
def test_two_bw_at_most_two_live_versions(schedule: Schedule) -> None:
    every = schedule.update_every
    assert every >= schedule.num_stages
    for stage in schedule.stages:
        done = 0
        live: dict[int, int] = {}  # in-flight micro-batch -> version
        for ins in stage:
            match ins:
                case OptimizerStep():
                    done += 1
                case Forward(microbatch=m, version=v):
                    assert v == max(m // every - 1, 0)
                    live[m] = v
                case Backward(microbatch=m, version=v):
                    assert v == live.pop(m)
                case _:
                    pass
            assert len({done, *live.values()}) <= 2


def test_two_bw_versions_and_steps_small_case() -> None:
    schedule = two_bw(2, 8, update_every=2)
    stage = schedule.stages[0]
    fwd = [(i.microbatch, i.version) for i in stage if isinstance(i, Forward)]
    assert fwd == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 2), (7, 2)]
    # A step right after the backward of micro-batches 1, 3, 5, 7.
    before_step = [stage[i - 1] for i, ins in enumerate(stage) if isinstance(ins, OptimizerStep)]
    assert [ins.microbatch for ins in before_step if isinstance(ins, Backward)] == [1, 3, 5, 7]


# ---------------------------------------------------------------- exact orders


def test_gpipe_exact_order() -> None:
    schedule = gpipe(2, 2)
    assert schedule.stages[0] == (
        Forward(0, 0),
        SendActivation(0, 0, 0, 1),
        Forward(0, 1),
        SendActivation(0, 1, 0, 1),
        RecvGradient(0, 0, 0, 1),
        Backward(0, 0),
        RecvGradient(0, 1, 0, 1),
        Backward(0, 1),
        OptimizerStep(0),
    )
    assert schedule.stages[1] == (
        RecvActivation(0, 0, 0, 0),
        Forward(0, 0),
        RecvActivation(0, 1, 0, 0),
        Forward(0, 1),
        Backward(0, 0),
        SendGradient(0, 0, 0, 0),
        Backward(0, 1),
        SendGradient(0, 1, 0, 0),
        OptimizerStep(0),
    )


def test_one_f_one_b_exact_order() -> None:
    schedule = one_f_one_b(4, 8)
    f, b = "F", "B"
    assert compute_order(schedule.stages[0]) == [
        (f, 0), (f, 1), (f, 2), (f, 3), (b, 0), (f, 4), (b, 1), (f, 5),
        (b, 2), (f, 6), (b, 3), (f, 7), (b, 4), (b, 5), (b, 6), (b, 7),
    ]  # fmt: skip
    assert compute_order(schedule.stages[3]) == [x for m in range(8) for x in ((f, m), (b, m))]
    assert schedule.meta["warmup"] == [3, 2, 1, 0]
    assert isinstance(schedule.stages[0][-1], OptimizerStep)


def test_one_f_one_b_with_recompute_places_recompute_after_recv() -> None:
    stage = one_f_one_b(2, 1, recompute=True).stages[0]
    assert stage == (
        Forward(0, 0),
        SendActivation(0, 0, 0, 1),
        RecvGradient(0, 0, 0, 1),
        Recompute(0, 0),
        Backward(0, 0),
        OptimizerStep(0),
    )


def test_interleaved_exact_order() -> None:
    schedule = interleaved(2, 4, 2)
    order = [
        ("F" if isinstance(i, Forward) else "B", i.microbatch, i.chunk)
        for i in schedule.stages[0]
        if isinstance(i, Forward | Backward)
    ]
    assert order == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
        ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1),
        ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0),
        ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0),
    ]  # fmt: skip
    assert schedule.meta["warmup"] == [4, 2]
    # Chunk 1 of worker 0 is virtual stage 2: receives from worker 1, the last stage is 3.
    assert RecvActivation(0, 0, 1, 1) in schedule.stages[0]
    assert SendActivation(0, 0, 1, 1) in schedule.stages[0]
    assert not any(isinstance(i, RecvActivation) and i.chunk == 0 for i in schedule.stages[0])


def test_pipedream_exact_order() -> None:
    stage = pipedream(2, 4).stages[0]
    compute = [
        (type(i).__name__[0], getattr(i, "microbatch", None), getattr(i, "version", None))
        for i in stage
        if isinstance(i, Forward | Backward | OptimizerStep)
    ]
    assert compute == [
        ("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("O", None, None),
        ("F", 2, 1), ("B", 1, 0), ("O", None, None),
        ("F", 3, 2), ("B", 2, 1), ("O", None, None),
        ("B", 3, 2), ("O", None, None),
    ]  # fmt: skip


# ---------------------------------------------------------------- JSON


@FAST
@given(schedules())
def test_json_round_trip(schedule: Schedule) -> None:
    data = json.loads(json.dumps(schedule.to_json()))
    assert Schedule.from_json(data) == schedule


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("call", "needles"),
    [
        (
            lambda: build_schedule("zigzag", stages=2, microbatches=2),
            ["gpipe", "1f1b", "2bw", "zigzag"],
        ),
        (lambda: build_schedule("gpipe", stages=0, microbatches=2), ["stages", ">= 1"]),
        (lambda: build_schedule("1f1b", stages=2, microbatches=0), ["microbatches", ">= 1"]),
        (lambda: build_schedule("1f1b", stages=True, microbatches=2), ["stages", "integer"]),
        (
            lambda: build_schedule("1f1b", stages=2, microbatches=2, chunks=2),
            ["chunks=2", "interleaved"],
        ),
        (
            lambda: build_schedule("gpipe", stages=2, microbatches=2, vertical_sync=True),
            ["pipedream"],
        ),
        (lambda: build_schedule("1f1b", stages=2, microbatches=2, update_every=2), ["2bw"]),
        (lambda: build_schedule("interleaved", stages=4, microbatches=8), ["chunks >= 2"]),
        (lambda: interleaved(4, 6, 2), ["multiple of stages", "M=6", "S=4"]),
        (lambda: interleaved(1, 4, 2), ["stages >= 2"]),
        (lambda: interleaved(4, 8, 1), ["chunks >= 2"]),
        (lambda: two_bw(4, 8, update_every=2), ["update_every >= stages", "update_every=2", "S=4"]),
        (lambda: two_bw(4, 10), ["multiple of update_every", "M=10", "update_every=4"]),
        (lambda: gpipe(2, -1), ["microbatches", ">= 1"]),
        (lambda: pipedream(0, 3), ["stages", ">= 1"]),
    ],
)
def test_bad_arguments(call: Any, needles: list[str]) -> None:
    with pytest.raises(PlanError) as info:
        call()
    for needle in needles:
        assert needle in str(info.value)


def test_build_schedule_dispatch() -> None:
    assert build_schedule("gpipe", stages=3, microbatches=4) == gpipe(3, 4)
    assert build_schedule("1f1b", stages=3, microbatches=4, recompute=True) == one_f_one_b(
        3, 4, recompute=True
    )
    assert build_schedule("interleaved", stages=2, microbatches=4, chunks=3) == interleaved(2, 4, 3)
    assert build_schedule("pipedream", stages=3, microbatches=5, vertical_sync=True) == pipedream(
        3, 5, vertical_sync=True
    )
    assert build_schedule("2bw", stages=2, microbatches=6, update_every=3) == two_bw(
        2, 6, update_every=3
    )
    assert {
        build_schedule(n, stages=2, microbatches=4, chunks=2 if n == "interleaved" else 1).name
        for n in SCHEDULE_NAMES
    } == set(SCHEDULE_NAMES)
