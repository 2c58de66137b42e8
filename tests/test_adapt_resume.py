"""Adaptive training across a failure: the decision loop saves its state with every
checkpoint (the controller's own state, the last move) and a resumed run restores the
newest at or before its checkpoint; a stage killed while a controller drives the run ends
it with the cause named, and ``--resume`` goes on deciding where it left off."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from adaptipe.controllers.baselines import RestartAtEpoch, Stale, Straggler
from adaptipe.controllers.live import decider as live_decider
from adaptipe.controllers.threshold import Threshold
from adaptipe.monitor.schema import Record
from adaptipe.plan.partition import Partition
from adaptipe.runtime.adapt_loop import AdaptLoop, Verdict
from adaptipe.runtime.adapt_state import STATE_DIR
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import prepare, train
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.supervisor import StageFailed
from tests.test_adapt_loop import _adapt, _control, _Telemetry, slowed_config
from tests.test_runtime_faults import _wait_for_iteration


class _Counting:
    """A controller that only counts its calls, and keeps the count as its state."""

    def __init__(self, name: str = "counting") -> None:
        self.name, self.calls = name, 0

    def __call__(self, records: Sequence[Record], partition: Partition) -> Verdict:
        self.calls += 1
        return Verdict(bounds=None, decision={"bounds": None, "reason": "keep"})

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])


@pytest.fixture
def run(make_config: Callable[..., RunConfig]) -> RunDir:
    run, _ = prepare(make_config(train={"iterations": 100}))
    return run


def _loop(run: RunDir, tele: _Telemetry, decider: Any, *, start: int = 0) -> AdaptLoop:
    settings = _adapt(check_every=1, window=1)
    return AdaptLoop(
        run,
        settings,
        decider,
        tele.since,
        start=start,
        checkpoint_due=lambda done: done % 5 == 0,
    )


def test_the_state_is_saved_at_each_checkpoint_and_the_newest_before_a_resume_restored(
    run: RunDir,
) -> None:
    tele, first = _Telemetry(), _Counting()
    loop = _loop(run, tele, first)
    tele.run(loop, 12)
    saved = sorted(p.name for p in (run.root / STATE_DIR).iterdir())
    assert saved == ["iter-000005.json", "iter-000010.json"]
    at_10 = json.loads((run.root / STATE_DIR / "iter-000010.json").read_text())
    assert at_10["controller"] == "counting" and at_10["last_move"] is None
    assert 0 < at_10["decider_state"]["calls"] < first.calls == loop.calls

    for start, want in ((10, 10), (12, 10), (7, 5)):
        again = _Counting()
        (event,) = _loop(run, tele, again, start=start).poll([])
        assert event["event"] == "adapt_restored" and event["from"].endswith(f"{want:06d}.json")
        saved_calls = json.loads((run.root / STATE_DIR / f"iter-{want:06d}.json").read_text())
        assert again.calls == saved_calls["decider_state"]["calls"]
    assert _loop(run, tele, _Counting(), start=3).poll([]) == []  # nothing saved that early
    # another controller in charge now: its state is not taken from the counting one's
    other = _Counting("other")
    (event,) = _loop(run, tele, other, start=10).poll([])
    assert event["controller"] == "other" and other.calls == 0
    # a torn file is skipped for the one before it
    (run.root / STATE_DIR / "iter-000010.json").write_text('{"controller": ')
    (event,) = _loop(run, tele, _Counting(), start=10).poll([])
    assert event["from"].endswith("000005.json")


@pytest.mark.parametrize(
    ("controller", "fields"),
    [
        (Threshold(), {"_over": 2, "_last_move": 40}),
        (Straggler(), {"_planned": (1.0, 2.5)}),
        (Stale(), {"_previous": (1.25, 1.0, 3.0)}),
        (RestartAtEpoch(), {"_epoch": 3}),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, dict) else "",
)
def test_each_stateful_controller_round_trips_its_state_through_json(
    controller: Any, fields: dict[str, Any]
) -> None:
    for name, value in fields.items():
        setattr(controller, name, value)
    state = json.loads(json.dumps(controller.state_dict()))
    fresh = type(controller)()
    fresh.load_state_dict(state)
    for name, value in fields.items():
        assert getattr(fresh, name) == value, name


def test_the_threshold_keeps_its_hourly_cap_across_a_resume() -> None:
    now = [1000.0]
    first = Threshold(clock=lambda: now[0])
    first._moves.extend([400.0, 900.0])  # 600 s and 100 s ago
    state = json.loads(json.dumps(first.state_dict()))
    now[0] = 50.0  # another process's clock
    second = Threshold(clock=lambda: now[0])
    second.load_state_dict(state)
    assert list(second._moves) == pytest.approx([-550.0, -50.0])


def _wait_for_control(run_dir: Path, kind: str, timeout_s: float = 60.0) -> None:
    path, deadline = run_dir / "control.jsonl", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and f'"event": "{kind}"' in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event in {timeout_s} s")


def test_a_stage_killed_while_a_controller_drives_ends_the_run_and_resume_goes_on(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    cfg, scenario = slowed_config(
        make_config,
        tmp_path,
        train={"iterations": 400, "checkpoint_every": 10, "run_dir": str(tmp_path / "run")},
        adapt={
            "controller": "threshold",
            "check_every": 2,
            "window": 4,
            "patience": 2,
            "cooldown": 1000,
        },
    )
    run_dir = Path(cfg.train.run_dir)
    outcome: dict[str, BaseException | None] = {"error": None}

    def target() -> None:
        try:
            train(cfg, inject=scenario, decider=live_decider)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    _wait_for_control(run_dir, "migration")  # the controller has moved layers
    control = _control(run_dir)
    moved_at = next(e["iteration"] for e in control if e["event"] == "migration")
    # kill once a checkpoint after the move is written (its state holds the move)
    pids = _wait_for_iteration(run_dir, stage=1, iteration=(moved_at // 10 + 1) * 10 + 2)
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive()
    error = outcome["error"]
    assert isinstance(error, StageFailed) and "stage 1" in str(error) and "SIGKILL" in str(error)

    resumed = train(cfg, run_dir=run_dir, resume=True, inject=scenario, decider=live_decider)
    assert resumed.start_iteration > 0
    events = _control(run_dir)
    (restored,) = [e for e in events if e["event"] == "adapt_restored"]
    assert restored["iteration"] == resumed.start_iteration
    assert restored["controller"] == "threshold" and restored["last_move"] is not None
    # the cooldown (1000 iterations) carried over: no second move after the resume
    moves = [e for e in events if e["event"] == "decision" and e["acted"]]
    assert len(moves) == 1, moves
