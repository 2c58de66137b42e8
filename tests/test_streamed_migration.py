"""Streamed live migration (`adaptipe.runtime.streamed`): the moving layers' state
crosses as a base copy plus a replayed gradient log while the old partition trains on,
the layers switch owner once the copy has caught up, and every run ends bitwise equal to
the run that never moved a layer; a stream that fails changes nothing either."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptipe.errors import PlanError
from adaptipe.runtime import courier_main
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import StageFailed, train
from adaptipe.runtime.migration import MIGRATION_FAULT_ENV
from adaptipe.runtime.plan_switch import link_floors
from adaptipe.runtime.planversion import adoptions
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.streamproto import LAG_CAUSE, PER_STEP, base_pace
from adaptipe.runtime.worker import FAULT_ENV
from adaptipe.sim.migration import MigrationCost, choose_transfer
from tests.test_migration import _assert_bitwise, _control_migrations, _events
from tests.test_migration import _final as final_state

ITERATIONS = 20
CHUNK = 4096  # the smallest chunks: the pace holds back even this small model's state

CASES: dict[str, dict[str, Any]] = {
    "1f1b-2-adam": {
        "pipeline": {"stages": 2, "schedule": "1f1b"},
        "optimizer": {"name": "adam", "lr": 0.01, "momentum": 0.0},
        "moves": [(3, [0, 2, 6]), (12, [0, 4, 6])],
    },
    "gpipe-3-sgd-non-adjacent": {
        "pipeline": {"stages": 3, "schedule": "gpipe", "partition": [0, 3, 4, 6]},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "moves": [(3, [0, 1, 2, 6]), (12, [0, 3, 4, 6])],
    },
}


def _config(
    make_config: Callable[..., RunConfig],
    case: dict[str, Any],
    run_dir: Path,
    *,
    moves: bool,
    adapt: dict[str, Any] | None = None,
) -> RunConfig:
    cfg = make_config(
        pipeline=case["pipeline"],
        optimizer=case["optimizer"],
        data={"microbatches": 4},
        train={"iterations": ITERATIONS, "checkpoint_every": 10, "run_dir": str(run_dir)},
    )
    data = cfg.to_dict()
    if moves:
        scripted = [{"iteration": it, "bounds": bounds} for it, bounds in case["moves"]]
        data["adapt"] = {"transfer": "streamed", **(adapt or {}), "repartition": scripted}
    return RunConfig.from_dict(data, source="test.toml")


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return final_state(run_dir, ITERATIONS)


@pytest.mark.parametrize("streamer", ["thread", "process"])
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if "gpipe" in n else []) for n in CASES]
)
def test_streamed_migrations_end_bitwise_equal_to_no_migration(
    make_config: Callable[..., RunConfig], tmp_path: Path, name: str, streamer: str
) -> None:
    """In threads of the stage or in each worker's helper process (`streamer`); the
    base copy paced over 3 iterations (the default), in the smallest chunks, so that the
    pace holds back even this small model's state."""
    case = CASES[name]
    stages = case["pipeline"]["stages"]
    train(_config(make_config, case, tmp_path / "still", moves=False))
    moved = tmp_path / "moved"
    adapt = {"streamer": streamer, "chunk_bytes": CHUNK}
    train(_config(make_config, case, moved, moves=True, adapt=adapt))
    starts = _events(moved, "stream_start", stages)
    assert [[e["iteration"] for e in s] for s in starts] == [[3, 12]] * stages
    migrations = _events(moved, "migration", stages)
    switched = [e["iteration"] for e in migrations[0]]
    for s in migrations:
        assert [(e["ok"], e["transfer"], e["streamer"]) for e in s] == [
            (True, "streamed", streamer)
        ] * 2
        assert [e["iteration"] for e in s] == switched  # every worker at one boundary
        assert all(e["streamed_iterations"] >= 1 for e in s)
    # the switch comes after the decision, and that is where the version is recorded
    assert switched[0] > 3 and switched[1] > 12
    assert sorted(adoptions(RunDir(moved)).values()) == switched
    senders = [e for s in migrations for e in s if e["bytes_sent"] > 0]
    assert senders and all(0 < e["log_bytes"] < e["bytes_sent"] for e in senders)
    for n in range(2):  # each side's count is whole at the switch (what was sent arrived)
        moved_n = [s[n] for s in migrations]
        assert sum(e["bytes_sent"] for e in moved_n) == sum(e["bytes_received"] for e in moved_n)
    # a base of several layers kept its pace: its last chunk went no sooner than the pace
    # allows, however busy the machine (`paced_s`, the waits the pace added, is 0 where
    # the sender was behind its pace anyway: yielding to the stage's sends, or starved)
    several = [
        e
        for e in senders
        if sum(len(m["layers"]) for m in e["moves"] if m["src"] == e["stage"]) > 1
    ]
    assert several and all(e["pace_Bps"] > 0 for e in several)
    for e in several:
        base = e["bytes_sent"] - e["log_bytes"]
        assert base > CHUNK and e["base_s"] >= (base - CHUNK) / e["pace_Bps"], e
    plans = _events(moved, "plan", stages)
    assert sorted(i for s in plans for i in s[-1]["layers"]) == list(range(6))
    said = _control_migrations(moved)
    assert [(e["iteration"], e["transfer"], e["ok"]) for e in said] == [
        (it, "streamed", True) for it in switched
    ]
    _assert_bitwise(_final(moved), _final(tmp_path / "still"))


