"""Replicated stages (PipeDream 1F1B-RR) against the same stages unreplicated.

Model: ``blocks`` x Linear(hidden)+ReLU (adaptipe's ``mlp``, in = hidden = out), SGD,
one thread per process. Each case trains the same partition twice, unreplicated
(``[pipeline].replicas`` all 1) and replicated, in alternating pairs (this machine's
speed drifts between passes; ratios are taken within a pair), and reports the
throughput ratio replicated / unreplicated (median over pairs) next to the ideal one
(what the slowest stage's share of the work allows) and the replicated run's processes.

Default cases (2 stages): ``uneven`` puts a third of the blocks on stage 0 and
two thirds on stage 1, which is replicated twice ([1, 2]: 3 processes, ideal 2x);
``both`` splits evenly and replicates both stages ([2, 2]: 4 processes, ideal 2x).
Each process wants a core of its own: on a machine with fewer cores than processes
the ratio says nothing about replication.

    python bench/bench_replicas.py [--pairs 3] [--iterations 20] [--schedules gpipe,1f1b]
        [--cases uneven,both] [--hidden 512] [--blocks 12] [--batch 128] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer import mlp_model

from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir


def _cases(blocks: int) -> dict[str, tuple[list[int], list[int]]]:
    """Case name -> (partition bounds, replicas)."""
    third = max(1, blocks // 3)
    half = blocks // 2
    return {
        "uneven": ([0, third, blocks], [1, 2]),
        "both": ([0, half, blocks], [2, 2]),
    }


def run_case(
    *,
    schedule: str,
    bounds: list[int],
    replicas: list[int],
    hidden: int,
    blocks: int,
    batch: int,
    microbatches: int,
    iterations: int,
    warmup: int,
) -> dict[str, Any]:
    """Train once; samples/s over the iterations after ``warmup`` (merged records)."""
    with tempfile.TemporaryDirectory(prefix="adaptipe-bench-replicas-") as tmp:
        config = RunConfig.from_dict(
            {
                "model": mlp_model(hidden, blocks, batch * 8),
                "data": {"batch_size": batch, "microbatches": microbatches},
                "optimizer": {"name": "sgd", "lr": 1e-3},
                "pipeline": {
                    "stages": len(bounds) - 1,
                    "schedule": schedule,
                    "partition": bounds,
                    "replicas": replicas,
                },
                "train": {
                    "iterations": warmup + iterations,
                    "threads_per_stage": 1,
                    "telemetry": False,
                    "tensorboard": False,
                    "run_dir": f"{tmp}/run",
                },
            },
            source="bench_replicas",
        )
        started = time.perf_counter()
        summary = train(config)
        wall = time.perf_counter() - started
        records = RunDir(summary.run_dir).read_metrics()[warmup:]
    times = [r["iteration_s"] for r in records]
    return {
        "samples_per_s": batch * len(times) / sum(times),
        "iteration_s_median": statistics.median(times),
        "wall_s": wall,
    }


def ideal_ratio(bounds: list[int], replicas: list[int]) -> float:
    """Slowest stage's layers unreplicated over the slowest per replica (equal layers)."""
    layers = [b - a for a, b in itertools.pairwise(bounds)]
    return max(layers) / max(n / r for n, r in zip(layers, replicas, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--cases", default="uneven,both")
    args = parser.parse_args()
    cases = _cases(args.blocks)
    common = dict(
        hidden=args.hidden,
        blocks=args.blocks,
        batch=args.batch,
        microbatches=args.microbatches,
        iterations=args.iterations,
        warmup=args.warmup,
    )
    rows: list[dict[str, Any]] = []
    started = time.time()
    for schedule in args.schedules.split(","):
        for case in args.cases.split(","):
            bounds, replicas = cases[case]
            for pair in range(args.pairs):
                got = {}
                for label, reps in (("base", [1] * len(replicas)), ("replicated", replicas)):
                    got[label] = run_case(schedule=schedule, bounds=bounds, replicas=reps, **common)
                row = {
                    "schedule": schedule,
                    "case": case,
                    "pair": pair,
                    "base_samples_per_s": got["base"]["samples_per_s"],
                    "replicated_samples_per_s": got["replicated"]["samples_per_s"],
                    "ratio": got["replicated"]["samples_per_s"] / got["base"]["samples_per_s"],
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    summary: dict[str, Any] = {}
    for schedule in args.schedules.split(","):
        for case in args.cases.split(","):
            bounds, replicas = cases[case]
            mine = [r for r in rows if r["schedule"] == schedule and r["case"] == case]
            summary[f"{schedule}/{case}"] = {
                "bounds": bounds,
                "replicas": replicas,
                "processes": {"base": len(replicas), "replicated": sum(replicas)},
                "ratio_median": statistics.median(r["ratio"] for r in mine),
                "ratio_min": min(r["ratio"] for r in mine),
                "ratio_max": max(r["ratio"] for r in mine),
                "ideal_ratio": ideal_ratio(bounds, replicas),
                "base_samples_per_s_median": statistics.median(
                    r["base_samples_per_s"] for r in mine
                ),
            }
    report = {
        "bench": "replicas",
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "settings": vars(args),
        "summary": summary,
        "rows": rows,
        "seconds": time.time() - started,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
