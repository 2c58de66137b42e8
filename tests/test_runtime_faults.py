"""Faults: a dying worker ends the run quickly, naming the stage and the cause; nothing
is left running; the last checkpoint is intact and a resumed run ends exactly where an
uninterrupted one does."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError
from adaptipe.runtime import StageFailed, train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.worker import FAULT_ENV
from tests.test_runtime_cli import TINY


def _stage_records(run_dir: Path, stage: int) -> list[dict[str, Any]]:
    path = run_dir / "stages" / f"stage-{stage}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    found = ckpt.latest(run_dir / "checkpoints")
    assert found is not None
    tensors, _ = ckpt.load(found)
    return tensors


def _train_in_thread(cfg: RunConfig) -> tuple[threading.Thread, dict[str, BaseException | None]]:
    outcome: dict[str, BaseException | None] = {"error": None}

    def run() -> None:
        try:
            train(cfg)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _wait_for_iteration(
    run_dir: Path, stage: int, iteration: int, timeout_s: float = 60.0
) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = [r for s in (0, 1) for r in _stage_records(run_dir, s)]
        pids = [r["pid"] for r in records if r.get("event") == "ready"]
        if (
            any(r.get("iteration", -1) >= iteration and r.get("stage") == stage for r in records)
            and len(pids) == 2
        ):
            return pids
        time.sleep(0.02)
    raise AssertionError(f"stage {stage} never reached iteration {iteration}")


def test_killed_worker_is_reported_within_seconds_and_the_run_resumes_exactly(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    cfg = make_config(
        train={"iterations": 400, "checkpoint_every": 5, "run_dir": str(tmp_path / "killed")}
    )
    run_dir = Path(cfg.train.run_dir)
    thread, outcome = _train_in_thread(cfg)
    pids = _wait_for_iteration(run_dir, stage=1, iteration=12)
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert time.monotonic() - killed_at < 10
    error = outcome["error"]
    assert isinstance(error, StageFailed), error
    assert "stage 1" in str(error) and "SIGKILL" in str(error) and "--resume" in str(error)
    assert not any(_alive(pid) for pid in pids), "a worker outlived the failed run"

    # The last committed checkpoint is intact (its sha256s verify) and resumable.
    last = ckpt.latest(run_dir / "checkpoints")
    assert last is not None and int(last.name.split("-")[1]) % 5 == 0
    ckpt.load(last)
    resumed = train(cfg, run_dir=run_dir, resume=True)
    assert resumed.start_iteration == int(last.name.split("-")[1])
    assert resumed.start_iteration + resumed.iterations == 400
    logged = [r["iteration"] for r in RunDir(run_dir).read_metrics()]
    start = resumed.start_iteration  # iterations after it ran twice; each is logged once
    assert len(logged) == len(set(logged)) and logged[-(400 - start) :] == list(range(start, 400))
    with pytest.raises(PlanError, match=r"the run is complete .*all 400 iterations"):
        train(cfg, run_dir=run_dir, resume=True)  # said at once: no workers start

    straight = train(
        make_config(
            train={"iterations": 400, "checkpoint_every": 0, "run_dir": str(tmp_path / "straight")}
        )
    )
    want = _params(Path(straight.run_dir))
    got = _params(run_dir)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs after resume"


def test_raising_worker_names_stage_and_cause(
    make_config: Callable[..., RunConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:2")
    cfg = make_config(train={"iterations": 50})
    started = time.monotonic()
    with pytest.raises(StageFailed) as err:
        train(cfg)
    assert time.monotonic() - started < 60
    message = str(err.value)
    assert "stage 1 failed" in message and "InjectedFault" in message and "iteration 2" in message
    run_dir = Path(cfg.train.run_dir)
    pids = [
        r["pid"] for s in (0, 1) for r in _stage_records(run_dir, s) if r.get("event") == "ready"
    ]
    assert pids and not any(_alive(pid) for pid in pids)


def test_new_run_refuses_a_directory_that_holds_a_trained_run(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = make_config(train={"iterations": 2})
    train(cfg)
    with pytest.raises(PlanError, match=r"already holds a trained run.*--resume"):
        train(cfg)


def test_resume_refuses_a_checkpoint_from_another_model(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = make_config(train={"iterations": 2})
    summary = train(cfg)
    run_dir = Path(summary.run_dir)
    stored = json.loads((run_dir / "config.json").read_text())
    stored["model"]["config"]["hidden"] = 32  # the run directory now asks for another model
    (run_dir / "config.json").write_text(json.dumps(stored))
    before = {p.name: p.read_bytes() for p in (run_dir / "stages").iterdir()}
    with pytest.raises(PlanError, match="hidden"):
        train(cfg, run_dir=run_dir, resume=True)
    after = {p.name: p.read_bytes() for p in (run_dir / "stages").iterdir()}
    assert before and after == before, "workers started despite the checkpoint from another model"


def test_partition_that_does_not_match_the_model_is_refused_before_start(
    make_config: Callable[..., RunConfig],
) -> None:
    with pytest.raises(PlanError, match=r"\[pipeline\]"):
        make_config(pipeline={"partition": [0, 2, 5]})


def test_microbatch_count_the_schedule_cannot_use_is_refused(
    make_config: Callable[..., RunConfig],
) -> None:
    with pytest.raises(PlanError, match="multiple"):
        make_config(
            pipeline={"schedule": "interleaved", "stages": 4, "virtual": 2},
            data={"microbatches": 2, "batch_size": 16},
        )


# the CLI tests' tiny config, training far longer than any test waits
_LONG_RUN = TINY.replace("iterations = 4", "iterations = 1000000").replace(
    "checkpoint_every = 2", "checkpoint_every = 0"
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_manager_killed_from_outside_leaves_no_stage_running(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # SIGTERM (kill, timeout, batch schedulers) ends the stages as Ctrl-C does; if the
    # manager dies by SIGKILL, the stages get SIGTERM from the kernel (Linux).
    import subprocess
    import sys

    if sig == signal.SIGKILL and not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    run_dir = tmp_path / "run"
    config = tmp_path / "long.toml"
    config.write_text(_LONG_RUN)
    with (tmp_path / "out.txt").open("w") as out:
        manager = subprocess.Popen(
            [sys.executable, "-m", "adaptipe.cli", "train", str(config), "--run-dir", str(run_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    pids: list[int] = []
    try:
        pids = _wait_for_iteration(run_dir, 1, 2)
        manager.send_signal(sig)
        code = manager.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "a stage process outlived its manager"
        if sig == signal.SIGTERM:
            assert code == 128 + signal.SIGTERM
            said = (tmp_path / "out.txt").read_text()  # no checkpoint in this run
            assert f"terminated; no checkpoint in {run_dir} yet: a new `adaptipe train`" in said
    finally:
        for pid in [manager.pid, *pids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        manager.wait(timeout=10)
