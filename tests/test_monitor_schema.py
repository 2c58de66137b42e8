"""Telemetry records round-trip, and decode turns every bad frame into a TelemetryError."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptipe.monitor.schema import (
    MAX_FRAME_BYTES,
    REASONS,
    SCHEMA_VERSION,
    DeviceSample,
    Event,
    LinkSample,
    Record,
    StageStats,
    TelemetryError,
    decode,
)

STATS = StageStats(
    run_id="run-1",
    stage=2,
    iteration=7,
    time_s=1.7e9,
    first_layer=4,
    forward_s=(0.01, 0.02),
    backward_s=(0.02, 0.04),
    compute_s=0.09,
    wait_s=0.01,
    comm_s=0.002,
    iteration_s=0.11,
    in_flight=3,
    memory_allocated_bytes=1 << 30,
    memory_reserved_bytes=2 << 30,
    loss=2.5,
)
RECORDS: list[Record] = [
    STATS,
    DeviceSample(stage=0, time_s=1.7e9, source="cpu", fields={"util_pct": 50, "run_queue": 2}),
    DeviceSample(stage=1, time_s=1.7e9, source="nvml", fields={"temperature_c": 61.0}),
    LinkSample(src=0, dst=1, time_s=1.7e9, nbytes=4096, seconds=1e-4, bandwidth_Bps=4.1e7),
    Event(kind="injection-start", time_s=1.7e9, stage=1, detail={"what": "cpu-hog", "x": 2}),
    Event(kind="checkpoint", time_s=1.7e9),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.TYPE)
def test_records_round_trip_through_msgpack_and_json(record: Record) -> None:
    assert decode(record.to_wire()) == record
    assert type(record).from_wire(record.to_wire()) == record
    assert decode(json.dumps(record.to_dict()).encode()) == record
    assert record.to_dict()["v"] == SCHEMA_VERSION


def test_from_wire_refuses_another_record_type() -> None:
    with pytest.raises(TelemetryError) as info:
        Event.from_wire(STATS.to_wire())
    assert info.value.reason == "unknown-type"


def test_largest_valid_records_fit_in_a_frame() -> None:
    layers = (1e6,) * 2048
    big = StageStats(
        run_id="r" * 128,
        stage=65535,
        iteration=2**53,
        time_s=1e11,
        forward_s=layers,
        backward_s=layers,
        compute_s=1e7,
        wait_s=1e7,
        comm_s=1e7,
        iteration_s=1e7,
        loss=-1e300,
    )
    fields = {f"f{i:02d}_" + "x" * 59: 1e300 for i in range(128)}
    sample = DeviceSample(stage=1, time_s=1.0, source="nvml", fields=fields)
    detail = {f"k{i:02d}" + "y" * 61: "z" * 512 for i in range(64)}
    event = Event(kind="e" * 64, time_s=1.0, stage=3, detail=detail)
    for record in (big, sample, event):
        assert len(record.to_wire()) <= MAX_FRAME_BYTES
        assert len(json.dumps(record.to_dict()).encode()) <= MAX_FRAME_BYTES
        assert decode(record.to_wire()) == record


def test_construction_checks_values_where_they_are_made() -> None:
    with pytest.raises(TelemetryError, match="compute_s must be a number in") as info:
        StageStats(
            run_id="r",
            stage=0,
            iteration=0,
            time_s=1,
            compute_s=-1,
            wait_s=0,
            comm_s=0,
            iteration_s=0,
        )
    assert info.value.reason == "bad-field"
    with pytest.raises(TelemetryError, match="backward_s has 1 layers"):
        StageStats(
            run_id="r", stage=0, iteration=0, time_s=1, forward_s=(1.0, 2.0), backward_s=(1.0,),
            compute_s=0, wait_s=0, comm_s=0, iteration_s=0,
        )  # fmt: skip


def _wire(**changes: Any) -> bytes:
    data = STATS.to_dict()
    for key, value in changes.items():
        if value is _DELETE:
            del data[key]
        else:
            data[key] = value
    return bytes(msgpack.packb(data))


_DELETE = object()
REJECTIONS: list[tuple[str, bytes]] = [
    ("oversized", b"\x80" + b" " * MAX_FRAME_BYTES),
    ("malformed", b""),
    ("malformed", b"\xc1"),  # never-used msgpack byte
    ("malformed", STATS.to_wire()[:-3]),  # truncated
    ("malformed", STATS.to_wire() + b"\x00"),  # trailing data
    ("malformed", b"{not json"),
    ("malformed", bytes(msgpack.packb([1, 2, 3]))),
    ("malformed", b'{"v": 1, "type": "event", "kind": "a", "time_s": NaN}'),
    ("malformed", bytes(msgpack.packb({1: 2}))),  # non-string key
    ("malformed", bytes(msgpack.packb(msgpack.ExtType(5, b"x")))),
    ("malformed", b"\x91" * 10_000),  # nesting deeper than the unpacker allows
    ("malformed", b"[" * 10_000),
    ("wrong-version", _wire(v=SCHEMA_VERSION + 1)),
    ("wrong-version", _wire(v="1")),
    ("wrong-version", _wire(v=True)),
    ("wrong-version", _wire(v=1.0)),
    ("missing-field", _wire(v=_DELETE)),
    ("missing-field", _wire(compute_s=_DELETE)),
    ("missing-field", _wire(run_id=_DELETE)),
    ("unknown-type", _wire(type="stage_stat")),
    ("unknown-type", _wire(type=_DELETE)),
    ("unknown-field", _wire(surprise=1)),
    ("bad-field", _wire(stage=-1)),
    ("bad-field", _wire(stage=True)),
    ("bad-field", _wire(stage=1.5)),
    ("bad-field", _wire(iteration="3")),
    ("bad-field", _wire(time_s=float("inf"))),
    ("bad-field", _wire(wait_s=float("nan"))),
    ("bad-field", _wire(forward_s=[0.1, -0.1])),
    ("bad-field", _wire(forward_s=[0.1] * 3000)),
    ("bad-field", _wire(forward_s={"0": 1.0})),
    ("bad-field", _wire(loss="low")),
    ("bad-field", _wire(run_id="")),
    ("bad-field", _wire(run_id="a\nb")),
    ("bad-field", _wire(run_id=b"bytes")),
    ("bad-field", _wire(memory_reserved_bytes=2**63)),
    ("bad-field", json.dumps(STATS.to_dict() | {"stage": 10**400}).encode()),
    ("bad-field", b'{"v":1,"type":"link_sample","src":0,"dst":1,"time_s":1,"nbytes":1,"seconds":1,"bandwidth_Bps":1' + b"0" * 400 + b"}"),
    ("bad-field", b'{"v":1,"type":"device_sample","stage":0,"time_s":1,"source":"tpu"}'),
    ("bad-field", b'{"v":1,"type":"device_sample","stage":0,"time_s":1,"source":"cpu","fields":{"bad key":1}}'),
    ("bad-field", b'{"v":1,"type":"device_sample","stage":0,"time_s":1,"source":"cpu","fields":{"a":"1"}}'),
    ("bad-field", b'{"v":1,"type":"event","kind":"Bad Kind","time_s":1}'),
    ("bad-field", b'{"v":1,"type":"event","kind":"a","time_s":1,"detail":{"x":[1]}}'),
]  # fmt: skip


@pytest.mark.parametrize(("reason", "frame"), REJECTIONS)
def test_every_bad_frame_is_rejected_with_its_reason(reason: str, frame: bytes) -> None:
    with pytest.raises(TelemetryError) as info:
        decode(frame)
    assert info.value.reason == reason
    assert reason in REASONS


def test_decode_respects_a_smaller_size_limit() -> None:
    with pytest.raises(TelemetryError, match="oversized"):
        decode(STATS.to_wire(), max_bytes=64)


def _decode_or_telemetry_error(frame: bytes) -> None:
    try:
        record = decode(frame)
    except TelemetryError as exc:
        assert exc.reason in REASONS
    else:  # whatever got through is a valid record that re-encodes to itself
        assert decode(record.to_wire()) == record


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_only_ever_raise_telemetry_error(frame: bytes) -> None:
    _decode_or_telemetry_error(frame)


@FUZZ
@given(st.sampled_from([r.to_wire() for r in RECORDS]), st.data())
def test_mutated_valid_frames_only_ever_raise_telemetry_error(frame: bytes, data: Any) -> None:
    raw = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[pos] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del raw[pos : pos + data.draw(st.integers(1, 8))]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    _decode_or_telemetry_error(bytes(raw))


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(st.sampled_from(RECORDS), st.data())
def test_fields_replaced_by_arbitrary_values_only_raise_telemetry_error(
    record: Record, data: Any
) -> None:
    wire = record.to_dict()
    key = data.draw(st.sampled_from([*wire, "extra"]))
    wire[key] = data.draw(JSON_VALUES)
    for encoding in ("msgpack", "json"):
        try:
            frame = (
                bytes(msgpack.packb(wire)) if encoding == "msgpack" else json.dumps(wire).encode()
            )
        except (OverflowError, ValueError):  # not representable in this encoding
            continue
        _decode_or_telemetry_error(frame)


def test_stage_stats_without_a_plan_version_read_as_version_0() -> None:
    """Telemetry written before plans could change still reads."""
    from adaptipe.monitor.schema import StageStats

    old = {
        "v": 1, "type": "stage_stats", "run_id": "r", "stage": 0, "iteration": 3,
        "time_s": 1.0, "compute_s": 0.1, "wait_s": 0.0, "comm_s": 0.0, "iteration_s": 0.1,
    }  # fmt: skip
    record = StageStats.from_dict(old)
    assert record.plan_version == 0
    assert StageStats.from_dict(record.to_dict() | {"plan_version": 2}).plan_version == 2
