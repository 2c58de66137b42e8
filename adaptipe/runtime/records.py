"""What a stage worker writes about each iteration: metrics records and telemetry.

``RUN_DIR/stage-metrics/stage-N.jsonl`` gets one record per iteration (a job-array
window's iterations share its time evenly), plus events (ready, checkpoint, active,
plan, done); telemetry gets one `StageStats` per iteration.
"""

from __future__ import annotations

import math
import resource
import time
from typing import Any, TextIO

import torch

from adaptipe.monitor.schema import StageStats
from adaptipe.runtime.iteration_stats import IterationStats
from adaptipe.runtime.memory import MemoryManager
from adaptipe.runtime.rundir import RunDir
from adaptipe.serial import json_line

__all__ = [
    "done_record",
    "iteration_record",
    "log",
    "log_window",
    "per_iteration",
    "stage_stats",
]


def iteration_record(
    stats: IterationStats,
    *,
    iteration: int,
    stage: int,
    rounds: int,
    per_round: int,
    round_index: int,
    end_time: float,
) -> dict[str, Any]:
    """One iteration's metrics record; a window's iterations share its times evenly."""
    record: dict[str, Any] = {
        "iteration": iteration,
        "stage": stage,
        "compute_s": stats.compute_s / rounds,
        "wait_s": stats.wait_s / rounds,
        "comm_s": stats.comm_s / rounds,
        "iteration_s": stats.iteration_s / rounds,
        "in_flight": stats.max_in_flight,
        "end_time": end_time,
    }
    if rounds > 1:
        record["window"] = rounds
    if stats.resident_jobs:  # a job-array
        record["resident_jobs"] = stats.resident_jobs
        record["state_wait_s"] = stats.state_wait_s / rounds
        if round_index == 0:  # a window's loads on demand, counted once
            record["state_misses"] = stats.state_misses
    group = range(round_index * per_round, (round_index + 1) * per_round)
    losses: dict[str, float] = {}
    for (j, mb), value in sorted(stats.microbatch_losses.items()):
        if mb in group:
            losses[str(j)] = losses.get(str(j), 0.0) + value / per_round
    if losses:
        # Mean loss of each job's mini-batch; "loss" is the mean over the jobs.
        record["losses"] = losses
        record["loss"] = sum(losses.values()) / len(losses)
    return record


def per_iteration(stats: IterationStats, rounds: int) -> IterationStats:
    """A window's stats as one iteration's average (telemetry)."""
    if rounds == 1:
        return stats
    return IterationStats(
        compute_s=stats.compute_s / rounds,
        wait_s=stats.wait_s / rounds,
        comm_s=stats.comm_s / rounds,
        iteration_s=stats.iteration_s / rounds,
        loss=stats.loss,  # already a mean over the window's rounds
        layer_forward_s={i: t / rounds for i, t in stats.layer_forward_s.items()},
        layer_backward_s={i: t / rounds for i, t in stats.layer_backward_s.items()},
        max_in_flight=stats.max_in_flight,
        resident_jobs=stats.resident_jobs,
        state_wait_s=stats.state_wait_s / rounds,
        state_misses=stats.state_misses,
    )


def _memory(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS, KiB on Linux
    return rss, rss


def stage_stats(
    run: RunDir,
    rank: int,
    it: int,
    stats: IterationStats,
    chunks: list[list[Any]],
    device: torch.device,
    time_s: float | None = None,
    plan_version: int = 0,
) -> StageStats:
    layers = [slot.index for chunk in chunks for slot in chunk]
    contiguous = layers == list(range(layers[0], layers[0] + len(layers))) if layers else False
    allocated, reserved = _memory(device)
    return StageStats(
        run_id=run.root.name,
        stage=rank,
        iteration=it,
        time_s=time.time() if time_s is None else time_s,
        first_layer=layers[0] if contiguous else 0,
        forward_s=tuple(stats.layer_forward_s.get(i, 0.0) for i in layers) if contiguous else (),
        backward_s=tuple(stats.layer_backward_s.get(i, 0.0) for i in layers) if contiguous else (),
        compute_s=stats.compute_s,
        wait_s=stats.wait_s,
        comm_s=stats.comm_s,
        iteration_s=stats.iteration_s,
        in_flight=stats.max_in_flight,
        memory_allocated_bytes=allocated,
        memory_reserved_bytes=reserved,
        # A diverged job's NaN stays in the metrics log; telemetry carries numbers only.
        loss=None if stats.loss is None or math.isnan(stats.loss) else stats.loss,
        resident_jobs=stats.resident_jobs,
        state_wait_s=stats.state_wait_s,
        plan_version=plan_version,
    )


def log(fh: TextIO, record: dict[str, Any]) -> None:
    record.setdefault("time", time.time())
    fh.write(json_line(record))
    fh.flush()


def log_window(
    fh: TextIO,
    stats: IterationStats,
    *,
    start: int,
    stop: int,
    times: tuple[float, float],
    stage: int,
    per_round: int,
) -> None:
    """Log one record per iteration of the window ``start..stop`` that ran from
    ``times[0]`` to ``times[1]`` (its iterations share its time evenly)."""
    rounds, (begun, ended) = stop - start, times
    for r in range(rounds):
        record = iteration_record(
            stats,
            iteration=start + r,
            stage=stage,
            rounds=rounds,
            per_round=per_round,
            round_index=r,
            end_time=begun + (ended - begun) * (r + 1) / rounds,
        )
        log(fh, record)


def done_record(rank: int, steps: int, memory: MemoryManager | None) -> dict[str, Any]:
    """The record a stage writes when its last iteration is done."""
    record: dict[str, Any] = {"event": "done", "stage": rank, "steps": steps}
    if memory is not None and memory.enabled:
        record["memory"] = {
            "budget": memory.budget,
            "peak_resident": memory.peak_resident,
            "hits": memory.hits,
            "misses": memory.misses,
            "prefetches": memory.prefetches,
            "evictions": memory.evictions,
            "wait_s": memory.wait_s,
        }
    return record
