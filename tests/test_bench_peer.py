"""Smoke tests for bench/_peer.py: the single-process reference and the
torch.distributed.pipelining peer, on a tiny model, leave no child process behind."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import pytest

from bench import _peer

TINY: dict[str, Any] = {"hidden": 32, "blocks": 4, "batch": 16, "iterations": 2, "warmup": 1}


def _dead(pid: int) -> bool:
    """True when no process with this pid exists (children are reaped by the runner)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _assert_all_dead(pids: list[int]) -> None:
    deadline = time.monotonic() + 5.0
    while not all(_dead(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_dead(p) for p in pids), [p for p in pids if not _dead(p)]


def _check_timing(out: dict[str, Any], iterations: int) -> None:
    assert out["samples_per_s"] > 0 and math.isfinite(out["samples_per_s"])
    assert out["samples_per_s_median"] > 0
    assert len(out["iteration_s"]) == iterations
    assert all(t > 0 for t in out["iteration_s"])
    assert math.isfinite(out["final_loss"])


def test_split_blocks_and_limit() -> None:
    assert _peer.split_blocks(16, 2) == [(0, 8), (8, 16)]
    assert _peer.split_blocks(5, 3) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError):
        _peer.split_blocks(2, 3)
    assert _peer.limit(100.0, 2) == 200.0


@pytest.mark.slow  # 12-25 s on the shared 2-core machine (3 child launches)
def test_single_and_peer_smoke() -> None:
    single = _peer.run_single(**TINY, microbatches=4)
    _check_timing(single, 2)
    assert single["bench"] == "single" and single["microbatches"] == 4
    assert len(single["pids"]) == 1
    _assert_all_dead(single["pids"])

    for schedule in _peer.SCHEDULES:
        out = _peer.run_peer(schedule=schedule, **TINY, microbatches=4, timeout_s=120)
        _check_timing(out, 2)
        assert out["schedule"] == schedule and out["stages"] == 2
        assert out["rank_blocks"] == [[0, 2], [2, 4]]
        assert len(out["rank_iteration_s"]) == 2 and len(out["rank_cpu_s"]) == 2
        cpus = os.cpu_count() or 1
        assert out["rank_cores"] == [[0], [1 % cpus]]
        # Same seed, model, data and update: the pipeline reproduces the reference loss.
        assert out["final_loss"] == pytest.approx(single["final_loss"], rel=1e-4)
        assert len(out["pids"]) == 2
        _assert_all_dead(out["pids"])


def test_peer_timeout_kills_children() -> None:
    with pytest.raises(_peer.PeerRunError) as info:
        _peer.run_peer(schedule="gpipe", **TINY, microbatches=4, timeout_s=0.2)
    assert "timed out" in str(info.value)
    assert len(info.value.pids) == 2
    _assert_all_dead(info.value.pids)


def test_concurrent_singles_run_one_pinned_process_per_core() -> None:
    out = _peer.run_concurrent_singles(2, **TINY)
    assert len(out["each"]) == 2 and all(r > 0 and math.isfinite(r) for r in out["each"])
    assert out["samples_per_s"] == pytest.approx(sum(out["each"]))
    assert len(out["pids"]) == 2
    _assert_all_dead(out["pids"])
