"""Live layer migration (stop-and-copy): layers change worker at one boundary while the
stage processes keep running, directly from the old worker to the new one (adjacent or
not), and every job ends bitwise equal to the run that never moved a layer; a migration
that fails part way leaves the old partition and changes no bit either."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError
from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import StageFailed, prepare, train
from adaptipe.runtime.migration import MIGRATION_FAULT_ENV, Move, plan_moves
from adaptipe.runtime.partition_plan import array_costs
from adaptipe.runtime.planversion import adoptions, current_version, read_active
from adaptipe.runtime.repartition import repartition
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.worker import FAULT_ENV
from adaptipe.schedule.build import build_schedule

ITERATIONS = 10

# A pairwise cover of schedule x stages x optimizer x jobs; each moves layers forward and
# then back (the second case also between non-adjacent stages).
CASES: dict[str, dict[str, Any]] = {
    "1f1b-2-adam-one-job": {
        "pipeline": {"stages": 2, "schedule": "1f1b"},
        "optimizer": {"name": "adam", "lr": 0.01, "momentum": 0.0},
        "moves": [(3, [0, 2, 6]), (7, [0, 4, 6])],
    },
    "gpipe-3-sgd-one-job-non-adjacent": {
        "pipeline": {"stages": 3, "schedule": "gpipe", "partition": [0, 3, 4, 6]},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "moves": [(3, [0, 1, 2, 6]), (7, [0, 3, 4, 6])],
    },
    "interleaved-2x2-adam-one-job": {
        "pipeline": {"stages": 2, "schedule": "interleaved", "virtual": 2},
        "optimizer": {"name": "adam", "lr": 0.01, "momentum": 0.0},
        "moves": [(3, [0, 1, 3, 4, 6]), (7, [0, 2, 3, 5, 6])],
    },
    "array-4-jobs-2-sgd-budget-2": {
        "pipeline": {"stages": 2, "schedule": "1f1b"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "sweep": {"grid": {"lr": [0.05, 0.2], "batch_size": [8, 16]}, "solver": "1f1b"},
        "moves": [(4, [0, 4, 6]), (8, [0, 1, 6])],
    },
}


def _config(
    make_config: Callable[..., RunConfig],
    case: dict[str, Any],
    run_dir: Path,
    *,
    moves: bool,
    adapt: dict[str, Any] | None = None,
    iterations: int = ITERATIONS,
) -> RunConfig:
    cfg = make_config(
        pipeline=case["pipeline"],
        optimizer=case["optimizer"],
        data={"microbatches": 1 if "sweep" in case else 4},
        train={"iterations": iterations, "checkpoint_every": 5, "run_dir": str(run_dir)},
    )
    data = cfg.to_dict()
    if "sweep" in case:
        data["sweep"] = dict(case["sweep"], window=2, memory_budget=2)
    if moves:
        scripted = [{"iteration": it, "bounds": bounds} for it, bounds in case["moves"]]
        data["adapt"] = {**(adapt or {}), "repartition": scripted}
    return RunConfig.from_dict(data, source="test.toml")


def _final(run_dir: Path, iterations: int = ITERATIONS) -> dict[str, torch.Tensor]:
    found = ckpt.latest(run_dir / "checkpoints")
    assert found is not None
    tensors, meta = ckpt.load(found)
    assert meta["iteration"] == iterations
    return tensors


def _events(run_dir: Path, kind: str, stages: int) -> list[list[dict[str, Any]]]:
    run = RunDir(run_dir)
    return [
        [r for r in map(json.loads, run.stage_metrics(s).read_text().splitlines())
         if r.get("event") == kind]
        for s in range(stages)
    ]  # fmt: skip


def _control_migrations(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "control.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "migration"]


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert any(".step" in k or "momentum_buffer" in k for k in want)  # optimizer state too
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the run without moves"


@pytest.mark.parametrize("name", list(CASES))
def test_live_migrations_end_bitwise_equal_to_no_migration(
    make_config: Callable[..., RunConfig], tmp_path: Path, name: str
) -> None:
    case = CASES[name]
    train(_config(make_config, case, tmp_path / "still", moves=False))
    moved = tmp_path / "moved"
    cfg = _config(make_config, case, moved, moves=True)
    train(cfg)
    workers = cfg.pipeline.stages
    migrations = _events(moved, "migration", workers)
    assert [[(e["iteration"], e["ok"]) for e in s] for s in migrations] == [
        [(it, True) for it, _ in case["moves"]]
    ] * workers
    assert sum(e["bytes_received"] for s in migrations for e in s) > 0
    # the partition recorded is the partition run, and every layer is held once
    run = RunDir(moved)
    version = current_version(run)
    assert list(read_active(run, version).partition.bounds) == case["moves"][-1][1]  # type: ignore[union-attr]
    assert sorted(adoptions(run).values()) == [it for it, _ in case["moves"]]
    if "sweep" in case:  # each move brought the array's block costs under its partition
        costs = array_costs(run)
        assert costs is not None
        for v in adoptions(run):
            plan = read_active(run, v)
            assert plan.partition is not None and plan.instance is not None
            assert plan.instance == costs.instance(plan.partition, plan.jobs)
    plans = _events(moved, "plan", workers)
    held = sorted(i for s in plans for i in s[-1]["layers"])
    assert held == list(range(6))
    if "sweep" not in case:  # `transfer = "auto"` voted (and copied these small states)
        votes = _events(moved, "transfer_vote", workers)
        assert [[(e["iteration"], e["streamed"]) for e in s] for s in votes] == [
            [(it, False) for it, _ in case["moves"]]
        ] * workers
        assert all(len(e["links_Bps"]) == workers for s in votes for e in s)
    said = _control_migrations(moved)  # the manager's log: one event per migration
    assert [(e["iteration"], e["bounds"], e["ok"]) for e in said] == [
        (it, bounds, True) for it, bounds in case["moves"]
    ]
    assert all(e["bytes"] > 0 and e["seconds"] > 0 for e in said)
    # telemetry says which plan version each stage record ran under
    telemetry = [json.loads(line) for line in run.telemetry.read_text().splitlines()]
    versions = {r["plan_version"] for r in telemetry if r.get("type") == "stage_stats"}
    assert versions == {0, *adoptions(run)}
    announced = [r for r in telemetry if r.get("type") == "event" and r["kind"] == "migration"]
    assert [(r["detail"]["iteration"], r["detail"]["ok"]) for r in announced] == [
        (it, True) for it, _ in case["moves"]
    ]  # so `adaptipe monitor` lists them with the injections
    _assert_bitwise(_final(moved), _final(tmp_path / "still"))


@pytest.mark.parametrize("lose_control", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_run_killed_between_two_migrations_resumes_bitwise(
    make_config: Callable[..., RunConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    lose_control: bool,
) -> None:
    """The resume replays the first switch from the run's control folder, or, where that
    was lost, from the plan history its checkpoint records."""
    case = CASES["1f1b-2-adam-one-job"]
    train(_config(make_config, case, tmp_path / "still", moves=False))
    moved = tmp_path / "moved"
    monkeypatch.setenv(FAULT_ENV, "1:6")  # after the first move (3), before the second (7)
    with pytest.raises(StageFailed, match="InjectedFault"):
        train(_config(make_config, case, moved, moves=True))
    monkeypatch.delenv(FAULT_ENV)
    assert list(adoptions(RunDir(moved)).values()) == [3]
    found = ckpt.latest(moved / "checkpoints")
    assert found is not None
    history = ckpt.load(found)[1]["meta"]["plans"]  # the checkpoint of iteration 5
    assert [(h["version"], h["iteration"]) for h in history] == [(1, 3)]
    assert history[0]["plan"]["partition"]["bounds"] == case["moves"][0][1]
    if lose_control:
        for path in (moved / "control").glob("*.json"):
            path.unlink()
    train(_config(make_config, case, moved, moves=True), run_dir=moved, resume=True)
    assert sorted(adoptions(RunDir(moved)).values()) == [3, 7]
    _assert_bitwise(_final(moved), _final(tmp_path / "still"))


def test_a_move_where_a_checkpoint_is_due_resumes_from_that_checkpoint_bitwise(
    make_config: Callable[..., RunConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defined outcome of a checkpoint due at a move's boundary: it is written first, on
    the partition before the move, and a resume from it replays the move there."""
    case = dict(CASES["1f1b-2-adam-one-job"], moves=[(5, [0, 2, 6]), (8, [0, 4, 6])])
    train(_config(make_config, case, tmp_path / "still", moves=False))
    moved = tmp_path / "moved"
    monkeypatch.setenv(FAULT_ENV, "0:6")  # after the move at 5, before the one at 8
    with pytest.raises(StageFailed, match="InjectedFault"):
        train(_config(make_config, case, moved, moves=True))
    monkeypatch.delenv(FAULT_ENV)
    found = ckpt.latest(moved / "checkpoints")
    assert found is not None
    _, meta = ckpt.load(found)
    assert meta["iteration"] == 5 and meta["meta"]["plans"] == []  # written before the move
    layers = [json.loads((found / f"stage-{s}.json").read_text())["layers"] for s in (0, 1)]
    assert layers == [[0, 1, 2], [3, 4, 5]]
    train(_config(make_config, case, moved, moves=True), run_dir=moved, resume=True)
    assert sorted(adoptions(RunDir(moved)).values()) == [5, 8]
    _assert_bitwise(_final(moved), _final(tmp_path / "still"))


