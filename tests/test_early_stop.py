"""Early termination of job-array jobs: stop requests, successive halving, re-planning.

The end-to-end tests check the numerics the issue asks for: a job that keeps training
ends exactly as if trained alone even though a sibling stopped mid-run, and a stopped
job ends as if trained alone for the iterations it ran.
"""

from __future__ import annotations

import io
import json
import math
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.cli import main
from adaptipe.errors import PlanError
from adaptipe.japsp.compile import to_schedule
from adaptipe.japsp.instance import JapspInstance
from adaptipe.runtime import prepare, train
from adaptipe.runtime.binder import Binder
from adaptipe.runtime.config import OptimizerSection, RunConfig
from adaptipe.runtime.control import (
    ActiveSet,
    JobController,
    _resolve_jobs,
    adoptions,
    current_version,
    halving_survivors,
    is_rung,
    manager_running,
    mark_manager,
    read_active,
    remap_jobs,
    stop_jobs,
)
from adaptipe.runtime.follower import PlanFollower
from adaptipe.runtime.launch import StageFailed
from adaptipe.runtime.memory import MemoryManager, block_order
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.sweep import JobSpec
from adaptipe.runtime.worker import FAULT_ENV, MANAGER_ENV, run_worker
from adaptipe.schedule.types import Backward, Forward
from adaptipe.schedule.validate import validate
from adaptipe.serial import load_json_file
from tests._solo import alone_params

# Windows of 4: a stop asked for mid-run has several boundaries left to take effect at.
SWEEP: dict[str, Any] = {"grid": {"lr": [0.05, 0.1, 0.2, 0.4]}, "solver": "1f1b", "window": 4}


def _array(make_config: Callable[..., RunConfig], iterations: int, **sweep: Any) -> RunConfig:
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"iterations": iterations},
    )
    data = cfg.to_dict()
    data["sweep"] = dict(SWEEP, **sweep)
    return RunConfig.from_dict(data, source="test.toml")


def _alone(cfg: RunConfig, job: JobSpec, iterations: int) -> dict[str, torch.Tensor]:
    return alone_params(cfg.to_dict(), job, iterations)


def _job_params(run_dir: str, job: int) -> dict[str, torch.Tensor]:
    found = ckpt.latest(Path(run_dir) / "checkpoints")
    assert found is not None
    tensors, _ = ckpt.load(found)
    prefix = f"jobs.{job}."
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix + "layers.")}


def _assert_alone(cfg: RunConfig, run_dir: str, job: JobSpec, iterations: int) -> None:
    got, want = _job_params(run_dir, job.index), _alone(cfg, job, iterations)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{job.name} {name} @{iterations}"
        )


# ---------------------------------------------------------------------- units
def _instance(jobs: int, stages: int) -> JapspInstance:
    fwd = [[1.0 + 0.1 * j] * stages for j in range(jobs)]
    return JapspInstance.build(fwd, [[2 * f for f in row] for row in fwd])


def test_remap_renames_jobs_and_keeps_the_order() -> None:
    inst = _instance(2, 2)
    local = to_schedule(inst, [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]])
    validate(local)
    mapped = remap_jobs(local, [1, 3], 4)
    assert mapped.num_jobs == 4
    for a, b in zip(local.stages, mapped.stages, strict=True):
        assert [type(i) for i in a] == [type(i) for i in b]
        assert [{0: 1, 1: 3}[i.job] for i in a] == [i.job for i in b]
    assert {job for job, _ in block_order(mapped.stages[0])} == {1, 3}
    with pytest.raises(PlanError, match="distinct"):
        remap_jobs(local, [1, 1], 4)
    with pytest.raises(PlanError, match=r"0\.\.3"):
        remap_jobs(local, [1, 4], 4)


def test_active_set_round_trips_through_json() -> None:
    inst = _instance(3, 2)
    sched = to_schedule(inst, [["F0", "F1", "F2", "B0", "B1", "B2"]] * 2)
    active = ActiveSet(version=2, jobs=(0, 2, 5), schedule=sched, stopped={1: {"reason": "x"}})
    back = ActiveSet.from_json(json.loads(json.dumps(active.to_json())))
    assert back == active
    bad = active.to_json() | {"jobs": [0, 2]}
    with pytest.raises(PlanError, match="3 jobs but 2 are active"):
        ActiveSet.from_json(bad)


