"""Real-run timelines ([train] trace_iterations, `adaptipe trace`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from adaptipe.cli import main
from adaptipe.errors import PlanError
from adaptipe.profile import Profile
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.trace import TraceRecorder, compare, read_trace, summarise
from adaptipe.schedule.build import build_schedule
from adaptipe.serial import write_json
from adaptipe.sim import CostModel, simulate
from adaptipe.sim.result import Event

MakeConfig = Callable[..., RunConfig]


def _traced(make_config: MakeConfig, *, start: int, count: int) -> Path:
    """Train the shared tiny MLP (1F1B, 2 stages, 4 micro-batches) for 4 iterations."""
    config = make_config(train={"iterations": 4, "trace_start": start, "trace_iterations": count})
    return Path(train(config).run_dir)


def _by(events: list[Event], stage: int, kind: str) -> list[Event]:
    return [e for e in events if e.worker == stage and e.kind == kind]


def test_traced_run_records_every_instruction_in_causal_order(make_config: MakeConfig) -> None:
    events, span = read_trace(_traced(make_config, start=1, count=2) / "trace")
    assert span == (1, 3)
    for stage in (0, 1):
        # Two iterations of 4 micro-batches, one step each; on a worker boxes never overlap.
        assert len(_by(events, stage, "forward")) == 8
        assert len(_by(events, stage, "backward")) == 8
        assert len(_by(events, stage, "step")) == 2
        mine = sorted((e for e in events if e.worker == stage), key=lambda e: e.start)
        assert all(e.end >= e.start for e in mine)
        assert all(a.end <= b.start + 1e-6 for a, b in itertools.pairwise(mine))
    # The k-th forward on stage 1 needs the k-th forward of stage 0 (its activation), the
    # k-th backward on stage 0 the k-th backward of stage 1 (its gradient).
    for a, b in zip(_by(events, 0, "forward"), _by(events, 1, "forward"), strict=True):
        assert a.microbatch == b.microbatch and b.start >= a.end - 1e-4
    for a, b in zip(_by(events, 1, "backward"), _by(events, 0, "backward"), strict=True):
        assert a.microbatch == b.microbatch and b.start >= a.end - 1e-4
    assert min(e.start for e in events) == 0.0


def test_trace_command_prints_stage_times_and_draws_the_timeline(
    make_config: MakeConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _traced(make_config, start=0, count=1)
    capsys.readouterr()
    png = tmp_path / "timeline.png"
    assert main(["trace", str(run), "--png", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iterations"] == [0, 1]
    for stage in ("0", "1"):
        kinds = out["stages"][stage]["kinds"]
        assert kinds["forward"]["count"] == 4 and kinds["backward"]["count"] == 4
        assert out["stages"][stage]["busy_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["trace", str(run)]) == 0
    assert "stage 1: busy" in capsys.readouterr().out


def test_a_run_that_ends_inside_the_window_writes_what_it_traced(make_config: MakeConfig) -> None:
    events, span = read_trace(_traced(make_config, start=3, count=5) / "trace")
    assert span == (3, 4)
    assert len(_by(events, 0, "step")) == 1


def test_summary_of_a_simulated_timeline_matches_the_simulator() -> None:
    sched = build_schedule("gpipe", stages=3, microbatches=4)
    costs = CostModel.uniform(3, forward=1.0, backward=2.0)
    result = simulate(sched, costs, record=True)
    summary = summarise(list(result.timeline))
    assert result.makespan == pytest.approx(18.0)  # (M + S - 1) * (F + B)
    # Stage s works from its first forward (at s) to its last backward (at 18 - 2s): the
    # idle time in between is the bubble inside that span, 3 * (2 - s) here.
    for s, idle in enumerate((6.0, 3.0, 0.0)):
        row = summary[str(s)]
        assert row["busy_s"] == pytest.approx(result.busy_s[s]) == pytest.approx(12.0)
        assert row["kinds"]["forward"]["count"] == 4
        assert row["kinds"]["backward"]["mean_s"] == pytest.approx(2.0)
        assert row["idle_s"] == pytest.approx(idle)


def test_read_trace_refuses_missing_or_mismatched_traces(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="trace_iterations"):
        read_trace(tmp_path)
    for stage, span in ((0, (0, 2)), (1, (1, 3))):
        rec = TraceRecorder(stage)
        rec.add("forward", 0, 0, 0, 0.0, 1.0)
        rec.write(tmp_path / f"stage-{stage}.json", iterations=span)
    with pytest.raises(PlanError, match="different iterations"):
        read_trace(tmp_path)


def test_negative_trace_settings_are_refused(make_config: MakeConfig) -> None:
    with pytest.raises(PlanError, match=r"\[train\].trace_iterations must be >= 0 \(got -1\)"):
        make_config(train={"trace_iterations": -1})


def test_compare_sets_the_simulation_next_to_the_trace(
    make_config: MakeConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from adaptipe.models import get_model
    from adaptipe.profile import profile_model

    run = _traced(make_config, start=1, count=2)
    cfg = RunDir(run).read_config()
    spec = get_model(cfg.model.name, **cfg.model.config)
    profile = profile_model(spec, microbatch=4, warmup=0, repeats=2, threads=1)
    found = compare(RunDir(run), profile)
    assert found.measured_s > 0 and found.predicted_s > 0
    assert found.error == pytest.approx((found.predicted_s - found.measured_s) / found.measured_s)
    assert found.iterations == (1, 3) and len(found.timeline) == 2 * 2 * 9
    # The same schedule on both sides: per iteration, the same boxes on every stage.
    for stage in ("0", "1"):
        real = {k: v["count"] for k, v in found.real[stage]["kinds"].items()}
        sim = {k: v["count"] for k, v in found.simulated[stage]["kinds"].items()}
        assert real == sim == {"forward": 4, "backward": 4, "step": 1}
    prof_path, png = tmp_path / "profile.json", tmp_path / "sim.png"
    prof_path.write_text(json.dumps(profile.to_json()))
    capsys.readouterr()
    argv = ["trace", str(run), "--profile", str(prof_path), "--sim-png", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "simulated: busy" in out and "iteration: measured" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*argv[:2], "--sim-png", str(png)]) == 2  # --sim-png needs --profile


def test_compare_refuses_a_job_array_run(make_config: MakeConfig, tmp_path: Path) -> None:
    data = make_config(data={"microbatches": 1}).to_dict()
    data["sweep"] = {"grid": {"lr": [0.05, 0.1]}}
    run = RunDir(tmp_path / "array")
    write_json(run.config_json, RunConfig.from_dict(data, source="test.toml").to_dict())
    rec = TraceRecorder(0)
    rec.add("forward", 0, 0, 0, 0.0, 1.0)
    rec.write(run.trace / "stage-0.json", iterations=(0, 1))
    profile = Profile.uniform(6, forward_s=1.0, backward_s=2.0)
    with pytest.raises(PlanError, match="job-array run"):
        compare(run, profile)
