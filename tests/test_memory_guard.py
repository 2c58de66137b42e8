"""The memory early warning on a worker (`adaptipe.runtime.memory_guard`): the guard's
states and hysteresis, ``[train] stage_memory_mb``'s checks, reading the resident set,
and fewer micro-batches in flight (`adaptipe.runtime.inflight`) leaving training bitwise
what it was, with the in-flight peak measured lower."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptipe.errors import PlanError
from adaptipe.models import get_model
from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.inflight import admit, capped
from adaptipe.runtime.local_transport import Mailbox, run_stages
from adaptipe.runtime.memory_guard import (
    GuardSettings,
    MemoryGuard,
    rss_bytes,
    usage_reader,
)
from adaptipe.runtime.stagestate import build_stage
from adaptipe.schedule.build import build_schedule
from adaptipe.schedule.types import Backward, OptimizerStep, Schedule
from adaptipe.schedule.validate import in_flight, validate
from tests.test_stage_slots import _batches, _connect

MB = 1 << 20
CPU = torch.device("cpu")


def _guard(**fields: float) -> MemoryGuard:
    return MemoryGuard(GuardSettings(limit_bytes=1000 * MB, **fields))  # type: ignore[arg-type]


def _states(guard: MemoryGuard, used_mb: list[float]) -> list[str]:
    return [guard.observe(i, int(u * MB)).state for i, u in enumerate(used_mb)]


def test_a_stage_above_the_near_fraction_is_near_and_below_clear_is_ok_again() -> None:
    # no rise: 850 of 1000 MB is near; it stays near down to 750 (hysteresis)
    states = _states(_guard(), [860, 860, 800, 760, 740, 740, 800])
    assert states == ["near", "near", "near", "near", "ok", "ok", "ok"]


def test_memory_that_would_cross_the_limit_within_the_horizon_is_growing_fast() -> None:
    guard = _guard()
    # +100 MB per iteration: at 750 it would pass 1000 within 3 iterations, at 650 not
    states = _states(guard, [350, 450, 550, 650, 750])
    assert states == ["ok", "ok", "ok", "ok", "growing"]
    last = guard.observe(5, 760 * MB)  # slower now; below near (850), not below clear (750)
    assert (last.previous, last.state, last.changed) == ("growing", "near", True)
    assert guard.observe(6, 740 * MB).state == "ok"
    assert guard.peak_bytes == 760 * MB


def test_a_slow_rise_far_from_the_limit_stays_ok_and_a_replayed_boundary_resets_the_slope() -> None:
    guard = _guard()
    assert set(_states(guard, [100, 110, 120, 130, 140, 150])) == {"ok"}
    for i, used in enumerate([400, 600, 800]):
        guard.observe(10 + i, used * MB)
    assert guard.state == "growing"
    again = guard.observe(11, 800 * MB)  # a restart from a checkpoint: no slope across it
    assert again.slope_bytes == 0.0


def test_bad_guard_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="clear < near"):
        MemoryGuard(GuardSettings(limit_bytes=MB, near=0.7, clear=0.8))
    with pytest.raises(ValueError, match="must be rss, cgroup or cuda"):
        usage_reader("peak")


def test_the_resident_set_grows_by_what_the_worker_touches() -> None:
    before = rss_bytes()
    block = b"\x5a" * (64 * MB)
    grown = rss_bytes() - before
    assert 60 * MB <= grown <= 80 * MB, grown / MB
    del block


def test_stage_memory_mb_is_one_limit_or_one_per_stage_and_round_trips(
    make_config: Callable[..., RunConfig],
) -> None:
    one = make_config(train={"stage_memory_mb": 4000})
    assert one.train.stage_memory_mb == 4000 and one.train.memory_limit_mb(1) == 4000
    each = make_config(train={"stage_memory_mb": [3000, 5000]})
    assert [each.train.memory_limit_mb(s) for s in (0, 1)] == [3000, 5000]
    assert RunConfig.from_dict(each.to_dict(), source="again").train == each.train
    assert make_config().train.memory_limit_mb(0) is None


@pytest.mark.parametrize("value", [0, -5, 1.5, "8GB", True, [1000], [1000, 0], [1, 2, 3]])
def test_bad_stage_memory_mb_names_file_field_and_what_is_allowed(
    make_config: Callable[..., RunConfig], value: object
) -> None:
    message = (
        r"test.toml: \[train\].stage_memory_mb must be an integer > 0 \(MB, every stage\) "
        r"or a list of 2 such integers, one per stage \(got "
    )
    with pytest.raises(PlanError, match=message):
        make_config(train={"stage_memory_mb": value})


def _schedule(name: str, stages: int, microbatches: int) -> Schedule:
    return build_schedule(
        name,
        stages=stages,
        microbatches=microbatches,
        chunks=1,
        recompute=False,
        vertical_sync=False,
        update_every=None,
    )


@pytest.mark.parametrize(
    ("name", "stages", "peaks"),
    [("gpipe", 2, [4, 2]), ("1f1b", 2, [1, 1]), ("1f1b", 4, [3, 2, 1, 1])],
)
def test_admitting_fewer_forwards_keeps_every_backward_and_step_in_order(
    name: str, stages: int, peaks: list[int]
) -> None:
    schedule = _schedule(name, stages, 4 * stages // 2)
    for s in range(stages):
        found = capped(schedule, s)
        program = found.program if found is not None else schedule.stages[s]
        assert in_flight(replace(schedule, stages=(program,)))[0] == peaks[s], s
        assert sorted(map(repr, program)) == sorted(map(repr, schedule.stages[s]))

        def order(p: tuple[object, ...]) -> list[object]:
            return [i for i in p if isinstance(i, Backward | OptimizerStep)]

        assert order(program) == order(schedule.stages[s])
    # the last stage of 1F1B holds one micro-batch already: nothing to cap
    assert capped(_schedule("1f1b", 2, 4), 1) is None
    with pytest.raises(ValueError, match="cap must be >= 1"):
        admit(schedule.stages[0], 0)


def test_every_stage_capped_at_once_still_runs_without_deadlock() -> None:
    for name, stages in (("gpipe", 4), ("1f1b", 4), ("gpipe", 2)):
        schedule = _schedule(name, stages, 8)
        lists = []
        for s in range(stages):
            found = capped(schedule, s)
            lists.append(found.program if found is not None else schedule.stages[s])
        validate(replace(schedule, stages=tuple(lists)))  # raises on a deadlock


def _train(
    make_config: Callable[..., RunConfig], schedule: Schedule, *, cap: bool, iterations: int = 3
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Every stage of ``schedule`` in one process, each capped when ``cap``: the tensors
    after ``iterations`` and each stage's most forwards in flight."""
    cfg = make_config(
        pipeline={"stages": schedule.num_stages},
        optimizer={"name": "adam", "lr": 0.01, "momentum": 0.0},
    )
    spec = get_model("mlp", in_features=8, hidden=16, depth=6, out_features=4)
    bounds = (0, 3, 6) if schedule.num_stages == 2 else (0, 2, 3, 5, 6)
    partition = Partition(model=spec.name, num_layers=6, bounds=bounds)
    stages = [build_stage(spec, partition, schedule, r, cfg, CPU) for r in range(len(bounds) - 1)]
    mailbox = Mailbox()
    _connect(stages, schedule, mailbox)
    if cap:
        for s in stages:
            found = capped(schedule, s.rank)
            if found is not None:
                s.executor.set_program(found.program)  # type: ignore[union-attr]
    peaks = [0] * len(stages)
    for it in range(iterations):
        data = _batches(it, 1, schedule.num_microbatches)
        stats = run_stages(
            [functools.partial(s.executor.run_iteration, it, data) for s in stages]  # type: ignore[union-attr]
        )
        peaks = [max(p, st.max_in_flight) for p, st in zip(peaks, stats, strict=True)]  # type: ignore[attr-defined]
    return {k: v for s in stages for k, v in s.tensors().items()}, peaks


