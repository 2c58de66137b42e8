"""Running injections: hogs really load their cores and memory, and no child outlives its run."""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptipe.cli.inject import add_parser as add_inject_parser
from adaptipe.cli.inject import run as run_inject_command
from adaptipe.errors import PlanError
from adaptipe.inject import (
    Event,
    ScenarioRunner,
    Throttle,
    inject,
    read_slowdowns,
    read_throttles,
)
from adaptipe.inject.injectors import ChildFailed, HogProcesses
from adaptipe.inject.scenario import parse_scenario

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")  # a zombie has let go of all


def _cpu_seconds(pid: int) -> float:
    fields = _stat(pid)
    assert fields is not None, f"process {pid} is gone"
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Pids a test saw; any still alive at the end are killed by pid."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _scenario(*injections: dict[str, Any], stages: int = 2) -> Any:
    return parse_scenario({"inject": list(injections)}, source="t.toml", num_stages=stages)


@pytest.mark.parametrize("method", ["spin", "matmul"])
def test_cpu_hog_burns_its_core_and_is_gone_after_stop(method: str, reap: list[int]) -> None:
    core = max(os.sched_getaffinity(0))
    with inject("cpu_hog", cores=[core], method=method) as hog:
        (pid,) = hog.pids()
        reap.append(pid)
        assert os.sched_getaffinity(pid) == {core}
        deadline = time.monotonic() + 1.5  # ~0.4 s on an idle core; slack for busy machines
        while _cpu_seconds(pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _cpu_seconds(pid) >= 0.3
        assert int((_stat(pid) or [])[36]) == core  # the CPU it last ran on
    assert not _alive(pid)


def test_hog_threads_are_processes_and_intensity_is_a_duty_cycle(reap: list[int]) -> None:
    with inject("cpu_hog", threads=2, intensity=0.25) as hog:
        pids = list(hog.pids())
        reap.extend(pids)
        assert len(pids) == 2
        before = [_cpu_seconds(p) for p in pids]
        time.sleep(1.0)
        used = [_cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
    assert all(0.1 <= u <= 0.5 for u in used), used  # about 0.25 s of each second
    assert _gone_within(pids, 0)


def test_memory_injector_holds_about_the_requested_rss_and_releases_it(reap: list[int]) -> None:
    size = int(0.2 * 2**30)
    with inject("memory", gib=0.2) as held:
        (pid,) = held.pids()
        reap.append(pid)
        rss = _rss_bytes(pid)
        assert 0.95 * size <= rss <= size + 64 * 2**20
    assert not _alive(pid)
    with inject("memory", gib=0.2, touch=False) as reserved:
        (pid,) = reserved.pids()
        reap.append(pid)
        assert _rss_bytes(pid) < 0.25 * size  # reserved, not resident


def test_events_come_in_order_with_each_start_before_its_end(tmp_path: Path) -> None:
    events: list[Event] = []
    scenario = _scenario(
        # Margins of 0.7 s between events keep the order robust on a loaded 2-core machine.
        {"kind": "slowdown", "at_s": 0, "duration_s": 1.0, "stage": 0, "factor": 3},
        {
            "kind": "link_throttle",
            "at_s": 0.3,
            "duration_s": 1.0,
            "stage": 1,
            "extra_latency_s": 0.01,
        },
    )
    with ScenarioRunner(scenario, on_event=events.append, control_dir=tmp_path) as runner:
        assert runner.wait(timeout=5)
    order = [(e.kind, e.detail["origin"]) for e in events]
    assert order == [
        ("injection-start", "inject[0]"),
        ("injection-start", "inject[1]"),
        ("injection-end", "inject[0]"),
        ("injection-end", "inject[1]"),
    ]
    assert events == runner.events
    assert [e.time for e in events] == sorted(e.time for e in events)
    start, end = events[0], events[2]
    assert (start.injector, start.stage, start.detail["factor"]) == ("slowdown", 0, 3.0)
    # The scenario is a timeline: the end is due at at_s + duration_s on the runner's
    # clock (never early), whenever the start's event came (an injector takes a while to
    # get ready on a loaded machine: 0.09 s once in CI-like runs).
    assert 1.0 <= end.elapsed_s < 3.0 and start.elapsed_s < end.elapsed_s
    assert start.time < end.time
    assert end.detail["reason"] == "done"


def test_iteration_keyed_injections_follow_on_iteration(tmp_path: Path) -> None:
    events: list[Event] = []
    scenario = _scenario(
        {"kind": "slowdown", "at_iteration": 2, "iterations": 3, "stage": 1, "factor": 2},
        {"kind": "slowdown", "at_iteration": 1, "iterations": 1, "stage": 0},
    )
    active: dict[int, dict[int, float]] = {}
    with ScenarioRunner(scenario, on_event=events.append, control_dir=tmp_path) as runner:
        with pytest.raises(RuntimeError, match="already started"):
            runner.start()
        for i in range(8):
            runner.on_iteration(i)
            active[i] = read_slowdowns(tmp_path)
        assert runner.wait(timeout=1)  # nothing keyed by seconds
    assert active == {
        0: {},
        1: {0: 2.0},
        2: {1: 2.0},
        3: {1: 2.0},
        4: {1: 2.0},
        5: {},
        6: {},
        7: {},
    }
    assert [(e.kind, e.detail["origin"]) for e in events] == [
        ("injection-start", "inject[1]"),
        ("injection-end", "inject[1]"),
        ("injection-start", "inject[0]"),
        ("injection-end", "inject[0]"),
    ]
    with pytest.raises(RuntimeError, match=r"start\(\) the ScenarioRunner"):
        ScenarioRunner(scenario).on_iteration(0)


def test_kill_injections_call_kill_stage() -> None:
    killed: list[int] = []
    with inject("kill", stage=1, num_stages=2, kill_stage=killed.append) as runner:
        assert killed == [1]
    assert [e.kind for e in runner.events] == ["injection-start", "injection-end"]

    killed.clear()
    scenario = _scenario(
        {"kind": "kill", "at_s": 0, "duration_s": 0.35, "stage": 0, "period_s": 0.1},
        {"kind": "kill", "at_iteration": 0, "iterations": 7, "stage": 1, "period_iterations": 2},
    )
    with ScenarioRunner(scenario, kill_stage=killed.append) as runner:
        for i in range(10):
            runner.on_iteration(i)  # draws at iterations 2, 4 and 6
        assert runner.wait(timeout=5)  # draws at 0.1, 0.2 and 0.3 s
    assert sorted(killed) == [0, 0, 0, 1, 1, 1]

    with pytest.raises(PlanError, match=r"t.toml: inject\[0\] kills a stage; give kill_stage"):
        ScenarioRunner(scenario)


def test_random_preemption_is_seeded() -> None:
    scenario = _scenario(
        {"kind": "kill", "at_iteration": 0, "stage": 0, "p": 0.5, "period_iterations": 1}
    )
    counts = []
    for seed in (4, 4, 5):
        killed: list[int] = []
        with ScenarioRunner(scenario, kill_stage=killed.append, seed=seed) as runner:
            for i in range(201):
                runner.on_iteration(i)
        counts.append(len(killed))
    assert counts[0] == counts[1] and 60 < counts[0] < 140
    assert runner.events[0].detail["p"] == 0.5


def test_control_files_appear_during_and_vanish_after(tmp_path: Path) -> None:
    scenario = _scenario(
        {"kind": "link_throttle", "at_s": 0, "stage": 1, "bandwidth": "100MB/s"},
        {"kind": "link_throttle", "at_s": 0, "stage": 1, "extra_latency_s": 0.005},
        {"kind": "slowdown", "at_s": 0, "stage": 0, "factor": 2.5},
    )
    with ScenarioRunner(scenario, control_dir=tmp_path):
        assert read_throttles(tmp_path) == {1: Throttle(1, 1e8, 0.005)}
        assert read_throttles(tmp_path)[1].delay_s(10**6) == pytest.approx(0.015)
        assert read_slowdowns(tmp_path) == {0: 2.5}
        assert len(list(tmp_path.glob("*.json"))) == 3
    assert read_throttles(tmp_path) == {} and read_slowdowns(tmp_path) == {}
    assert list(tmp_path.iterdir()) == []

    with ScenarioRunner(scenario) as runner:  # a temporary control folder of its own
        assert runner.control_dir is not None and read_slowdowns(runner.control_dir) == {0: 2.5}
    assert not runner.control_dir.exists()
    assert read_throttles(tmp_path / "missing") == {}


def test_stop_ends_every_running_injection(reap: list[int]) -> None:
    scenario = _scenario(
        {"kind": "cpu_hog", "at_s": 0, "threads": 2, "intensity": 0.2},
        {"kind": "memory", "at_s": 0, "gib": 0.05},
        {"kind": "memory", "at_s": 30, "gib": 0.05},  # never reached
    )
    runner = ScenarioRunner(scenario)
    runner.start()
    pids = list(runner.pids())
    reap.extend(pids)
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    assert not runner.wait(timeout=0.1)
    runner.stop()
    assert not any(_alive(p) for p in pids) and runner.pids() == ()
    ends = [e for e in runner.events if e.kind == "injection-end"]
    assert [e.detail["reason"] for e in ends] == ["stopped", "stopped"]


def test_a_child_that_fails_is_reported_not_hung_on(reap: list[int]) -> None:
    hog = HogProcesses([{"load": "no-such-load"}])
    hog.start()
    reap.extend(hog.pids)
    with pytest.raises(ChildFailed, match=r"exited with code 1: KeyError: 'no-such-load'"):
        hog.wait_ready(10)
    hog.stop()
    assert not _alive(hog.pids[0])


def test_killing_the_parent_leaves_no_injector_alive(reap: list[int]) -> None:
    script = textwrap.dedent(
        """
        import time
        from adaptipe.inject import inject
        with inject("cpu_hog", threads=2, intensity=0.1) as hog, inject("memory", gib=0.05) as mem:
            print(*hog.pids(), *mem.pids(), flush=True)
            time.sleep(60)
        """
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE
    )
    reap.append(parent.pid)
    try:
        assert parent.stdout is not None
        readable, _, _ = select.select([parent.stdout], [], [], 30)
        assert readable, "the runner process did not start its injections"
        pids = [int(p) for p in parent.stdout.readline().split()]
        reap.extend(pids)
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _gone_within(pids, 3.0), [p for p in pids if _alive(p)]
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def test_inject_command_runs_a_scenario_in_the_foreground(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        '[[inject]]\nkind = "slowdown"\nat_s = 0\nduration_s = 0.2\nstage = 1\n'
        '[[inject]]\nkind = "kill"\nat_s = 0.1\nstage = 0\n'
        '[[inject]]\nkind = "slowdown"\nat_iteration = 3\nstage = 0\n'
    )
    parser = argparse.ArgumentParser()
    add_inject_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["inject", str(path), "--stages", "2", "--control-dir", str(tmp_path / "c")]
    )
    assert run_inject_command(args) == 0
    out = capsys.readouterr().out
    assert "2 timed, 1 iteration-keyed" in out and "skipped here" in out
    assert "start  slowdown stage 1 (inject[0])" in out
    assert "stage 0 would be killed" in out
    assert "end    slowdown stage 1 (inject[0]) reason=done" in out
    assert list((tmp_path / "c").iterdir()) == []