def test_halving_keeps_the_best_fraction_and_ranks_diverged_jobs_last() -> None:
    losses = {0: 0.5, 1: 0.2, 2: math.nan, 3: 0.3}
    assert halving_survivors(losses, 0.5) == [1, 3]
    assert halving_survivors(losses, 0.25) == [1]
    assert halving_survivors({4: 1.0}, 0.5) == [4]
    assert halving_survivors({0: 1.0, 1: 1.0, 2: 0.9}, 0.5) == [0, 2]  # ties: lower index


def test_rungs_fall_strictly_inside_the_run(make_config: Callable[..., RunConfig]) -> None:
    cfg = _array(make_config, 6, halving_every=2)
    assert [i for i in range(8) if is_rung(cfg, i, 6)] == [2, 4]
    assert not any(is_rung(_array(make_config, 6), i, 6) for i in range(8))


def _binder(num_jobs: int) -> Binder:
    def build_layer(index: int, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed * 100 + index)
        return torch.nn.Linear(4, 4)

    jobs = [
        JobSpec(
            index=j,
            name=f"job{j}",
            optimizer=OptimizerSection(name="sgd", lr=0.1, momentum=0.9),
            batch_size=4,
            seed=j,
            data_seed=j,
        )
        for j in range(num_jobs)
    ]
    return Binder(
        layers=[0, 1],
        jobs=jobs,
        build_layer=build_layer,
        make_optimizer=lambda job, params: job.optimizer.build(params),
    )


def _one_iteration(mm: MemoryManager, order: list[int], budget: int) -> None:
    """Drive one iteration of a stage's blocks, checking residency after every call."""
    mm.begin_iteration()
    last = {j: i for i, j in enumerate(order)}
    for pos, job in enumerate(order):
        mm.before_block(job)
        assert job in mm.resident
        assert len(mm.resident | mm.loading) <= budget
        if pos == last[job]:
            mm.after_step(job)
            assert len(mm.resident | mm.loading) <= budget


def test_memory_manager_adopts_a_smaller_order_and_offloads_stopped_jobs() -> None:
    binder = _binder(6)
    full = [0, 1, 0, 2, 1, 3, 2, 4, 3, 5, 4, 5]  # stage 0 of 1F1B over six jobs
    mm = MemoryManager(binder, budget=2, device=torch.device("cpu"), order=full)
    _one_iteration(mm, full, 2)
    smaller = [1, 3, 1, 5, 3, 5]  # jobs 0, 2 and 4 stopped
    mm.reorder(smaller)
    mm.synchronize()
    assert mm.resident <= {1, 3, 5} and not mm.loading
    seen = len(mm.log)
    for _ in range(2):
        _one_iteration(mm, smaller, 2)
    # From here on only the jobs still running are loaded or prefetched.
    brought = [(event, job) for event, job in mm.log[seen:] if event != "evict"]
    assert brought and {job for _, job in brought} <= {1, 3, 5}
    assert mm.order == smaller
    with pytest.raises(ValueError, match="not a job of this stage"):
        mm.reorder([1, 7])
    with pytest.raises(ValueError, match="below the minimum"):
        mm.reorder([1, 3, 5, 1, 3, 5])  # three jobs in flight at once with a budget of 2


def _controller(run: RunDir, cfg: RunConfig, *, total: int) -> JobController:
    """The manager's controller for a prepared run, from the run's JAPSP instance."""
    instance = load_json_file(run.root / "japsp-instance.json", JapspInstance.from_json)
    return JobController(run, cfg, instance, total=total)


@pytest.fixture
def prepared(make_config: Callable[..., RunConfig]) -> tuple[RunDir, RunConfig]:
    run, cfg = prepare(_array(make_config, 4))
    return run, cfg


