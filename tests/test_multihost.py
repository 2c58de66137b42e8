"""Several hosts for real: two namespace hosts on shaped links each start one stage with
torchrun (c10d rendezvous over the bed's network), `adaptipe manage` runs on a third,
telemetry reaches it over CURVE, a live `adaptipe repartition` moves layers across
hosts, and the run ends with the parameters `adaptipe train` gets on one host.

Needs root, ``ip`` and ``tc`` (skips with the reason otherwise). The bed and every
process started on it go at the end, whatever happens.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import adaptipe.runtime.checkpoint as ckpt
from adaptipe import netbed
from adaptipe.netbed import Bed, LinkShape
from adaptipe.netbed.system import namespaces
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import prepare, train
from adaptipe.runtime.planversion import adoptions
from adaptipe.runtime.repartition import repartition
from adaptipe.runtime.rundir import RunDir
from tests._bed_runs import start_manager, torchrun_stage, wait_marked

REASON = netbed.available()
ITERATIONS = 100  # a request made at iteration 5 lands long before the end
PORT = 29517  # rendezvous port on host 1 (its namespace has nothing else)


@pytest.fixture
def bed(tmp_path: Path) -> Iterator[Bed]:
    if REASON is not None:
        pytest.skip(REASON)
    prefix = "mh" + secrets.token_hex(2)
    state = tmp_path / "netbed"
    made = netbed.up(prefix=prefix, hosts=3, shape=LinkShape(rate_mbit=200), state_dir=state)
    try:
        yield made
    finally:
        netbed.down(prefix=prefix, state_dir=state)  # also stops what still runs on it
        assert not [n for n in namespaces() if prefix in n]


def _config(make_config: Callable[..., RunConfig], run_dir: Path) -> RunConfig:
    return make_config(
        optimizer={"name": "adam", "lr": 0.01, "momentum": 0.0},
        train={
            "iterations": ITERATIONS,
            "checkpoint_every": 30,
            "telemetry": True,
            "telemetry_interval_s": 0.1,
            "threads_per_stage": 1,
            "run_dir": str(run_dir),
        },
    )


def _wait(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    return [p.poll() for p in procs]


def test_two_namespace_hosts_with_torchrun_and_a_manager_train_what_one_host_trains(
    make_config: Callable[..., RunConfig], tmp_path: Path, bed: Bed
) -> None:
    train(_config(make_config, tmp_path / "one-host"))
    run, _ = prepare(_config(make_config, tmp_path / "hosts"))
    manager_host, head, other = bed.hosts
    manager = start_manager(manager_host, run)
    procs: list[subprocess.Popen[bytes]] = [manager]
    try:
        info = wait_marked(run, manager)
        assert info.telemetry is not None
        assert info.telemetry.startswith(f"tcp://{manager_host.address}:")
        assert info.curve() is not None  # off loopback: CURVE
        procs += [
            torchrun_stage(head, 0, head, run.root, port=PORT),
            torchrun_stage(other, 1, head, run.root, port=PORT),
        ]
        asked: list[int] = []
        deadline = time.monotonic() + 120
        while not asked and time.monotonic() < deadline:  # a live request across hosts
            if run.metrics.exists() and len(run.metrics.read_text().splitlines()) >= 5:
                asked.append(repartition(run.root, [0, 2, 6]).version)
            time.sleep(0.05)
        codes = _wait(procs, timeout_s=180)
        out, err = manager.communicate(timeout=10)
        logs = "\n".join((run.root / f"torchrun-{n}.log").read_text()[-1500:] for n in (0, 1))
        assert codes == [0, 0, 0], f"{codes}\n{err.decode()[-2000:]}\n{logs}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # by pid; the bed's teardown ends the rest
                proc.wait(timeout=10)
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["iterations"] == ITERATIONS
    adopted = adoptions(RunDir(run.root))
    assert list(adopted) == asked == [1] and adopted[1] < ITERATIONS
    telemetry = [json.loads(line) for line in run.telemetry.read_text().splitlines()]
    assert {r["stage"] for r in telemetry if r.get("type") == "stage_stats"} == {0, 1}
    got = ckpt.load(ckpt.latest(run.checkpoints))[0]  # type: ignore[arg-type]
    want = ckpt.load(ckpt.latest(tmp_path / "one-host" / "checkpoints"))[0]  # type: ignore[arg-type]
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("rate", [20, 80])
def test_the_link_probe_between_two_hosts_measures_at_most_the_shaped_rate(
    tmp_path: Path, rate: int
) -> None:
    """``adaptipe link --bed``: gloo round trips between two hosts over links shaped to
    ``rate`` Mbit/s measure a bandwidth at or below it (and not far below)."""
    from adaptipe.cli import main

    if REASON is not None:
        pytest.skip(REASON)
    prefix = "lk" + secrets.token_hex(2)
    state = tmp_path / "netbed"
    netbed.up(prefix=prefix, hosts=2, shape=LinkShape(rate_mbit=rate), state_dir=state)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "adaptipe.cli", "link", "--bed", prefix,
             "--state-dir", str(state), "--repeats", "5", "--json"],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        result = json.loads(out.stdout.strip().splitlines()[-1])
        mbit = result["bandwidth_Bps"] * 8 / 1e6
        assert 0.6 * rate <= mbit <= rate * 1.02, (mbit, rate)
        assert result["latency_s"] < 0.01
        assert main(["link", "--bed", prefix, "--state-dir", str(state), "--hosts", "1,1"]) == 2
    finally:
        netbed.down(prefix=prefix, state_dir=state)
