"""The memory early warning beyond one worker: the manager's decision loop answers a
stage's warning with one layer off it (`adaptipe.runtime.memory_relief`), a GPU
job-array's memory manager keeps fewer job states resident when told, the ``memory``
injector allocates inside the worker it names (`adaptipe.inject.inworker`), and a real
two-stage run whose stage 1 grows toward its limit is warned, admits fewer micro-batches,
gives a layer away and ends bitwise as the same run without the injection, under the
limit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptipe.controllers.live import decider as live_decider
from adaptipe.errors import PlanError
from adaptipe.inject.injectors import read_memory_loads
from adaptipe.inject.inworker import WorkerMemory
from adaptipe.inject.runner import ScenarioRunner
from adaptipe.inject.scenario import MemoryPressure, parse_scenario
from adaptipe.monitor.report import make_report
from adaptipe.monitor.runlog import load_run
from adaptipe.monitor.schema import StageStats
from adaptipe.monitor.timeline import run_marks
from adaptipe.runtime.adapt_config import AdaptSection
from adaptipe.runtime.adapt_loop import AdaptLoop
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import prepare, train
from adaptipe.runtime.memory import MemoryManager, minimum_budget
from adaptipe.runtime.memory_guard import rss_bytes
from adaptipe.runtime.memory_relief import MemoryRequest, relieved_bounds, write_request
from adaptipe.runtime.planversion import current_version, read_active, record_adoption
from tests.conftest import final_state
from tests.test_jobarray import _job_params
from tests.test_memory import CPU, ONE_F_ONE_B, _binder

MB = 1 << 20


@pytest.mark.parametrize(
    ("bounds", "stage", "want"),
    [
        ((0, 3, 6), 1, (0, 4, 6)),  # the last stage gives its first layer back
        ((0, 3, 6), 0, (0, 2, 6)),  # the first gives its last one on
        ((0, 2, 5, 6), 1, (0, 2, 4, 6)),  # to the neighbour holding fewer layers
        ((0, 1, 4, 6), 1, (0, 2, 4, 6)),
        ((0, 5, 6), 1, None),  # one layer: nothing to give
    ],
)
def test_one_layer_leaves_the_warned_stage_for_its_lighter_neighbour(
    bounds: tuple[int, ...], stage: int, want: tuple[int, ...] | None
) -> None:
    assert relieved_bounds(bounds, stage) == want


def test_a_layer_never_goes_to_a_neighbour_that_is_warned_too() -> None:
    assert relieved_bounds((0, 2, 5, 6), 1, warned={2}) == (0, 3, 5, 6)  # not the lighter
    assert relieved_bounds((0, 2, 5, 6), 1, warned={0, 2}) is None
    assert relieved_bounds((0, 3, 6), 1, warned={0}) is None


def _warn(
    root: Path, seq: int, iteration: int, *, stage: int = 1, state: str = "near", epoch: str = ""
) -> None:
    write_request(
        root,
        MemoryRequest(
            stage=stage,
            seq=seq,
            iteration=iteration,
            state=state,
            used_mb=900.0,
            limit_mb=1000.0,
            slope_mb=12.0,
            epoch=epoch,
        ),
    )


def _poll(loop: AdaptLoop, iteration: int) -> list[dict[str, Any]]:
    """The loop's events after ``iteration`` merged, but the moves' measured outcomes."""
    events = loop.poll([{"iteration": iteration, "iteration_s": 0.01}])
    return [e for e in events if e["event"] != "decision_outcome"]


def test_the_loop_moves_a_layer_off_a_warned_stage_once_per_cooldown(
    make_config: Callable[..., RunConfig],
) -> None:
    run, _ = prepare(make_config(train={"iterations": 100}))
    loop = AdaptLoop(run, AdaptSection(cooldown=5), None, lambda since: [])  # no controller
    assert _poll(loop, 0) == []
    _warn(run.root, 1, 2)
    events = _poll(loop, 3)
    assert [e["event"] for e in events] == ["memory_warning", "decision"]
    decision = events[1]
    assert decision["reason"] == "memory" and decision["controller"] == "memory_guard"
    assert decision["acted"] and decision["version"] == 1 == current_version(run)
    assert decision["bounds"] == [0, 3, 6] and decision["decision"]["bounds"] == [0, 4, 6]
    assert "stage 1 near its limit, 900 of 1000 MB" in decision["decision"]["reason"]
    partition = read_active(run, 1).partition
    assert partition is not None and partition.bounds == (0, 4, 6)

    _warn(run.root, 2, 4, state="growing")  # still warned: logged, answered later
    assert [e["event"] for e in _poll(loop, 4)] == ["memory_warning"]
    record_adoption(run, 1, 5)
    assert _poll(loop, 6) == []  # adopted, but the cooldown runs to iteration 8
    again = _poll(loop, 8)
    assert [e["event"] for e in again] == ["decision"] and again[0]["version"] == 2
    assert again[0]["decision"]["bounds"] == [0, 5, 6]
    _warn(run.root, 2, 9, state="ok")  # back to ok: logged, nothing asked
    record_adoption(run, 2, 9)
    assert [e["event"] for e in _poll(loop, 20)] == ["memory_warning"]
    assert current_version(run) == 2


def test_a_restarted_worker_is_heard_and_a_resumed_manager_answers_no_old_warning(
    make_config: Callable[..., RunConfig],
) -> None:
    from adaptipe.runtime.memory_relief import MemoryRelief

    run, _ = prepare(make_config(train={"iterations": 100}))
    _warn(run.root, 3, 2, epoch="worker-a")
    relief = MemoryRelief(run.root)  # a resumed manager: that file was answered before
    assert relief.poll() == [] and not relief.asking
    _warn(run.root, 1, 5, epoch="worker-b")  # a restarted worker counts from 1 again
    assert [e["seq"] for e in relief.poll()] == [1] and relief.asking


def test_a_warned_stage_whose_neighbour_is_warned_too_keeps_its_layers(
    make_config: Callable[..., RunConfig],
) -> None:
    run, _ = prepare(make_config(train={"iterations": 100}))
    loop = AdaptLoop(run, AdaptSection(dry_run=True), None, lambda since: [])
    _warn(run.root, 1, 2, stage=0)
    _warn(run.root, 1, 2, stage=1)
    decisions = [e for e in _poll(loop, 2) if e["event"] == "decision"]
    assert decisions and decisions[0]["decision"]["bounds"] is None
    assert "its neighbours are warned too (stages [1])" in decisions[0]["decision"]["reason"]


def test_a_dry_run_logs_the_memory_move_without_committing_it(
    make_config: Callable[..., RunConfig],
) -> None:
    run, _ = prepare(make_config(train={"iterations": 100}))
    loop = AdaptLoop(run, AdaptSection(dry_run=True), None, lambda since: [])
    _warn(run.root, 1, 2, stage=0)
    events = _poll(loop, 2)
    assert events[-1]["decision"]["bounds"] == [0, 2, 6] and not events[-1]["acted"]
    assert events[-1]["dry_run"] and current_version(run) == 0


def test_a_tighter_budget_offloads_job_states_at_once_and_never_below_the_order() -> None:
    mm = MemoryManager(_binder(), budget=4, device=CPU, order=ONE_F_ONE_B)
    assert len(mm.resident) == 4
    assert mm.set_budget(3) == 3 and len(mm.resident) + len(mm.loading) <= 3
    assert mm.set_budget(1) == minimum_budget(ONE_F_ONE_B) == 2
    assert len(mm.resident) + len(mm.loading) <= 2 and mm.evictions >= 2
    assert mm.set_budget(4) == 4  # restored when the stage is ok again
    everything = MemoryManager(_binder(), budget=0, device=CPU, order=ONE_F_ONE_B)
    assert everything.set_budget(2) == 0 and len(everything.resident) == 6
    mm.close()


def test_an_in_worker_memory_load_is_checked_and_needs_a_stage_for_grow_mb() -> None:
    scenario = parse_scenario(
        {"inject": [{"kind": "memory", "at_iteration": 3, "stage": 1, "gib": 0.5, "grow_mb": 64}]},
        source="s.toml",
        num_stages=2,
    )
    spec = scenario.injections[0].spec
    assert spec == MemoryPressure(gib=0.5, stage=1, grow_mb=64.0)
    assert scenario.injections[0].stage == 1
    with pytest.raises(PlanError, match=r"s.toml: inject\[0\].grow_mb applies to memory inside"):
        parse_scenario({"inject": [{"kind": "memory", "at_s": 0, "grow_mb": 64}]}, source="s.toml")
    with pytest.raises(PlanError, match=r"inject\[0\].stage must name a stage: stage 2"):
        parse_scenario(
            {"inject": [{"kind": "memory", "at_s": 0, "stage": 2}]}, source="s.toml", num_stages=2
        )


def test_the_memory_injector_grows_inside_the_worker_it_names_and_frees_at_its_end(
    tmp_path: Path,
) -> None:
    scenario = parse_scenario(
        {"inject": [{"kind": "memory", "at_iteration": 0, "stage": 1, "gib": 0.1, "grow_mb": 40}]},
        source="s.toml",
    )
    target, other = WorkerMemory(tmp_path, 1), WorkerMemory(tmp_path, 0)
    runner = ScenarioRunner(scenario, control_dir=tmp_path)
    runner.start()
    try:
        runner.on_iteration(0)
        assert [s["grow_mb"] for s in read_memory_loads(tmp_path)[1]] == [40.0]
        before = rss_bytes()
        held = []
        for it in range(4):
            target.before_boundary(it)
            other.before_boundary(it)
            held.append(target.total_mb)
        assert held == [40.0, 80.0, 102.4, 102.4] and other.total_mb == 0.0
        assert rss_bytes() - before >= 95 * MB  # touched: resident
    finally:
        runner.stop()
    target.before_boundary(4)  # the injection ended: its memory goes
    assert target.total_mb == 0.0 and not read_memory_loads(tmp_path)


# ---------------------------------------------------------------------- a real run


def _run(make_config: Callable[..., RunConfig], run_dir: Path, limit_mb: int) -> RunConfig:
    """Two stages of GPipe (four micro-batches in flight on each) and a memory guard."""
    return make_config(
        model={"config": {"hidden": 192, "num_samples": 16384}},
        data={"batch_size": 64},
        pipeline={"schedule": "gpipe"},
        optimizer={"lr": 0.002},  # trains without diverging: the numbers compared are finite
        train={"iterations": 100, "run_dir": str(run_dir), "stage_memory_mb": limit_mb},
        adapt={"cooldown": 1000},
    )


def _stage_events(run_dir: Path, stage: int) -> list[dict[str, Any]]:
    lines = (run_dir / "stages" / f"stage-{stage}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if "event" in e]


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return final_state(run_dir)


@pytest.mark.slow
def test_a_stage_growing_toward_its_limit_gives_a_layer_away_and_trains_bitwise_as_without(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    base = _run(make_config, tmp_path / "base", 100_000)  # a guard that never warns
    train(base, decider=live_decider)
    peaks = {
        e["stage"]: e["used_mb"]
        for s in (0, 1)
        for e in _stage_events(tmp_path / "base", s)
        if e["event"] == "memory_peak"
    }
    assert set(peaks) == {0, 1}
    assert not (tmp_path / "base" / "control" / "memory-stage-1.json").exists()
    # 400 MB more on stage 1, 40 MB per boundary from iteration 10: warned well before
    # it would reach its limit, 500 MB above what it used without
    limit = int(peaks[1]) + 500
    scenario = tmp_path / "memory.toml"
    scenario.write_text(
        '[[inject]]\nkind = "memory"\nat_iteration = 10\nstage = 1\ngib = 0.4\ngrow_mb = 40\n'
    )
    cfg = _run(make_config, tmp_path / "mem", limit)
    train(cfg, decider=live_decider, inject=scenario)

    events = _stage_events(tmp_path / "mem", 1)
    warnings = [e for e in events if e["event"] == "memory_warning"]
    assert warnings and warnings[0]["previous"] == "ok", events
    assert warnings[0]["in_flight"] == {"from": 4, "to": 2}
    assert "nothing to offload" in warnings[0]["offload"]["why"]
    peak = next(e for e in events if e["event"] == "memory_peak")
    assert peaks[1] + 350 < peak["used_mb"] < limit  # the load was there; no OOM
    assert not any(e["event"] == "memory_warning" for e in _stage_events(tmp_path / "mem", 0))

    control = [json.loads(x) for x in (tmp_path / "mem" / "control.jsonl").read_text().splitlines()]
    moves = [e for e in control if e["event"] == "decision" and e.get("reason") == "memory"]
    assert len(moves) == 1 and moves[0]["acted"], control
    assert moves[0]["decision"]["bounds"] == [0, 4, 6]
    migrations = [e for e in control if e["event"] == "migration"]
    assert [(m["bounds"], m["ok"]) for m in migrations] == [([0, 4, 6], True)]
    assert migrations[0]["iteration"] > warnings[0]["iteration"]
    # telemetry: stage 1 ran two micro-batches in flight from its warning on
    log = load_run(tmp_path / "mem")
    stats = [r for r in log.records if isinstance(r, StageStats) and r.stage == 1]
    assert {r.in_flight for r in stats if r.iteration < warnings[0]["iteration"]} == {4}
    assert {r.in_flight for r in stats if r.iteration >= warnings[0]["iteration"]} == {2}
    assert "memory" in {m.kind for m in run_marks(log, stats, stats[0].time_s, 1.0)}
    page = make_report(tmp_path / "mem").read_text()
    assert "memory warning" in page and "one layer off it" in page

    want, got = _params(tmp_path / "base"), _params(tmp_path / "mem")
    layers = sorted(k for k in want if "layers." in k)
    assert layers and sorted(k for k in got if "layers." in k) == layers
    for key in layers:
        assert torch.isfinite(want[key]).all() and torch.equal(got[key], want[key]), key


@pytest.mark.slow
def test_a_job_array_gives_a_layer_away_from_a_growing_stage_with_each_job_bitwise(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    """Two jobs through one pipeline: stage 1 (last) has no cap to take (one block in
    flight already) and says so; the move and each job's numbers are as with one job."""

    def array(run_dir: Path, limit_mb: int) -> RunConfig:
        data = _run(make_config, run_dir, limit_mb).to_dict()
        data["data"] |= {"microbatches": 1, "batch_size": 32}
        data["pipeline"]["schedule"] = "1f1b"
        data["train"]["iterations"] = 60
        data["sweep"] = {"grid": {"lr": [0.002, 0.005]}, "window": 2}
        return RunConfig.from_dict(data, source="test.toml")

    train(array(tmp_path / "base", 100_000), decider=live_decider)
    peak = next(
        e["used_mb"] for e in _stage_events(tmp_path / "base", 1) if e["event"] == "memory_peak"
    )
    scenario = tmp_path / "memory.toml"
    scenario.write_text(
        '[[inject]]\nkind = "memory"\nat_iteration = 10\nstage = 1\ngib = 0.4\ngrow_mb = 40\n'
    )
    cfg = array(tmp_path / "mem", int(peak) + 500)
    train(cfg, decider=live_decider, inject=scenario)
    warned = [e for e in _stage_events(tmp_path / "mem", 1) if e["event"] == "memory_warning"]
    assert warned and "no cap below" in warned[0]["in_flight"]["why"]
    control = [json.loads(x) for x in (tmp_path / "mem" / "control.jsonl").read_text().splitlines()]
    migrations = [(e["bounds"], e["ok"]) for e in control if e["event"] == "migration"]
    assert migrations == [([0, 4, 6], True)], control
    for job in cfg.jobs:
        want = _job_params(str(tmp_path / "base"), job.index)
        got = _job_params(str(tmp_path / "mem"), job.index)
        assert want.keys() == got.keys() and want
        for key in want:
            assert torch.isfinite(want[key]).all() and torch.equal(got[key], want[key]), key
