"""The manager's decision loop (`adaptipe.runtime.adapt_loop`) with the threshold
controller live (`adaptipe.controllers.live`): ``[adapt]``'s controller fields are
checked; on synthetic telemetry with stage 1 slowed it decides, commits a plan version
moving layers off stage 1, and later reports the realised gain; dry-run logs without
committing; a controller that raises or hangs is logged and never holds up the poll; and
a real two-stage run with a slowdown injected on stage 1 moves layers away from it live."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from adaptipe.controllers.live import LiveDecider, from_settings, layer_sizes
from adaptipe.controllers.live import decider as live_decider
from adaptipe.controllers.threshold import Threshold
from adaptipe.errors import PlanError
from adaptipe.monitor.report import _decisions_html, make_report
from adaptipe.monitor.runlog import load_run
from adaptipe.monitor.schema import Record, StageStats
from adaptipe.monitor.timeline import run_marks
from adaptipe.plan.partition import Partition
from adaptipe.runtime.adapt_config import AdaptSection
from adaptipe.runtime.adapt_loop import AdaptLoop, Verdict
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.decide_call import DeciderCall, DecideThread
from adaptipe.runtime.launch import prepare, train
from adaptipe.runtime.planversion import current_version, read_active, record_adoption
from adaptipe.runtime.repartition import repartition
from adaptipe.runtime.rundir import RunDir

LAYER_S = 0.002  # every synthetic layer's forward; backward twice that
ONSET = 8  # stage 1 runs 3x slower from this iteration on


def _adapt(**fields: Any) -> AdaptSection:
    base = {"controller": "threshold", "check_every": 2, "window": 4, "patience": 1}
    return AdaptSection(**(base | fields))


def _stats(it: int, stage: int, bounds: Sequence[int], slow: float) -> StageStats:
    first, count = bounds[stage], bounds[stage + 1] - bounds[stage]
    compute = 3 * LAYER_S * count * slow
    return StageStats(
        run_id="r",
        stage=stage,
        iteration=it,
        time_s=1000.0 + it,
        first_layer=first,
        forward_s=(LAYER_S * slow,) * count,
        backward_s=(2 * LAYER_S * slow,) * count,
        compute_s=compute,
        wait_s=0.0,
        comm_s=0.0,
        iteration_s=compute,
    )


class _Telemetry:
    """Synthetic stage_stats, iteration by iteration, for the loop to read."""

    def __init__(self, bounds: Sequence[int] = (0, 3, 6)) -> None:
        self.bounds, self.records, self.next = tuple(bounds), list[Record](), 0

    def run(self, loop: AdaptLoop, upto: int) -> list[dict[str, Any]]:
        """Report iterations up to ``upto`` (stage 1 slowed from ONSET on), polling the
        loop after each and waiting out any call it starts; the events it logged."""
        events = []
        while self.next <= upto:
            it, self.next = self.next, self.next + 1
            stats = [
                _stats(it, s, self.bounds, 3.0 if s == 1 and it >= ONSET else 1.0) for s in (0, 1)
            ]
            self.records += stats
            events += loop.poll(
                [{"iteration": it, "iteration_s": max(r.iteration_s for r in stats)}]
            )
            events += _drain(loop)
        return events

    def since(self, floor: int) -> list[Record]:
        """What `Collector.for_decision` hands a check: StageStats from ``floor`` on."""
        return [r for r in self.records if not isinstance(r, StageStats) or r.iteration >= floor]


def _drain(loop: AdaptLoop, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while loop._call is not None and not loop._call.timed_out and time.monotonic() < deadline:
        time.sleep(0.005)
        events += loop.poll([])
    return events


@pytest.fixture
def run(make_config: Callable[..., RunConfig]) -> RunDir:
    run, _ = prepare(make_config(train={"iterations": 100}))
    return run


def _loop(run: RunDir, tele: _Telemetry, settings: AdaptSection, decider: Any = None) -> AdaptLoop:
    cfg = replace(run.read_config(), adapt=settings)
    chosen = decider if decider is not None else live_decider(run, cfg)
    return AdaptLoop(run, settings, chosen, tele.since)


def test_controller_fields_are_read_checked_and_round_trip(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = make_config(adapt={"controller": "threshold", "patience": 2, "dry_run": True})
    assert cfg.adapt.controller == "threshold" and cfg.adapt.patience == 2 and cfg.adapt.dry_run
    assert (cfg.adapt.check_every, cfg.adapt.window, cfg.adapt.margin) == (4, 8, 0.20)
    assert (cfg.adapt.cooldown, cfg.adapt.max_per_hour, cfg.adapt.horizon) == (20, 6, 100)
    assert cfg.adapt.decide_timeout_s == 5.0 and AdaptSection().controller == "none"
    again = RunConfig.from_dict(cfg.to_dict(), source="again.toml")
    assert again.adapt == cfg.adapt
    assert cfg.adapt.revisit_checks == 50
    guard = from_settings(replace(cfg.adapt, revisit_checks=7))
    assert isinstance(guard, Threshold) and guard.recall is not None
    assert guard.recall.revisit_checks == 7


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"controller": "lstm"},
            r"test.toml: \[adapt\].controller must be one of none, threshold, always_best, "
            r"straggler, stale, ppo",
        ),
        ({"check_every": 0}, r"test.toml: \[adapt\].check_every must be >= 1 \(got 0\)"),
        ({"window": "8"}, r"test.toml: \[adapt\].window must be an integer"),
        ({"margin": -0.1}, r"test.toml: \[adapt\].margin must be >= 0 and < 10 \(got -0.1\)"),
        ({"patience": 0}, r"test.toml: \[adapt\].patience must be >= 1"),
        ({"cooldown": -1}, r"test.toml: \[adapt\].cooldown must be >= 0"),
        ({"max_per_hour": 0}, r"test.toml: \[adapt\].max_per_hour must be >= 1"),
        ({"revisit_checks": -1}, r"test.toml: \[adapt\].revisit_checks must be >= 0"),
        ({"dry_run": "yes"}, r"test.toml: \[adapt\].dry_run must be true or false"),
        ({"decide_timeout_s": 0}, r"test.toml: \[adapt\].decide_timeout_s must be > 0"),
        ({"every": 3}, r"test.toml: unknown field \[adapt\].every \(allowed: method, .*horizon"),
    ],
)
def test_bad_controller_fields_name_file_field_and_what_is_allowed(
    make_config: Callable[..., RunConfig], fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        make_config(adapt=fields)


def test_a_controller_is_refused_without_telemetry_or_with_an_async_schedule(
    make_config: Callable[..., RunConfig],
) -> None:
    with pytest.raises(PlanError, match=r"decides from telemetry, and \[train\].telemetry = false"):
        make_config(adapt={"controller": "threshold"}, train={"telemetry": False})
    with pytest.raises(PlanError, match=r"'threshold' needs a synchronous schedule .*'pipedream'"):
        make_config(adapt={"controller": "threshold"}, pipeline={"schedule": "pipedream"})
    make_config(adapt={"controller": "none"}, train={"telemetry": False})  # nothing to feed


def test_the_threshold_settings_come_from_adapt() -> None:
    controller = from_settings(_adapt(margin=0.3, patience=5, horizon=7))
    assert isinstance(controller, Threshold)
    assert (controller.settings.margin, controller.settings.patience) == (0.3, 5)
    assert controller.settings.horizon == 7 and from_settings(AdaptSection()).name == "none"


def test_a_slow_stage_1_gets_a_committed_move_and_its_realised_gain(run: RunDir) -> None:
    tele = _Telemetry()
    loop = _loop(run, tele, _adapt())
    early = tele.run(loop, ONSET - 1)
    decisions = [e for e in early if e["event"] == "decision"]
    assert decisions and not any(e["acted"] for e in decisions)  # the baseline, balanced
    assert current_version(run) == 0
    events = tele.run(loop, ONSET + 6)
    moved = [e for e in events if e["event"] == "decision" and e["acted"]]
    assert len(moved) == 1, events
    move = moved[0]
    bounds = move["decision"]["bounds"]
    assert move["bounds"] == [0, 3, 6] and bounds[1] > 3 and move["version"] == 1
    assert move["inputs"]["slowdowns"][1] > 1.5 > move["inputs"]["slowdowns"][0]
    assert move["inputs"]["measured_ms"] > move["inputs"]["predicted_best_ms"]
    assert move["decision"]["predicted_gain_s"] > 0 and not move["dry_run"]
    committed = read_active(run, current_version(run)).partition
    assert current_version(run) == 1 and committed is not None
    assert list(committed.bounds) == bounds
    # No decision while the move is committed and not adopted.
    calls = loop.calls
    assert tele.run(loop, ONSET + 12) == [] and loop.calls == calls
    # The workers take it on; stage 1 is relieved: the outcome reports the gain.
    switched = tele.next
    record_adoption(run, 1, switched)
    tele.bounds = tuple(bounds)
    after = tele.run(loop, switched + 5)
    outcome = [e for e in after if e["event"] == "decision_outcome"]
    assert len(outcome) == 1 and outcome[0]["switched_at"] == switched
    assert outcome[0]["iteration"] == move["iteration"] and outcome[0]["version"] == 1
    assert outcome[0]["realised_gain_s"] == pytest.approx(
        outcome[0]["before_s"] - outcome[0]["after_s"]
    )
    assert outcome[0]["realised_gain_s"] > 0, json.dumps([move, outcome])


def test_dry_run_logs_the_move_and_commits_nothing(run: RunDir) -> None:
    tele = _Telemetry()
    loop = _loop(run, tele, _adapt(dry_run=True))
    events = tele.run(loop, ONSET + 6)
    asked = [e for e in events if e["event"] == "decision" and e["decision"]["bounds"]]
    assert asked and all(e["dry_run"] and not e["acted"] for e in asked)
    assert "version" not in asked[0] and current_version(run) == 0


class _Raises:
    name = "broken"

    def __call__(self, records: Sequence[Record], partition: Partition) -> Verdict:
        raise ValueError("no idea")


class _Sleeps:
    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds, self.entered = seconds, 0

    def __call__(self, records: Sequence[Record], partition: Partition) -> Verdict:
        self.entered += 1
        time.sleep(self.seconds)
        return Verdict(bounds=(0, 1, 6), decision={"bounds": [0, 1, 6], "reason": "late"})


def test_a_move_is_committed_when_the_controller_answers_not_at_the_next_poll(
    run: RunDir,
) -> None:
    """The workers see a move one manager poll sooner: the decision's thread commits it
    and the poll only logs it."""
    tele = _Telemetry()
    loop = _loop(run, tele, _adapt(check_every=1, window=1), decider=_Sleeps(0.05))
    loop.poll([{"iteration": 0, "iteration_s": 0.01}])
    call = loop._call
    assert call is not None and current_version(run) == 0
    deadline = time.monotonic() + 5.0
    while not call.done and time.monotonic() < deadline:
        time.sleep(0.005)  # no poll meanwhile
    assert current_version(run) == 1
    committed = read_active(run, 1).partition
    assert committed is not None and list(committed.bounds) == [0, 1, 6]
    (event,) = loop.poll([])
    assert event["acted"] and event["version"] == 1 and loop._call is None
    # it slept: its seconds are the call's wall time, cpu_seconds what its thread computed
    assert event["seconds"] >= 0.05 > 0.02 > event["cpu_seconds"] >= 0


def test_a_quick_answer_is_logged_by_the_poll_that_asked_a_slow_one_later(
    run: RunDir,
) -> None:
    """The manager's poll waits up to ``answer_wait_s`` for a call it starts (a pass of
    its own per answer cost CPU at every check); one past it is taken in later."""
    tele = _Telemetry()
    settings = _adapt(check_every=1, window=1, dry_run=True)
    loop = _loop(run, tele, settings, decider=_Sleeps(0.02))
    (event,) = loop.poll([{"iteration": 0, "iteration_s": 0.01}], answer_wait_s=2.0)
    assert event["event"] == "decision" and event["decision"]["reason"] == "late"
    assert loop._call is None and event["seconds"] >= 0.02
    slow = _loop(run, _Telemetry(), settings, decider=_Sleeps(0.5))
    t0 = time.monotonic()
    assert slow.poll([{"iteration": 0, "iteration_s": 0.01}], answer_wait_s=0.05) == []
    assert 0.04 <= time.monotonic() - t0 < 0.4 and slow.deciding
    slow.await_answer(5.0)
    (late,) = slow.poll([])
    assert late["decision"]["reason"] == "late" and not slow.deciding


def test_calls_are_handed_to_one_thread_and_run_there_one_after_another() -> None:
    """The loop never waits for a call to start: `submit` returns while the thread is
    busy with an earlier call, and every call runs on that one thread, in order."""
    thread, gate, ran = DecideThread(), threading.Event(), []
    busy = DeciderCall(lambda: _wait_then(gate, ran, "first"), lambda v: {}, time.monotonic, thread)
    second = DeciderCall(
        lambda: _wait_then(None, ran, "second"), lambda v: {}, time.monotonic, thread
    )
    assert ran == [] and not busy.done  # both handed over; the first still waits
    gate.set()
    deadline = time.monotonic() + 5.0
    while not second.done and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [name for name, _ in ran] == ["first", "second"]
    assert ran[0][1] == ran[1][1] != threading.get_ident()  # one thread, not the caller's
    thread.close()


def _wait_then(gate: threading.Event | None, ran: list[tuple[str, int]], name: str) -> Verdict:
    if gate is not None:
        assert gate.wait(5.0)
    ran.append((name, threading.get_ident()))
    return Verdict(bounds=None, decision={"bounds": None, "reason": name})


def test_a_controller_that_raises_is_an_error_event_and_the_loop_goes_on(run: RunDir) -> None:
    tele = _Telemetry()
    loop = _loop(run, tele, _adapt(), decider=_Raises())
    t0 = time.monotonic()
    events = tele.run(loop, 9)
    errors = [e for e in events if e["event"] == "decision"]
    assert len(errors) == loop.calls == 4  # at iterations 3, 5, 7, 9: every check
    assert all(e["error"] == "ValueError: no idea" and not e["acted"] for e in errors)
    assert all(e["controller"] == "broken" and e["decision"] is None for e in errors)
    assert time.monotonic() - t0 < 5 and current_version(run) == 0


def test_a_hung_controller_times_out_and_is_not_called_again_while_it_runs(
    run: RunDir,
) -> None:
    tele = _Telemetry()
    slow = _Sleeps(1.5)
    loop = _loop(run, tele, _adapt(decide_timeout_s=0.2), decider=slow)
    events = tele.run(loop, 3)  # the first check starts the call; it times out
    assert loop.calls == 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.8:  # past the timeout, more iterations and checks
        start = time.monotonic()
        events += tele.run(loop, tele.next)
        assert time.monotonic() - start < 0.5  # never waits for the call (>= 0.7 s left)
        time.sleep(0.05)
    assert [e["error"] for e in events if e["event"] == "decision"] == [
        "timed out after 0.2 s (decide_timeout_s); its answer will be dropped and no "
        "other call starts until it returns"
    ]
    assert loop.calls == slow.entered == 1
    time.sleep(1.0)  # it returns: its late move is dropped, the next check calls again
    late = tele.run(loop, tele.next + 2)
    assert loop.calls == 2 and not any(e.get("acted") for e in late)
    assert current_version(run) == 0


def test_no_check_while_a_plan_change_is_in_flight(run: RunDir) -> None:
    repartition(run.root, [0, 2, 6])  # committed, never adopted
    tele = _Telemetry()
    loop = _loop(run, tele, _adapt(), decider=_Raises())
    assert tele.run(loop, 12) == [] and loop.calls == 0


def test_a_controller_without_its_decider_is_refused_before_workers_start(
    make_config: Callable[..., RunConfig],
) -> None:
    with pytest.raises(PlanError, match=r"needs its decider: pass decider=adaptipe.controllers"):
        train(make_config(adapt={"controller": "threshold"}))


def _control(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "control.jsonl").read_text().splitlines()]


def slowed_config(
    make_config: Callable[..., RunConfig],
    tmp_path: Path,
    *,
    train: dict[str, Any],
    adapt: dict[str, Any],
    pipeline: dict[str, Any] | None = None,
) -> tuple[RunConfig, Path]:
    """A config (two stages unless ``pipeline`` says otherwise) whose iterations take
    tens of milliseconds, and a scenario slowing stage 1 4x from iteration 10."""
    scenario = tmp_path / "slow.toml"
    scenario.write_text(
        '[[inject]]\nkind = "slowdown"\nat_iteration = 10\nstage = 1\nfactor = 4.0\n'
    )
    cfg = make_config(
        model={"config": {"hidden": 192, "num_samples": 4096}},
        data={"batch_size": 64},
        pipeline=pipeline or {},
        train=train,
        adapt=adapt,
    )
    return cfg, scenario


def _slowed_run(
    make_config: Callable[..., RunConfig],
    tmp_path: Path,
    *,
    iterations: int,
    adapt: dict[str, Any],
) -> tuple[RunConfig, list[dict[str, Any]]]:
    """A real run of `slowed_config` under ``adapt``: its config and control events."""
    cfg, scenario = slowed_config(
        make_config, tmp_path, train={"iterations": iterations}, adapt=adapt
    )
    train(cfg, inject=scenario, decider=live_decider)
    return cfg, _control(Path(cfg.train.run_dir))


def test_a_slowed_stage_1_loses_layers_live_in_a_real_run(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    cfg, events = _slowed_run(
        make_config,
        tmp_path,
        iterations=60,
        adapt={
            "controller": "threshold",
            "check_every": 2,
            "window": 4,
            "patience": 2,
            "cooldown": 1000,
        },
    )
    moves = [e for e in events if e["event"] == "decision" and e["acted"]]
    assert len(moves) == 1, [e for e in events if e["event"] == "decision"]
    bounds = moves[0]["decision"]["bounds"]
    assert moves[0]["bounds"] == [0, 3, 6] and bounds[1] > 3  # layers off stage 1
    assert moves[0]["iteration"] >= 10
    migrations = [e for e in events if e["event"] == "migration"]
    assert [(m["bounds"], m["ok"]) for m in migrations] == [(bounds, True)]
    outcome = [e for e in events if e["event"] == "decision_outcome"]
    assert [o["switched_at"] for o in outcome] == [migrations[0]["iteration"]]
    page = make_report(cfg.train.run_dir).read_text()
    assert "<h2>Decisions</h2>" in page and f"move to {bounds}" in page
    assert "decision" in {m.kind for m in run_marks(load_run(cfg.train.run_dir), [], 0.0, 1.0)}


def test_the_report_lists_decisions_with_their_realised_gain(tmp_path: Path) -> None:
    move = {"bounds": [0, 4, 6], "reason": "slow stage 1", "predicted_gain_s": 0.012}
    lines = [
        {
            "event": "decision",
            "iteration": 5,
            "controller": "threshold",
            "acted": False,
            "decision": {"bounds": None, "reason": "within the margin"},
        },
        {
            "event": "decision",
            "iteration": 9,
            "controller": "threshold",
            "acted": True,
            "decision": move,
            "inputs": {"slowdowns": [1.02, 3.1], "position_factors": [0.97, 2.8]},
        },
        {
            "event": "decision",
            "iteration": 13,
            "controller": "threshold",
            "acted": False,
            "decision": None,
            "error": "ValueError: no idea",
        },
        {"event": "decision_outcome", "iteration": 9, "realised_gain_s": 0.008},
    ]
    (tmp_path / "control.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    page = _decisions_html(tmp_path)
    rows = [r for r in page.split("<tr>")[2:]]
    assert len(rows) == 3 and "within the margin" in rows[0] and ">keep<" in rows[0]
    assert "move to [0, 4, 6]" in rows[1] and ">12.00<" in rows[1] and ">8.00<" in rows[1]
    assert "1.02, 3.10 (place 0.97, 2.80)" in rows[1]  # what it decided on, its places
    assert ">error<" in rows[2] and "ValueError: no idea" in rows[2]
    assert _decisions_html(tmp_path / "none") == ""


def test_without_a_profile_the_baseline_skips_the_warm_up_with_bytes_from_shapes(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = make_config()  # the tiny MLP: 4 samples a micro-batch, hidden 16, SGD momentum
    sizes = layer_sizes(cfg)
    assert sizes is not None and len(sizes) == 6
    first = sizes[0]  # Linear(8, 16): its output, its input gradient, its state
    assert (first.activation_bytes, first.gradient_bytes) == (4 * 16 * 4, 4 * 8 * 4)
    assert first.param_bytes == (8 * 16 + 16) * 4 == first.optimizer_bytes  # one momentum
    decider = LiveDecider(Threshold(), None, window=4, workers=2, sizes=sizes)
    partition = Partition(model="mlp", num_layers=6, bounds=(0, 3, 6))
    warm = [_stats(it, s, (0, 3, 6), 5.0 if it < 4 else 1.0) for it in range(7) for s in (0, 1)]
    said = decider(warm, partition)
    assert said.bounds is None and "measuring the baseline: 7 of 8" in said.decision["reason"]
    steady = [*warm, *(_stats(7, s, (0, 3, 6), 1.0) for s in (0, 1))]
    decider(steady, partition)
    assert decider.profile is not None  # the second window, not the slow first one
    assert [layer.forward_s for layer in decider.profile.layers] == [LAYER_S] * 6
    assert decider.profile.layers[0].activation_bytes == first.activation_bytes


@pytest.mark.parametrize("name", ["always_best", "straggler", "stale", "ppo"])
def test_every_named_controller_is_built_from_adapt(name: str) -> None:
    controller = from_settings(AdaptSection(controller=name), stages=4)
    assert controller.name == name


def test_the_ppo_policy_for_another_stage_count_is_refused_before_workers_start(
    make_config: Callable[..., RunConfig],
) -> None:
    # 3 stages: policies are shipped for 2 and 4
    cfg = make_config(adapt={"controller": "ppo"}, pipeline={"stages": 3})
    with pytest.raises(
        PlanError, match=r"controller = 'ppo': no shipped switch policy for 3 stages"
    ):
        train(cfg, decider=live_decider)
    assert not (Path(cfg.train.run_dir) / "stages").exists()


def test_a_baseline_controller_moves_layers_off_a_slowed_stage_in_a_real_run(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    _, events = _slowed_run(
        make_config,
        tmp_path,
        iterations=50,
        adapt={"controller": "always_best", "check_every": 2, "window": 4},
    )
    moves = [e for e in events if e["event"] == "decision" and e["acted"]]
    late = [m for m in moves if m["iteration"] >= 10]
    assert late and all(e["controller"] == "always_best" for e in moves)
    # a check at the onset may still read the iterations before it (no margin, no
    # patience: it moves on them); where the run ends, stage 1 has given layers away
    assert moves[-1]["decision"]["bounds"][1] > 3, [m["decision"]["bounds"] for m in moves]
    assert any(e["event"] == "migration" and e["ok"] for e in events)


class _FlipFlop:
    """Always moves: to [0, 2, 6] from anything else, else to [0, 4, 6]."""

    name = "flipflop"

    def __call__(self, records: Sequence[Record], partition: Partition) -> Verdict:
        bounds = (0, 4, 6) if tuple(partition.bounds) == (0, 2, 6) else (0, 2, 6)
        return Verdict(bounds=bounds, decision={"bounds": list(bounds), "reason": "flip"})


def test_the_cooldown_spaces_every_controllers_moves(run: RunDir) -> None:
    tele = _Telemetry()
    loop = _loop(run, tele, _adapt(check_every=1, window=1, cooldown=8), decider=_FlipFlop())
    moved: list[int] = []
    for it in range(40):
        for event in tele.run(loop, it):
            if event["event"] == "decision" and event["acted"]:
                moved.append(event["iteration"])
                record_adoption(run, event["version"], it + 1)  # the workers take it on
                tele.bounds = tuple(event["decision"]["bounds"])
    assert len(moved) >= 3, moved
    assert all(b - a >= 8 for a, b in itertools.pairwise(moved)), moved
