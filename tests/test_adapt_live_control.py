"""``adaptipe adapt RUN_DIR --pause | --resume | --controller NAME``: the request file is
checked and keeps what it is not told; the decision loop applies it at its next poll (a
paused loop calls nothing, another controller takes over, one that cannot be built
leaves the previous in charge), logs each change, and in a real run a controller named
mid-run moves layers off a slowed stage."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from adaptipe.cli import main as cli_main
from adaptipe.controllers.live import decider as live_decider
from adaptipe.errors import PlanError
from adaptipe.monitor.runlog import load_run
from adaptipe.monitor.timeline import run_marks
from adaptipe.runtime.adapt_config import AdaptSection
from adaptipe.runtime.adapt_loop import AdaptLoop, Decider
from adaptipe.runtime.adapt_requests import read_override, request_adapt
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import prepare, train
from adaptipe.runtime.planversion import current_version
from adaptipe.runtime.rundir import RunDir
from tests.test_adapt_loop import ONSET, _adapt, _control, _Telemetry, slowed_config


@pytest.fixture
def run(make_config: Callable[..., RunConfig]) -> RunDir:
    run, _ = prepare(make_config(train={"iterations": 100}))
    return run


def _loop(run: RunDir, tele: _Telemetry, settings: AdaptSection) -> AdaptLoop:
    cfg = replace(run.read_config(), adapt=settings)

    def rebuild(name: str) -> Decider | None:
        return (
            None
            if name == "none"
            else live_decider(run, replace(cfg, adapt=replace(settings, controller=name)))
        )

    chosen = rebuild(settings.controller)
    return AdaptLoop(run, settings, chosen, tele.since, rebuild=rebuild)


def _controls(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "adapt_control"]


def _built(loop: AdaptLoop, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Poll until a controller being built has taken over (it builds on a thread)."""
    events = loop.poll([])
    deadline = time.monotonic() + timeout_s
    while loop.building and time.monotonic() < deadline:
        time.sleep(0.005)
        events += loop.poll([])
    return events


def test_a_request_is_checked_and_keeps_what_it_is_not_told(run: RunDir) -> None:
    with pytest.raises(PlanError, match="--controller must be one of none, threshold"):
        request_adapt(run.root, controller="oracle")
    with pytest.raises(PlanError, match="nothing to change"):
        request_adapt(run.root)
    with pytest.raises(PlanError, match="not a run directory"):
        request_adapt(run.root / "nowhere", paused=True)
    assert read_override(run.root) is None
    first = request_adapt(run.root, paused=True)
    second = request_adapt(run.root, controller="straggler")
    assert (first.seq, first.paused, first.controller) == (1, True, None)
    assert (second.seq, second.paused, second.controller) == (2, True, "straggler")
    assert read_override(run.root) == second
    (run.root / "control" / "adapt.json").write_text('{"controller": "oracle"}')
    with pytest.raises(PlanError, match=r"adapt\.json: controller must be one of"):
        read_override(run.root)


def test_a_paused_loop_calls_nothing_until_resumed_then_moves(run: RunDir) -> None:
    tele = _Telemetry()
    loop = _loop(run, tele, _adapt())
    request_adapt(run.root, paused=True)
    events = tele.run(loop, ONSET + 12)
    assert [(e["paused"], e["controller"]) for e in _controls(events)] == [(True, "threshold")]
    assert loop.calls == 0 and current_version(run) == 0 and not loop.active
    request_adapt(run.root, paused=False)
    events = tele.run(loop, ONSET + 20)
    assert [e["paused"] for e in _controls(events)] == [False]
    moved = [e for e in events if e["event"] == "decision" and e["acted"]]
    assert len(moved) == 1 and moved[0]["decision"]["bounds"][1] > 3
    assert current_version(run) == 1