@pytest.mark.parametrize(
    "fault",
    [
        "corrupt:0",
        pytest.param("raise:0", marks=pytest.mark.slow),
        pytest.param("late:0", marks=pytest.mark.slow),
        "refuse:1",
    ],
)
def test_a_failed_migration_keeps_the_old_partition_and_changes_no_bit(
    make_config: Callable[..., RunConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    # both moves send from worker 0 to worker 1 (the first fails, so the partition the
    # second starts from is still the even one, 0-2 | 3-5)
    case = dict(CASES["1f1b-2-adam-one-job"], moves=[(3, [0, 2, 6]), (7, [0, 1, 6])])
    train(_config(make_config, case, tmp_path / "still", moves=False))
    tried = tmp_path / "tried"
    monkeypatch.setenv(MIGRATION_FAULT_ENV, fault)
    train(_config(make_config, case, tried, moves=True, adapt={"timeout_s": 3}))
    migrations = _events(tried, "migration", 2)
    assert all(not e["ok"] for s in migrations for e in s)
    assert [len(s) for s in migrations] == [2, 2]
    causes = " ".join(e["cause"] for s in migrations for e in s)
    expected = {
        "corrupt": "checksum mismatch",
        "raise": "injected before sending",
        "late": "did not arrive within 3 s",
        "refuse": "injected while receiving",
    }
    assert expected[fault.split(":")[0]] in causes
    assert _events(tried, "plan", 2) == [[], []]  # the partition never changed
    said = _control_migrations(tried)
    assert [e["ok"] for e in said] == [False, False]
    assert expected[fault.split(":")[0]] in " ".join(c for e in said for c in e["causes"])
    from adaptipe.cli.summary import _migrations_said

    assert "failed, the old partition stayed" in _migrations_said(tried)
    if fault.startswith("corrupt"):  # the report's event table and charts mark them too
        from adaptipe.monitor.report import make_report

        page = make_report(tried).read_text()
        assert page.count("migration failed") >= 2 and "kept the old partition" in page
    run = RunDir(tried)
    assert read_active(run, current_version(run)).partition is None  # the run's own
    _assert_bitwise(_final(tried), _final(tmp_path / "still"))


def test_plan_moves_go_straight_from_old_to_new_worker() -> None:
    schedule = build_schedule("gpipe", stages=3, microbatches=3)
    old = Partition(model="m", num_layers=6, bounds=(0, 3, 4, 6))
    new = Partition(model="m", num_layers=6, bounds=(0, 1, 2, 6))
    assert plan_moves(old, new, schedule) == [
        Move((1,), 0, 1),
        Move((2,), 0, 2),  # not through worker 1
        Move((3,), 1, 2),
    ]
    inter = build_schedule("interleaved", stages=2, microbatches=4, chunks=2)
    old4 = Partition(model="m", num_layers=6, bounds=(0, 2, 3, 5, 6))
    new4 = Partition(model="m", num_layers=6, bounds=(0, 1, 3, 4, 6))
    # layer 1: vstage 0 -> 1 (worker 0 -> 1); layer 4: vstage 2 -> 3 (worker 0 -> 1)
    assert plan_moves(old4, new4, inter) == [Move((1,), 0, 1), Move((4,), 0, 1)]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"iteration": 3, "bounds": [0, 3]}, r"is not a partition of this model: 3 increasing"),
        ({"iteration": 3, "bounds": [0, 4, 4]}, "is not a partition"),
        ({"iteration": 3, "bounds": [0, 2, 7]}, "is not a partition"),
        ({"iteration": 10, "bounds": [0, 2, 6]}, r"not before the last iteration \(allowed: 1..9"),
        ({"iteration": 3, "bounds": [0, 2, 6], "when": 1}, r"unknown field .*when"),
    ],
)
def test_bad_scripted_repartitions_name_what_is_wrong(
    make_config: Callable[..., RunConfig], entry: dict[str, Any], message: str
) -> None:
    data = make_config(train={"iterations": ITERATIONS}).to_dict()
    data["adapt"] = {"repartition": [entry]}
    with pytest.raises(PlanError, match=message):
        RunConfig.from_dict(data, source="run.toml")
    data["adapt"] = {"method": "teleport"}
    with pytest.raises(PlanError, match=r"\[adapt\].method must be one of live, checkpoint"):
        RunConfig.from_dict(data, source="run.toml")
    data["adapt"] = {"repartition": [{"iteration": 3, "bounds": [0, 2, 6]}]}
    data["pipeline"]["schedule"] = "pipedream"
    with pytest.raises(PlanError, match=r"needs a synchronous schedule .*'pipedream'"):
        RunConfig.from_dict(data, source="run.toml")


