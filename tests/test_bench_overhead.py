"""The pure helpers of bench/bench_overhead.py and bench/_threadcpu.py: reading /proc lines, naming threads,
splitting a process's CPU between two snapshots, the window and the decision figures."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from adaptipe.monitor.threadname import name_os_thread
from bench._threadcpu import (
    TICK_S,
    ProcCpu,
    Snapshot,
    ThreadCpu,
    account,
    kind,
    parse_schedstat,
    parse_stat,
    read_proc,
    split,
    window,
)
from bench.bench_overhead import adapt_overrides, decisions

# A stat line whose name holds a space and a ')' (fields after it as stat(5) lists them).
STAT = "4242 (we) ird) S 1 4242 4242 0 -1 4194560 900 0 0 0 150 25 0 0 20 0 3 0 777 " + ("0 " * 30)


def test_a_stat_line_gives_the_name_the_start_and_utime_plus_stime() -> None:
    comm, start, cpu_s = parse_stat(STAT)
    assert (comm, start) == ("we) ird", 777)
    assert cpu_s == pytest.approx(175 * TICK_S)


def test_schedstat_is_nanoseconds_on_a_cpu() -> None:
    assert parse_schedstat("2500000000 12345 67\n") == pytest.approx(2.5)


def test_this_process_reads_back_with_a_named_thread() -> None:
    started, stop = threading.Event(), threading.Event()

    def body() -> None:
        name_os_thread("adaptipe-sampler")  # 16 bytes: Linux keeps 15
        started.set()
        stop.wait(5)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    started.wait(5)
    try:
        got = read_proc(os.getpid())
    finally:
        stop.set()
        t.join(5)
    assert got is not None and got.cpu_s > 0
    assert got.threads[t.native_id].comm == "adaptipe-sample"
    assert got.threads[os.getpid()].cpu_s > 0


@pytest.mark.parametrize(
    ("comm", "tid", "manager", "want"),
    [
        ("python", 10, True, "main"),
        ("adaptipe-collec", 11, True, "collector"),
        ("ZMQbg/IO/0", 12, True, "zmq"),
        ("bench-sampler", 13, True, "bench"),
        ("python", 14, True, "other"),
        ("python", 10, False, "training"),
        ("adaptipe-sample", 11, False, "sampler"),
        ("ZMQbg/Reaper", 12, False, "zmq"),
        ("adaptipe-l0-1", 13, False, "link"),
        ("gloo_tcp_loop", 14, False, "other"),
    ],
)
def test_threads_are_told_apart_by_tid_and_name(
    comm: str, tid: int, manager: bool, want: str
) -> None:
    assert kind(comm, tid=tid, pid=10, manager=manager) == want


def _proc(total: float, **threads: tuple[str, int, float]) -> ProcCpu:
    return ProcCpu(
        cpu_s=total,
        threads={
            int(tid[1:]): ThreadCpu(comm=c, start=s, cpu_s=x) for tid, (c, s, x) in threads.items()
        },
    )


def test_split_counts_differences_new_threads_whole_and_the_rest_as_exited() -> None:
    before = _proc(
        5.0, t10=("python", 1, 3.0), t11=("adaptipe-collec", 2, 1.0), t12=("python", 3, 0.5)
    )
    # t12 ended (0.2 s more before it did), t13 was born; tid 11 is the same thread
    after = _proc(
        6.0, t10=("python", 1, 3.5), t11=("adaptipe-collec", 2, 1.1), t13=("python", 9, 0.1)
    )
    got = split(before, after, pid=10, manager=True)
    assert got["main"] == pytest.approx(0.5)
    assert got["collector"] == pytest.approx(0.1)
    assert got["other"] == pytest.approx(0.1)
    assert got["exited"] == pytest.approx(0.3)  # 1.0 in all, less 0.7 by live threads


def test_a_reused_tid_counts_as_a_new_thread() -> None:
    before = _proc(2.0, t11=("python", 2, 1.5))
    after = _proc(2.5, t11=("python", 8, 0.25))
    assert split(before, after, pid=10, manager=False)["other"] == pytest.approx(0.25)


def test_the_window_ends_before_a_stage_finished_its_last_iteration() -> None:
    alive = {1: _proc(0.0), 7: _proc(0.0), 8: _proc(0.0)}
    snaps = [Snapshot(float(t), alive) for t in range(10)]
    snaps[9] = Snapshot(9.0, {1: _proc(0.0), 7: _proc(0.0)})  # stage 8 gone
    ends = {7: [1.0, 6.5], 8: [1.0, 9.5]}
    assert window(snaps, 2, ends) == (2, 6)
    with pytest.raises(RuntimeError, match="fewer than 2"):
        window(snaps, 6, ends)


def test_account_divides_by_the_iterations_the_stages_finished_in_the_window() -> None:
    snaps = [
        Snapshot(0.0, {1: _proc(1.0, t1=("python", 1, 1.0)), 7: _proc(2.0, t7=("python", 1, 2.0))}),
        Snapshot(
            4.0,
            {
                1: _proc(1.4, t1=("python", 1, 1.2), t3=("adaptipe-collec", 5, 0.2)),
                7: _proc(4.1, t7=("python", 1, 4.0), t8=("adaptipe-sample", 5, 0.1)),
            },
        ),
    ]
    ends = {7: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}  # 4 iterations between t=0 and t=4
    acc = account(snaps, 0, 1, 1, ends)
    assert acc.iterations == pytest.approx(4.0)
    assert acc.manager["main"] == pytest.approx(0.05)
    assert acc.monitor_manager() == pytest.approx(0.05)  # the collector's 0.2 s
    assert acc.monitor_stage() == pytest.approx(0.025)
    assert acc.training() == pytest.approx(0.5)


def test_decisions_give_the_calls_seconds_median_p99_and_max(tmp_path: Path) -> None:
    path = tmp_path / "control.jsonl"
    lines = [
        {"event": "decision", "seconds": s / 1e3, "cpu_seconds": s / 2e3, "acted": False}
        for s in (1, 2, 3, 40)
    ]
    lines[0]["decision"] = {"bounds": None, "reason": "unchanged since iteration 3: kept"}
    lines[0]["inputs"] = {"measured_ms": 1.0, "unchanged_since": 3}
    lines += [{"event": "migration", "ok": True}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = decisions(path)
    assert got["count"] == 4 and got["median_ms"] == pytest.approx(2.5)
    assert got["p99_ms"] == pytest.approx(40) and got["max_ms"] == pytest.approx(40)
    assert got["migrations"] == 1 and got["acted"] == 0 and got["over_10ms"] == 1
    assert got["unchanged"] == 1
    assert got["cpu_median_ms"] == pytest.approx(1.25) and got["cpu_max_ms"] == pytest.approx(20)
    assert decisions(tmp_path / "missing.jsonl") == {"count": 0}


def test_adapt_overrides_read_each_value_as_toml() -> None:
    got = adapt_overrides(["check_every=1", "unchanged = 0", 'controller="ppo"'])
    assert got == {"check_every": 1, "unchanged": 0, "controller": "ppo"}
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        adapt_overrides(["unchanged"])