def test_another_controller_takes_over_and_one_that_cannot_be_built_changes_nothing(
    run: RunDir,
) -> None:
    tele = _Telemetry()
    loop = _loop(run, tele, _adapt(controller="none"))
    assert tele.run(loop, ONSET + 4) == [] and loop.calls == 0
    request_adapt(run.root, controller="threshold")
    events = _built(loop) + tele.run(loop, ONSET + 10)
    (change,) = _controls(events)
    assert (change["controller"], change["previous"], change["paused"]) == (
        "threshold",
        "none",
        False,
    )
    decisions = [e for e in events if e["event"] == "decision"]
    assert decisions and all(e["controller"] == "threshold" for e in decisions)
    named = json.loads((run.root / "control" / "controller.json").read_text())
    assert named["controller"] == "threshold" and named["artifacts"] == []
    assert [h["controller"] for h in named["history"]] == ["threshold"]
    # a controller the loop cannot build: logged, and the one in charge stays
    (run.root / "control" / "adapt.json").write_text(
        json.dumps({"paused": False, "controller": "stale", "seq": 9})
    )
    loop._rebuild = lambda name: (_ for _ in ()).throw(PlanError("cannot build it here"))
    (bad,) = _controls(_built(loop) + tele.run(loop, ONSET + 11))
    assert bad["error"] == "PlanError: cannot build it here" and bad["controller"] == "threshold"
    # an older request (seq not above the last applied) is ignored
    (run.root / "control" / "adapt.json").write_text(json.dumps({"paused": True, "seq": 3}))
    assert _controls(tele.run(loop, ONSET + 12)) == [] and not loop.paused


def test_the_cli_asks_shows_and_refuses(run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["adapt", str(run.root), "--pause"]) == 0
    assert "controller none, paused (request 1)" in capsys.readouterr().out
    assert cli_main(["adapt", str(run.root), "--resume", "--controller", "stale"]) == 0
    assert cli_main(["adapt", str(run.root)]) == 0
    assert "controller stale (deciding); configured none" in capsys.readouterr().out
    assert cli_main(["adapt", str(run.root), "--controller", "oracle"]) != 0
    assert "--controller must be one of" in capsys.readouterr().err


def test_a_controller_named_mid_run_moves_layers_off_a_slowed_stage(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    cfg, scenario = slowed_config(
        make_config,
        tmp_path,
        train={"iterations": 250},  # ~26 ms each: the controller takes seconds to build
        adapt={"check_every": 2, "window": 4, "patience": 2, "cooldown": 1000},
    )
    asked: list[int] = []

    def on_iteration(rec: dict[str, Any], total: int) -> None:
        if rec["iteration"] >= 2 and not asked:
            asked.append(request_adapt(cfg.train.run_dir, controller="threshold").seq)

    train(cfg, inject=scenario, decider=live_decider, on_iteration=on_iteration)
    events = _control(Path(cfg.train.run_dir))
    (change,) = _controls(events)
    assert change["controller"] == "threshold" and change["iteration"] >= 2
    moves = [e for e in events if e["event"] == "decision" and e["acted"]]
    assert len(moves) == 1 and moves[0]["decision"]["bounds"][1] > 3, events
    assert moves[0]["iteration"] >= max(change["iteration"], 10)
    assert [m["ok"] for m in events if m["event"] == "migration"] == [True]
    # drawn once on the report's charts, not again from its telemetry announcement
    marks = run_marks(load_run(cfg.train.run_dir), [], 0.0, 1.0)
    assert sum(m.kind == "migration" for m in marks) == 1


def test_a_learned_controller_names_its_artifacts_by_hash(
    make_config: Callable[..., RunConfig],
) -> None:
    import hashlib

    from adaptipe.controllers.artifacts import shipped

    run, _ = prepare(make_config(pipeline={"stages": 4}, adapt={"controller": "ppo"}))
    described = live_decider(run, run.read_config()).describe()
    artifact = described["artifacts"][0]  # then the predictor and the forest (test_chain)
    manifest = (shipped("switch") / "artifact.json").read_bytes()
    assert described["controller"] == "ppo" and artifact["model"] == "switch"
    assert artifact["sha256"] == hashlib.sha256(manifest).hexdigest()


def test_the_manager_is_asked_to_poll_fast_only_when_a_check_is_near(run: RunDir) -> None:
    tele = _Telemetry()
    loop = _loop(run, tele, _adapt(check_every=4, window=4, patience=5))
    assert loop.due  # the first check waits for the first iterations
    tele.run(loop, 3)  # the check at 3 has run
    assert loop._next_check == 7 and not loop.due
    tele.run(loop, 5)
    assert not loop.due
    tele.run(loop, 6)
    assert loop.due  # the next merge (7) brings the check at 7
    request_adapt(run.root, paused=True)
    loop.poll([])
    assert not loop.due