@pytest.mark.parametrize(("name", "stages"), [("gpipe", 2), ("1f1b", 4)])
def test_fewer_microbatches_in_flight_train_bitwise_as_before(
    make_config: Callable[..., RunConfig], name: str, stages: int
) -> None:
    schedule = _schedule(name, stages, 4)
    want, peaks = _train(make_config, schedule, cap=False)
    got, capped_peaks = _train(make_config, schedule, cap=True)
    assert peaks == in_flight(schedule)
    assert all(c <= p for c, p in zip(capped_peaks, peaks, strict=True))
    assert sum(capped_peaks) < sum(peaks), (capped_peaks, peaks)
    assert got.keys() == want.keys() and got
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_calming_down_from_growing_to_near_asks_nothing_new(tmp_path: Path) -> None:
    """Only ok -> warned and -> growing raise the request number the manager answers."""
    from types import SimpleNamespace

    from adaptipe.runtime.memory_guard import MemoryGuardHook

    used = iter([100, 700, 960, 980, 900, 880])
    stage = SimpleNamespace(rank=1, chunks=[[]], device=torch.device("cpu"), memory=None)
    logged: list[dict[str, Any]] = []
    hook = MemoryGuardHook(root=tmp_path, stage=stage, limit_mb=1000, log=logged.append,
                           read=lambda: next(used) * MB)  # type: ignore[arg-type]  # fmt: skip
    hook._admit = lambda window, warned: {}  # type: ignore[method-assign]  # no executor here
    for i in range(6):
        hook.before_window(SimpleNamespace(start=i))  # type: ignore[arg-type]
    # 700 MB rising 600 MB an iteration: growing, asked (1); back to 880 MB: near, with
    # the same request number, so the manager moves nothing more for it
    assert [(e["iteration"], e["state"], e.get("request")) for e in logged] == [
        (1, "growing", 1),
        (5, "near", 1),
    ]