def test_stop_requests_are_checked_before_anything_is_written(
    prepared: tuple[RunDir, RunConfig], make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    run, _ = prepared
    with pytest.raises(PlanError, match="no job named 'nope'"):
        stop_jobs(run.root, ["nope"])
    with pytest.raises(PlanError, match=r"job 9 is not in the array \(0..3\)"):
        stop_jobs(run.root, [9])
    with pytest.raises(PlanError, match="would leave no job running"):
        stop_jobs(run.root, [0, 1, 2, 3])
    with pytest.raises(PlanError, match="not a run directory"):
        stop_jobs(tmp_path / "nowhere", [0])
    assert not (run.root / "control").exists()
    single, _ = prepare(make_config(train={"run_dir": str(tmp_path / "single")}))
    with pytest.raises(PlanError, match="not a job-array run"):
        stop_jobs(single.root, [0])
    assert main(["stop", str(single.root), "0"]) == 2


def test_stop_is_refused_once_the_last_checkpoint_holds_every_iteration(
    prepared: tuple[RunDir, RunConfig],
) -> None:
    run, _ = prepared  # 4 iterations; the jobs are evaluated before summary.json is written
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    (run.checkpoints / "latest.json").write_text(json.dumps({"iteration": 3}))
    assert stop_jobs(run.root, [1]) == [1]  # one iteration left: still answered
    (run.checkpoints / "latest.json").write_text(json.dumps({"iteration": 4}))
    with pytest.raises(PlanError, match=r"the run has finished \(all 4 iterations"):
        stop_jobs(run.root, [2])


def test_resuming_a_cpsat_array_without_or_tools_is_refused_at_once(
    prepared: tuple[RunDir, RunConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, _ = prepared
    data = json.loads(run.config_json.read_text())
    data["sweep"]["solver"] = "cpsat"  # as saved on a machine that had OR-Tools
    run.config_json.write_text(json.dumps(data))
    monkeypatch.setattr("adaptipe.japsp.cpsat.available", lambda: False)
    with pytest.raises(PlanError, match=r"\[sweep\].solver 'cpsat' needs OR-Tools"):
        train(run.read_config(), run_dir=run.root, resume=True)


def test_a_job_named_like_an_index_is_found_by_its_name(
    make_config: Callable[..., RunConfig],
) -> None:
    data = make_config(data={"microbatches": 1}).to_dict()
    data["sweep"] = {"jobs": [{"name": "1", "lr": 0.1}, {"name": "0", "lr": 0.2}, {"lr": 0.3}]}
    cfg = RunConfig.from_dict(data, source="test.toml")
    assert _resolve_jobs([j.name for j in cfg.jobs], ["1"], "run") == [
        0
    ]  # the job named "1", not job 1
    assert _resolve_jobs([j.name for j in cfg.jobs], ["0", 2, "2", "job2"], "run") == [1, 2, 2, 2]
    with pytest.raises(PlanError, match=r"job 3 is not in the array \(0..2\)"):
        _resolve_jobs([j.name for j in cfg.jobs], ["3"], "run")


def test_workers_without_a_manager_refuse_halving_at_once(
    make_config: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under torchrun no manager decides the rungs: fail before training, not at a rung.
    run, _ = prepare(_array(make_config, 4, halving_every=2))
    monkeypatch.delenv(MANAGER_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlanError, match=r"\[sweep\].halving_every = 2 needs a manager"):
        run_worker(run.root, resume=False)


def test_stop_says_when_no_manager_will_answer(
    prepared: tuple[RunDir, RunConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = prepared
    assert manager_running(run) is False  # prepared, never trained
    assert main(["stop", str(run.root), "0"]) == 0
    said = capsys.readouterr()
    assert f"asked {run.root} to stop job(s) lr=0.05 (#0)" in said.out
    assert "switch" not in said.out  # nothing will: no manager
    assert "this run has not started training and no manager acts" in said.err
    run.stage_metrics(0).write_text('{"event": "ready"}\n')  # its workers started (torchrun)
    assert main(["stop", str(run.root), "2"]) == 0
    assert "no `adaptipe train` manages this run now" in capsys.readouterr().err
    mark_manager(run, running=True)
    assert manager_running(run) is True
    assert main(["stop", str(run.root), "1"]) == 0
    said = capsys.readouterr()
    assert "no `adaptipe train`" not in said.err
    assert "the workers switch at the next iteration" in said.out
    marker = run.root / "control" / "manager.json"
    marker.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    assert manager_running(run) is False
    marker.write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    assert manager_running(run) is None  # on another host: cannot tell
    mark_manager(run, running=False)
    assert not marker.exists()


def test_stop_answers_without_loading_torch(prepared: tuple[RunDir, RunConfig]) -> None:
    # `adaptipe stop` reads the run directory only: torch's import (seconds on a busy
    # machine) would delay the request by as many iterations.
    import subprocess
    import sys

    run, _ = prepared
    code = (
        "import sys; from adaptipe.cli import main; "
        f"print(main(['stop', {str(run.root)!r}, 'lr=0.1']), 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.splitlines()[-1] == "0 False", done.stdout + done.stderr
    assert "stop job(s) lr=0.1 (#1)" in done.stdout


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_controller_replans_for_the_remaining_jobs(prepared: tuple[RunDir, RunConfig]) -> None:
    run, cfg = prepared
    controller = _controller(run, cfg, total=4)
    assert controller.poll() == [] and current_version(run) == 0
    name = cfg.jobs[2].name
    assert main(["stop", str(run.root), name, "0", "--reason", "looks bad"]) == 0
    events = controller.poll()
    assert [e["event"] for e in events] == ["stop"]
    assert events[0]["jobs"] == [2, 0] and events[0]["active"] == [1, 3]
    assert controller.poll() == []  # a request is handled once
    assert current_version(run) == 1
    active = read_active(run, 1)
    assert active.jobs == (1, 3) and set(active.stopped) == {0, 2}
    assert active.stopped[2]["reason"] == "looks bad"
    validate(active.schedule)
    mapped = active.global_schedule(len(cfg.jobs))
    assert {i.job for stage in mapped.stages for i in stage} == {1, 3}
    assert all(
        isinstance(i, Forward | Backward) or i.job in (1, 3) for s in mapped.stages for i in s
    )
    # Stopping an already stopped job is refused and changes nothing.
    with pytest.raises(PlanError, match=r"job\(s\) lr=0.05 already stopped; nothing to do"):
        stop_jobs(run.root, [0])
    assert controller.poll() == [] and current_version(run) == 1
    stop_jobs(run.root, [1])
    assert [e["event"] for e in controller.poll()] == ["stop"]
    assert read_active(run, current_version(run)).jobs == (3,)


# ---------------------------------------------------------------------- end to end
def _control_events(run_dir: str) -> list[dict[str, Any]]:
    path = Path(run_dir) / "control.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_follower_never_goes_back_to_an_older_version(
    prepared: tuple[RunDir, RunConfig],
) -> None:
    run, cfg = prepared
    controller = _controller(run, cfg, total=4)
    follower = PlanFollower(run, cfg, rank=0, total=4, device="cpu", wait_s=1.0)
    first = follower.at_boundary(0)
    assert first is not None and first.version == 0 and follower.at_boundary(1) is None
    stop_jobs(run.root, [2])
    controller.poll()
    switched = follower.at_boundary(2)
    assert switched is not None and switched.version == 1 and switched.jobs == (0, 1, 3)
    # A torn or unreadable active.json reads as version 0: the follower stays on 1.
    (run.root / "control" / "active.json").write_text("{")
    assert current_version(run) == 0
    assert follower.at_boundary(3) is None and follower.active is not None
    assert follower.active.version == 1
    assert adoptions(run) == {1: 2}  # rank 0 recorded where it switched


def test_a_resumed_follower_replays_the_recorded_switches(
    prepared: tuple[RunDir, RunConfig],
) -> None:
    # Before a crash: job 2 stopped at iteration 6 (version 1), job 0 requested later
    # (version 2) but never adopted. Resumed from a checkpoint at 4: version 0 until 6,
    # version 1 from 6 on (a window ends there), then version 2 at the next boundary.
    run, cfg = prepared
    controller = _controller(run, cfg, total=12)
    stop_jobs(run.root, [2])
    controller.poll()
    (run.root / "control" / "adopted-0001.json").write_text('{"version": 1, "iteration": 6}')
    stop_jobs(run.root, [0])
    controller.poll()
    assert current_version(run) == 2
    follower = PlanFollower(run, cfg, rank=0, total=12, device="cpu", wait_s=1.0)
    assert follower.replay_edges(4) == {6} and follower.replay_edges(6) == set()
    got = follower.at_boundary(4)
    assert got is not None and got.version == 0
    assert follower.at_boundary(5) is None
    got = follower.at_boundary(6)
    assert got is not None and got.version == 1 and got.jobs == (0, 1, 3)
    got = follower.at_boundary(8)
    assert got is not None and got.version == 2 and got.jobs == (1, 3)
    assert adoptions(run) == {1: 6, 2: 8}
    # Resumed past every recorded switch with active.json torn: the first boundary still
    # starts from the newest version recorded in force, never from version 0.
    (run.root / "control" / "active.json").write_text("{")
    again = PlanFollower(run, cfg, rank=0, total=12, device="cpu", wait_s=1.0)
    got = again.at_boundary(10)
    assert got is not None and got.version == 2


def test_a_fresh_run_in_the_directory_forgets_an_earlier_attempts_stops(
    prepared: tuple[RunDir, RunConfig], make_config: Callable[..., RunConfig]
) -> None:
    run, cfg = prepared
    stop_jobs(run.root, [2])
    _controller(run, cfg, total=4).poll()
    (run.root / "control" / "adopted-0001.json").write_text('{"version": 1, "iteration": 2}')
    again, _ = prepare(_array(make_config, 4))  # no checkpoint: a new run may start here
    assert again.root == run.root
    assert current_version(again) == 0 and adoptions(again) == {}


def test_a_user_stop_mid_run_leaves_the_siblings_exact(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = _array(make_config, 40)
    asked: list[int] = []

    def on_iteration(rec: dict[str, Any], total: int) -> None:
        if rec["iteration"] == 2 and not asked:
            assert manager_running(RunDir(cfg.train.run_dir)) is True
            asked.extend(stop_jobs(cfg.train.run_dir, ["lr=0.1"], reason="by hand"))

    summary = train(cfg, on_iteration=on_iteration)
    assert manager_running(RunDir(summary.run_dir)) is False  # unmarked at the end
    with pytest.raises(PlanError, match=r"the run has finished \(all 40 iterations"):
        stop_jobs(summary.run_dir, [0])
    assert asked == [1]
    rows = {row["job"]: row for row in summary.jobs}
    stop = rows[1]["stopped"]
    assert stop["reason"] == "by hand"
    k = stop["iteration"]
    assert k is not None and 3 <= k < 40, stop
    assert all("stopped" not in rows[j] for j in (0, 2, 3))
    # Job 1 trained exactly k iterations; its siblings all 40, as if alone.
    _assert_alone(cfg, summary.run_dir, cfg.jobs[1], k)
    for j in (0, 2, 3):
        _assert_alone(cfg, summary.run_dir, cfg.jobs[j], 40)
    metrics = RunDir(summary.run_dir).read_metrics()
    assert [sorted(r["losses"]) for r in metrics[k - 1 : k + 1]] == [
        ["0", "1", "2", "3"],
        ["0", "2", "3"],
    ]
    assert metrics[-1]["samples"] == 3 * 16
    assert [e["event"] for e in _control_events(summary.run_dir)] == ["stop"]


def test_a_stop_that_comes_in_the_last_window_is_reported_as_not_adopted(
    make_config: Callable[..., RunConfig],
) -> None:
    from rich.console import Console

    from adaptipe.cli.summary import _print_ranking
    from adaptipe.runtime.control import _request_stop

    cfg = _array(make_config, 6)

    def on_iteration(rec: dict[str, Any], total: int) -> None:
        # With the last record every window has run; `adaptipe stop` would refuse now
        # (the final checkpoint is there), so the request is left as it would have been
        # a moment before.
        if rec["iteration"] == total - 1:
            _request_stop(RunDir(cfg.train.run_dir), [1], "by hand")

    summary = train(cfg, on_iteration=on_iteration)
    rows = {row["job"]: row for row in summary.jobs}
    assert "stopped" not in rows[1] and "trained to the end" in rows[1]["stop_unadopted"]["why"]
    assert all("stop_unadopted" not in rows[j] for j in (0, 2, 3))
    _assert_alone(cfg, summary.run_dir, cfg.jobs[1], 6)  # it did train all six
    events = _control_events(summary.run_dir)
    assert [e["event"] for e in events] == ["stop", "stop_unadopted"]
    assert events[1]["jobs"] == [1]
    text = io.StringIO()
    _print_ranking(Console(file=text, width=120), summary.jobs)
    line = next(x for x in text.getvalue().splitlines() if "lr=0.1" in x)
    assert "- (stop came in the last window)" in line


def test_a_run_resumed_after_a_stop_and_a_crash_ends_as_uninterrupted(
    make_config: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Job 1 is stopped by hand early on (at iteration k); stage 1 fails at iteration 25;
    # the run resumes from its checkpoint at 20. Job 1 ends after its k iterations, its
    # siblings after 40, and the summary still says when job 1 stopped.
    cfg = _array(make_config, 40, window=2)
    cfg = RunConfig.from_dict(
        {**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "checkpoint_every": 10}},
        source="test.toml",
    )
    asked: list[int] = []

    def on_iteration(rec: dict[str, Any], total: int) -> None:
        if rec["iteration"] == 2 and not asked:
            asked.extend(stop_jobs(cfg.train.run_dir, ["lr=0.1"], reason="by hand"))

    monkeypatch.setenv(FAULT_ENV, "1:25")
    with pytest.raises(StageFailed, match="InjectedFault"):
        train(cfg, on_iteration=on_iteration)
    monkeypatch.delenv(FAULT_ENV)
    run = RunDir(cfg.train.run_dir)
    (k,) = adoptions(run).values()
    assert asked == [1] and 3 <= k < 25
    summary = train(cfg, run_dir=cfg.train.run_dir, resume=True)
    assert summary.start_iteration == 20
    rows = {row["job"]: row for row in summary.jobs}
    assert rows[1]["stopped"]["iteration"] == k and rows[1]["stopped"]["reason"] == "by hand"
    assert rows[1]["train_loss"] is not None  # from before the resume
    assert all("stopped" not in rows[j] for j in (0, 2, 3))
    _assert_alone(cfg, summary.run_dir, cfg.jobs[1], k)
    for j in (0, 2, 3):
        _assert_alone(cfg, summary.run_dir, cfg.jobs[j], 40)


def test_auto_windows_grow_as_halving_stops_jobs(make_config: Callable[..., RunConfig]) -> None:
    cfg = _array(make_config, 60, window="auto", halving_every=26, halving_keep=0.5)
    summary = train(cfg)
    windows = [r.get("window", 1) for r in RunDir(summary.run_dir).read_metrics()]
    # 4 jobs on 2 stages: 13 iterations; 2 after the rung at 26: 25, cut by the rung at
    # 52; then 1 job: 1 (a lone job's rounds cannot overlap).
    assert windows == [13] * 26 + [25] * 25 + [1] + [1] * 8


@pytest.mark.parametrize("budget", [0, 2], ids=["all-resident", "budget-2-of-4"])
def test_successive_halving_stops_the_worse_half_at_each_rung(
    make_config: Callable[..., RunConfig], budget: int
) -> None:
    cfg = _array(make_config, 6, halving_every=2, halving_keep=0.5, memory_budget=budget)
    summary = train(cfg)
    events = _control_events(summary.run_dir)
    halvings = [e for e in events if e["event"] == "halving"]
    assert [h["iteration"] for h in halvings] == [2, 4]
    first = {int(j): v for j, v in halvings[0]["val_loss"].items()}
    assert sorted(first) == [0, 1, 2, 3]
    kept = halving_survivors(first, 0.5)
    assert halvings[0]["kept"] == kept and len(kept) == 2
    second = {int(j): v for j, v in halvings[1]["val_loss"].items()}
    assert sorted(second) == kept
    (winner,) = halvings[1]["kept"]
    assert winner == halving_survivors(second, 0.5)[0]
    rows = {row["job"]: row for row in summary.jobs}
    for job in cfg.jobs:
        j = job.index
        until = 6 if j == winner else (4 if j in kept else 2)
        if j != winner:
            assert rows[j]["stopped"]["iteration"] == until
            assert rows[j]["stopped"]["decided_at"] == until
        _assert_alone(cfg, summary.run_dir, job, until)
