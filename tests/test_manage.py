"""``adaptipe manage``: the manager of workers that torchrun starts. It collects their
telemetry, answers a live re-partition, reports a failed stage with its cause, and the
run ends with the parameters `adaptipe train` gets on one host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError
from adaptipe.profile.children import free_port
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.hooks import telemetry_target
from adaptipe.runtime.launch import prepare, train
from adaptipe.runtime.manage import manage
from adaptipe.runtime.managerinfo import ManagerInfo, read_manager, write_manager
from adaptipe.runtime.planversion import adoptions
from adaptipe.runtime.repartition import repartition
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.supervisor import StageFailed
from adaptipe.runtime.worker import FAULT_ENV

ITERATIONS = 100  # a request made at iteration 5 lands long before the end


def _config(make_config: Callable[..., RunConfig], run_dir: Path) -> RunConfig:
    return make_config(
        optimizer={"name": "adam", "lr": 0.01, "momentum": 0.0},
        train={
            "iterations": ITERATIONS,
            "checkpoint_every": 20,
            "telemetry": True,
            "telemetry_interval_s": 0.1,
            "run_dir": str(run_dir),
        },
    )


def _torchrun(run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Both stages on this host through torchrun's c10d rendezvous, as on a cluster."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--max-restarts", "0",
        "-m", "adaptipe.runtime.worker", "--run-dir", str(run_dir),
    ]  # fmt: skip
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    log = (run_dir / "torchrun.log").open("wb")
    return subprocess.Popen(
        cmd, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _end(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # by its process group, which torchrun's workers share
        proc.wait()
        raise


class _Manager(threading.Thread):
    def __init__(self, run_dir: Path, **kw: Any) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.kw = run_dir, kw
        self.summary: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.summary = manage(self.run_dir, poll_s=0.02, **self.kw)
        except BaseException as exc:  # handed to the test
            self.error = exc


def _wait_marked(run: RunDir, timeout_s: float = 30) -> ManagerInfo:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = read_manager(run)
        if info is not None:
            return info
        time.sleep(0.02)
    raise AssertionError("the manager never marked itself")


def test_torchrun_workers_with_a_manager_train_what_train_trains(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    train(_config(make_config, tmp_path / "here"))
    run, _ = prepare(_config(make_config, tmp_path / "torchrun"))
    asked: list[int] = []

    def on_iteration(record: dict[str, Any], total: int) -> None:
        if not asked and record["iteration"] >= 5:
            asked.append(repartition(run.root, [0, 2, 6]).version)

    manager = _Manager(run.root, on_iteration=on_iteration, wait_s=60)
    manager.start()
    info = _wait_marked(run)
    assert info.pid == os.getpid() and info.telemetry is not None
    assert info.telemetry.startswith("tcp://127.0.0.1:") and info.curve() is None  # loopback
    assert _end(_torchrun(run.root), timeout_s=120) == 0
    manager.join(timeout=60)
    assert manager.error is None and manager.summary is not None
    assert manager.summary.iterations == ITERATIONS
    assert read_manager(run) is None  # unmarked at the end
    # telemetry reached the manager from both stages, through the run directory's record
    records = [json.loads(line) for line in run.telemetry.read_text().splitlines()]
    assert {r["stage"] for r in records if r.get("type") == "stage_stats"} == {0, 1}
    # the live re-partition was answered and moved the layers
    adopted = adoptions(run)
    assert list(adopted) == asked == [1] and 5 < adopted[1] < ITERATIONS
    control = [json.loads(line) for line in (run.root / "control.jsonl").read_text().splitlines()]
    assert [(e["event"], e["ok"]) for e in control if e["event"] == "migration"] == [
        ("migration", True)
    ]
    metrics = run.read_metrics()
    assert [r["iteration"] for r in metrics] == list(range(ITERATIONS))
    got = ckpt.load(ckpt.latest(run.checkpoints))[0]  # type: ignore[arg-type]
    want = ckpt.load(ckpt.latest(tmp_path / "here" / "checkpoints"))[0]  # type: ignore[arg-type]
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_a_failed_torchrun_worker_is_named_with_its_cause(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    run, _ = prepare(_config(make_config, tmp_path / "run"))
    manager = _Manager(run.root, wait_s=60)
    manager.start()
    _wait_marked(run)
    proc = _torchrun(run.root, env={FAULT_ENV: "1:7"})
    manager.join(timeout=90)
    _end(proc)
    assert isinstance(manager.error, StageFailed)
    assert "stage 1 failed: InjectedFault" in str(manager.error)
    assert read_manager(run) is None


def test_a_manager_waits_so_long_for_workers_that_never_come(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    run, _ = prepare(_config(make_config, tmp_path / "run"))
    with pytest.raises(StageFailed, match=r"stages \[0, 1\] unheard for 1 s; no stage has"):
        manage(run.root, wait_s=1.0, poll_s=0.02)


def test_manage_refuses_what_it_cannot_do(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    with pytest.raises(PlanError, match="not a prepared run directory"):
        manage(tmp_path)
    run, cfg = prepare(_config(make_config, tmp_path / "run"))
    with pytest.raises(PlanError, match="is a wildcard"):
        manage(run.root, bind="0.0.0.0")
    with pytest.raises(PlanError, match="is not an IP address"):
        manage(run.root, bind="somehost")
    data = cfg.to_dict()
    data["adapt"] = {"method": "restart"}
    restart, _ = prepare(RunConfig.from_dict(data, source="t.toml"), run_dir=tmp_path / "r2")
    with pytest.raises(PlanError, match="'restart' needs the launcher"):
        manage(restart.root)


def test_workers_find_the_managers_telemetry_and_keys_in_the_run_directory(
    make_config: Callable[..., RunConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adaptipe.monitor.publisher import CurveKeys

    run, cfg = prepare(_config(make_config, tmp_path / "run"))
    monkeypatch.delenv("ADAPTIPE_TELEMETRY", raising=False)
    assert telemetry_target(run, cfg) is None  # no manager: no telemetry
    keys = CurveKeys.generate()
    info = ManagerInfo.here(
        telemetry="tcp://192.0.2.1:5555",
        server_public=keys.server_public.decode(),
        client_public=keys.client_public.decode(),
        client_secret=(keys.client_secret or b"").decode(),
    )
    write_manager(run, info)
    path = run.root / "control" / "manager.json"
    assert path.stat().st_mode & 0o077 == 0  # it holds a secret key
    target = telemetry_target(run, cfg)
    assert target is not None and target[0] == "tcp://192.0.2.1:5555"
    assert target[1] == keys.for_client()
    monkeypatch.setenv("ADAPTIPE_TELEMETRY", "tcp://127.0.0.1:6000")  # adaptipe train's
    assert telemetry_target(run, cfg) == ("tcp://127.0.0.1:6000", None)