@pytest.mark.parametrize(
    ("fault", "streamer"),
    [
        ("corrupt:0", "thread"),
        pytest.param("raise:0", "thread", marks=pytest.mark.slow),
        pytest.param("open:1", "thread", marks=pytest.mark.slow),
        pytest.param("corrupt:0", "process", marks=pytest.mark.slow),
        pytest.param("raise:0", "process", marks=pytest.mark.slow),
        pytest.param("open:1", "process", marks=pytest.mark.slow),
        pytest.param("die:0", "process", marks=pytest.mark.slow),
    ],
)
def test_a_failed_stream_keeps_the_old_partition_and_changes_no_bit(
    make_config: Callable[..., RunConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    streamer: str,
) -> None:
    """``die``: the sender's helper process exits mid-move; the next move starts a
    fresh helper (which dies the same way)."""
    case = dict(CASES["1f1b-2-adam"], moves=[(3, [0, 2, 6]), (12, [0, 1, 6])])  # 0 sends
    train(_config(make_config, case, tmp_path / "still", moves=False))
    tried = tmp_path / "tried"
    monkeypatch.setenv(MIGRATION_FAULT_ENV, fault)
    train(_config(make_config, case, tried, moves=True, adapt={"streamer": streamer}))
    migrations = _events(tried, "migration", 2)
    causes = " ".join(e["cause"] for s in migrations for e in s)
    expected = {
        "corrupt": "checksum",
        "raise": "injected before sending",
        "open": "could not open the state channel",
        "die": "streaming helper",
    }
    assert expected[fault[:-2]] in causes
    first = [s[0] for s in migrations]
    assert [(e["ok"], e["streamer"]) for e in first] == [(False, streamer)] * 2
    assert all(not e["ok"] for s in migrations for e in s)
    assert _events(tried, "plan", 2) == [[], []]  # the partition never changed
    _assert_bitwise(_final(tried), _final(tmp_path / "still"))


@pytest.mark.parametrize("streamer", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_a_stream_whose_gradient_log_lags_moves_by_stop_and_copy_at_once(
    make_config: Callable[..., RunConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    streamer: str,
) -> None:
    """The link cannot carry the gradient log (``lag``: the sender's log falls behind at
    its first step): the workers agree on it at the next boundary and move the layers
    by stop-and-copy there, instead of dropping the move for the manager to ask again."""
    case = dict(CASES["1f1b-2-adam"], moves=[(3, [0, 2, 6])])  # 0 sends
    train(_config(make_config, case, tmp_path / "still", moves=False))
    moved = tmp_path / "moved"
    monkeypatch.setenv(MIGRATION_FAULT_ENV, "lag:0")
    train(_config(make_config, case, moved, moves=True, adapt={"streamer": streamer}))
    lagged = _events(moved, "stream_lagged", 2)
    assert [[(e["ok"], e["lagged"], e["transfer"]) for e in s] for s in lagged] == [
        [(False, True, "streamed")]
    ] * 2
    assert lagged[0][0]["cause"] == LAG_CAUSE  # the sender's; the receiver heard it lagged
    migrations = _events(moved, "migration", 2)
    assert [[(e["ok"], e["transfer"]) for e in s] for s in migrations] == [
        [(True, "stop_and_copy")]
    ] * 2
    assert all(s[0]["instead_of"] == LAG_CAUSE for s in migrations)
    at = migrations[0][0]["iteration"]
    assert at == migrations[1][0]["iteration"] and 3 < at <= 5  # at the next boundaries
    assert list(adoptions(RunDir(moved)).values()) == [at]
    said = _control_migrations(moved)
    assert [(e["iteration"], e["ok"], e["instead_of"]) for e in said] == [(at, True, LAG_CAUSE)]
    plans = _events(moved, "plan", 2)
    assert [s[-1]["layers"] for s in plans] == [[0, 1], [2, 3, 4, 5]]
    _assert_bitwise(_final(moved), _final(tmp_path / "still"))


@pytest.mark.slow
def test_a_run_killed_between_two_streamed_migrations_resumes_bitwise(
    make_config: Callable[..., RunConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resume replays the first switch where it happened (by stop-and-copy there:
    the same state, so the same bits)."""
    case = CASES["1f1b-2-adam"]
    train(_config(make_config, case, tmp_path / "still", moves=False))
    moved = tmp_path / "moved"
    monkeypatch.setenv(FAULT_ENV, "1:11")  # after the first switch, before the second
    with pytest.raises(StageFailed, match="InjectedFault"):
        train(_config(make_config, case, moved, moves=True))
    monkeypatch.delenv(FAULT_ENV)
    first = list(adoptions(RunDir(moved)).values())
    assert len(first) == 1 and first[0] > 3
    train(_config(make_config, case, moved, moves=True), run_dir=moved, resume=True)
    assert sorted(adoptions(RunDir(moved)).values())[0] == first[0]
    _assert_bitwise(_final(moved), _final(tmp_path / "still"))


def test_the_crossover_streams_large_state_when_the_log_keeps_up() -> None:
    cost = MigrationCost()  # bench/bench_migration.py's fit on this machine
    # the bench's two moves: 76 MB of Adam state (a 25 MB log a step) and 4.8 MB (1.6 MB)
    big = {"state_bytes": 75_666_528, "log_bytes": 25_221_192, "iteration_s": 0.43}
    small = {"state_bytes": 4_767_600, "log_bytes": 1_588_224, "iteration_s": 0.13}
    # over 100 MB/s the big one stalls 0.61 s copied at once and costs 0.41 s streamed
    assert cost.stall_s(big["state_bytes"], 1e8) == pytest.approx(0.61, abs=0.01)
    assert cost.streamed_s(big["state_bytes"], big["log_bytes"]) == pytest.approx(0.41, abs=0.01)
    # the cases the rule is for: a big state over a fast link streams, a small one is
    # copied at once, and a log the link cannot carry each step is never streamed
    assert choose_transfer(cost, **big, bandwidth_Bps=1e8, comm_share=0.1) == "streamed"
    assert choose_transfer(cost, **small, bandwidth_Bps=1e9, comm_share=0.1) == "stop_and_copy"
    assert choose_transfer(cost, **big, bandwidth_Bps=4e7, comm_share=0.1) == "stop_and_copy"


def test_a_vote_reads_the_slower_direction_of_the_link() -> None:
    """The bed's 20 Mbit/s throttle (a kept bench_adaptive run, session 24): the sender's
    light gradient sends to stage 0 complete into the socket buffer and read 90 MB/s,
    stage 0's activations the other way read the throttle's 2.3 MB/s. Voting on the
    sender's reading streamed the move, and the gradient log fell behind; the link's
    slower direction copies it at once."""
    move = {"state_bytes": 1_772_488, "log_bytes": 591_000, "iteration_s": 0.17}
    floors = link_floors([[0.0, 2.3e6], [9e7, 0.0]])
    assert floors == [[0.0, 2.3e6], [2.3e6, 0.0]]
    assert choose_transfer(MigrationCost(), **move, bandwidth_Bps=9e7, comm_share=0.05) == (
        "streamed"
    )
    assert (
        choose_transfer(MigrationCost(), **move, bandwidth_Bps=floors[1][0], comm_share=0.05)
        == "stop_and_copy"
    )
    # a direction never measured leaves the other's reading; neither leaves 0 (unmeasured)
    assert link_floors([[0.0, 0.0], [5e7, 0.0]]) == [[0.0, 5e7], [5e7, 0.0]]
    assert link_floors([[0.0, 0.0], [0.0, 0.0]]) == [[0.0, 0.0], [0.0, 0.0]]


def test_bad_transfer_settings_name_the_field(make_config: Callable[..., RunConfig]) -> None:
    data = make_config().to_dict()
    for adapt, words in (
        ({"transfer": "rsync"}, "[adapt].transfer"),
        ({"prioritise": "yes"}, "[adapt].prioritise"),
        ({"chunk_bytes": 10}, "[adapt].chunk_bytes"),
        ({"streamer": "fork"}, "[adapt].streamer"),
        ({"pace_iterations": -1}, "[adapt].pace_iterations"),
    ):
        with pytest.raises(
            PlanError, match=r"test\.toml.*" + words.replace("[", r"\[").replace(".", r"\.")
        ):
            RunConfig.from_dict({**data, "adapt": adapt}, source="test.toml")


def test_the_helper_numbers_logged_steps_as_the_stage_does() -> None:
    # courier_main keeps its own copy (it imports torch only when a move needs it)
    assert courier_main._PER_STEP == PER_STEP


def test_the_base_pace_spreads_the_state_over_the_iterations_asked() -> None:
    assert base_pace(6_000_000, 0.1, 3) == pytest.approx(20_000_000)  # 2 MB an iteration
    assert base_pace(6_000_000, 0.1, 0) == 0.0  # unpaced when asked
    assert base_pace(6_000_000, 0.0, 3) == 0.0  # and before an iteration was measured