def test_a_live_request_moves_layers_while_training_runs(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    case = CASES["1f1b-2-adam-one-job"]
    long = 100  # the request, made at iteration 2, lands long before the end
    train(_config(make_config, case, tmp_path / "still", moves=False, iterations=long))
    live = tmp_path / "live"
    asked: list[int] = []

    def on_iteration(record: dict[str, Any], total: int) -> None:
        if not asked and record["iteration"] >= 2:
            asked.append(repartition(live, [0, 2, 6]).version)

    cfg = _config(make_config, case, live, moves=False, iterations=long)
    train(cfg, on_iteration=on_iteration)
    adopted = adoptions(RunDir(live))
    assert list(adopted) == asked == [1] and 2 < adopted[1] < long
    migrations = _events(live, "migration", 2)
    assert [[(e["iteration"], e["ok"]) for e in s] for s in migrations] == [
        [(adopted[1], True)]
    ] * 2
    _assert_bitwise(_final(live, long), _final(tmp_path / "still", long))
    with pytest.raises(PlanError, match="the run has finished"):
        repartition(live, [0, 3, 6])


def test_a_stop_asked_with_a_move_lands_with_it_and_keeps_every_job_exact(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    """Defined outcome of a stop request that arrives while a re-partition is pending or
    under way: the manager commits the stop on top of the partition (commits edit the
    newest version, so neither undoes the other), the workers take each on at a
    boundary, the stopped job trains no more and every other job ends bitwise as in the
    run that neither moved nor stopped."""
    from adaptipe.runtime.control import stop_jobs

    case = CASES["array-4-jobs-2-sgd-budget-2"]
    long = 200  # the requests, made at iteration 2, land long before the end
    train(_config(make_config, case, tmp_path / "still", moves=False, iterations=long))
    live = tmp_path / "live"
    asked: list[int] = []

    def on_iteration(record: dict[str, Any], total: int) -> None:
        if not asked and record["iteration"] >= 2:
            asked.append(repartition(live, [0, 4, 6]).version)
            stop_jobs(live, [1], reason="asked with a move")

    cfg = _config(make_config, case, live, moves=False, iterations=long)
    train(cfg, on_iteration=on_iteration)
    run = RunDir(live)
    newest = read_active(run, current_version(run))
    assert newest.jobs == (0, 2, 3) and set(newest.stopped) == {1}
    assert newest.partition is not None and newest.partition.bounds == (0, 4, 6)
    assert len(_control_migrations(live)) == 1 and _control_migrations(live)[0]["ok"]
    adopted = sorted(adoptions(run).values())
    assert adopted and adopted[-1] < long // 2, adopted
    got, want = _final(live, long), _final(tmp_path / "still", long)
    for job in (0, 2, 3):
        keys = [k for k in want if k.startswith(f"jobs.{job}.")]
        assert keys and all(torch.equal(got[k], want[k]) for k in keys), f"job {job}"
    stopped = [k for k in want if k.startswith("jobs.1.layers.")]
    assert not all(torch.equal(got[k], want[k]) for k in stopped)  # it trained less


def test_repartition_requests_are_checked(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    run, _ = prepare(make_config(train={"iterations": ITERATIONS}))
    with pytest.raises(PlanError, match=r"make 1 stage\(s\), the pipeline runs 2 .*allowed: 3 "):
        repartition(run.root, [0, 6])
    with pytest.raises(PlanError, match=r"not a partition of this model .*allowed: 3 increasing"):
        repartition(run.root, [0, 4, 4])
    with pytest.raises(PlanError, match=r"already hold \[0, 3, 6\]; nothing to move"):
        repartition(run.root, [0, 3, 6])
    assert repartition(run.root, [0, 2, 6]).version == 1
    with pytest.raises(PlanError, match=r"re-partition to \[0, 2, 6\] \(version 1\) is committed"):
        repartition(run.root, [0, 4, 6])
    with pytest.raises(PlanError, match="not a run directory"):
        repartition(tmp_path, [0, 2, 6])


@pytest.mark.parametrize("jobs", [1, 4])
def test_repartition_command_answers_without_loading_torch(
    make_config: Callable[..., RunConfig], jobs: int
) -> None:
    """Also for a job-array, whose block order is solved again for the new partition."""
    import subprocess
    import sys

    cfg = make_config(train={"iterations": ITERATIONS}, data={"microbatches": 1})
    if jobs > 1:
        data = cfg.to_dict()
        data["sweep"] = {"grid": {"lr": [0.05, 0.2], "batch_size": [8, 16]}}
        cfg = RunConfig.from_dict(data, source="test.toml")
    run, _ = prepare(cfg)
    code = (
        "import sys; from adaptipe.cli import main; "
        f"print(main(['repartition', {str(run.root)!r}, '--bounds', '0,4,6']), "
        "'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.splitlines()[-1] == "0 False", done.stdout + done.stderr
    assert "to hold layers [0, 4, 6] (plan version 1)" in done.stdout
    assert read_active(run, 1).partition.bounds == (0, 4, 6)  # type: ignore[union-attr]
    assert (read_active(run, 1).instance is not None) == (jobs > 1)


@pytest.mark.parametrize("method", ["restart", "checkpoint"])
def test_the_baselines_move_through_checkpoints_bitwise(
    make_config: Callable[..., RunConfig], tmp_path: Path, method: str
) -> None:
    """``restart`` (checkpoint, stop the workers, start them again on the new partition:
    the field's baseline) and ``checkpoint`` (the workers stay up) end where live does."""
    case = CASES["1f1b-2-adam-one-job"]
    train(_config(make_config, case, tmp_path / "still", moves=False))
    moved = tmp_path / method
    train(_config(make_config, case, moved, moves=True, adapt={"method": method}))
    restarts = _events(moved, "restart", 2)
    expected = [[3, 7], [3, 7]] if method == "restart" else [[], []]
    assert [[e["iteration"] for e in s] for s in restarts] == expected
    plans = _events(moved, "plan", 2)
    assert [[e["iteration"] for e in s] for s in plans] == [[3, 7], [3, 7]]
    assert _events(moved, "migration", 2) == [[], []]  # nothing went over the wire
    _assert_bitwise(_final(moved), _final(tmp_path / "still"))


def test_a_move_at_a_halving_rung_stops_the_worse_jobs_and_moves_the_layers(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    """Defined outcome of a re-partition at a halving rung: rank 0 waits for the rung's
    decision, the scripted partition is committed on top of it, and the workers take
    both on at that one boundary; every surviving job ends as trained alone."""
    from tests._solo import alone_params

    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"iterations": 8, "run_dir": str(tmp_path / "rung")},
    )
    data = cfg.to_dict()
    data["sweep"] = {
        "grid": {"lr": [0.05, 0.2], "batch_size": [8, 16]},
        "solver": "1f1b",
        "halving_every": 4,
        "window": 2,
    }
    data["adapt"] = {"repartition": [{"iteration": 4, "bounds": [0, 2, 6]}]}
    cfg = RunConfig.from_dict(data, source="test.toml")
    train(cfg)
    run = RunDir(tmp_path / "rung")
    newest = read_active(run, current_version(run))
    assert len(newest.jobs) == 2 and newest.partition is not None
    assert newest.partition.bounds == (0, 2, 6)
    assert set(adoptions(run).values()) == {4}  # one boundary for both
    migrations = _events(tmp_path / "rung", "migration", 2)
    assert [[(e["iteration"], e["ok"]) for e in s] for s in migrations] == [[(4, True)]] * 2
    found = ckpt.latest(tmp_path / "rung" / "checkpoints")
    assert found is not None
    tensors, _ = ckpt.load(found)
    for job in cfg.jobs:
        if job.index not in newest.jobs:
            continue
        prefix = f"jobs.{job.index}."
        got = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix + "layers.")}
        want = alone_params(cfg.to_dict(), job)
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def _product() -> list[Any]:
    """Every schedule x stages x optimizer x jobs combination a migration must keep exact
    (``make test-all``; the default suite runs the pairwise cover above). An 8-layer MLP
    split evenly; the first move gives the first virtual stage's last layer to the
    second, the second move gives it back."""
    cases = []
    for schedule in ("gpipe", "1f1b", "interleaved"):
        for stages in (2, 3):
            for optimizer in ("sgd", "adam"):
                for jobs in (1, 4):
                    if jobs > 1 and schedule == "interleaved":
                        continue  # a [sweep] runs one chunk per stage
                    chunks = 2 if schedule == "interleaved" else 1
                    cases.append(
                        pytest.param(
                            schedule, stages, optimizer, jobs, chunks,
                            id=f"{schedule}-{stages}-{optimizer}-{jobs}job",
                            marks=pytest.mark.slow,
                        )
                    )  # fmt: skip
    return cases


@pytest.mark.parametrize(("schedule", "stages", "optimizer", "jobs", "chunks"), _product())
def test_every_combination_migrates_bitwise(
    make_config: Callable[..., RunConfig],
    tmp_path: Path,
    schedule: str,
    stages: int,
    optimizer: str,
    jobs: int,
    chunks: int,
) -> None:
    layers = 8
    vstages = stages * chunks
    base, extra = divmod(layers, vstages)
    even = [0]
    for v in range(vstages):
        even.append(even[-1] + base + (1 if v < extra else 0))
    inward = [0, even[1] - 1, *even[2:]]  # the first virtual stage has >= 2 layers
    case: dict[str, Any] = {
        "pipeline": {"stages": stages, "schedule": schedule, "virtual": chunks},
        "optimizer": (
            {"name": "sgd", "lr": 0.05, "momentum": 0.9}
            if optimizer == "sgd"
            else {"name": "adam", "lr": 0.01, "momentum": 0.0}
        ),
        "moves": [(3, inward), (7, even)],
    }
    if jobs > 1:
        case["sweep"] = {"grid": {"lr": [0.05, 0.2], "batch_size": [8, 16]}, "solver": "1f1b"}

    def config(run_dir: Path, moves: bool) -> RunConfig:
        microbatches = 1 if jobs > 1 else stages * 2
        cfg = make_config(
            model={"config": {"depth": layers}},
            pipeline=case["pipeline"],
            optimizer=case["optimizer"],
            data={"microbatches": microbatches, "batch_size": 4 * stages * 2},
            train={"iterations": ITERATIONS, "checkpoint_every": 5, "run_dir": str(run_dir)},
        )
        data = cfg.to_dict()
        if "sweep" in case:
            data["sweep"] = dict(case["sweep"], window=2, memory_budget=2)
        if moves:
            scripted = [{"iteration": it, "bounds": b} for it, b in case["moves"]]
            data["adapt"] = {"repartition": scripted}
        return RunConfig.from_dict(data, source="test.toml")

    train(config(tmp_path / "still", moves=False))
    train(config(tmp_path / "moved", moves=True))
    migrations = _events(tmp_path / "moved", "migration", stages)
    assert all([(e["iteration"], e["ok"]) for e in s] == [(3, True), (7, True)] for s in migrations)
    _assert_bitwise(_final(tmp_path / "moved"), _final(tmp_path / "still"))
