"""adaptipe's pipeline executor against torch.distributed.pipelining and the limit.

Model: ``blocks`` x Linear(hidden)+ReLU (adaptipe's ``mlp`` with in = hidden = out),
MSE loss, SGD; batch 256 in 8 micro-batches; 2 stage processes with one thread each.
Each pipelined run (peer or adaptipe) is paired with a single-process single-thread run
just before it, because this machine's speed drifts by tens of percent between passes;
ratios are taken within a pair. Prints one JSON object.

    python bench/bench_pipeline.py [--pairs 2] [--iterations 20] [--schedules gpipe,1f1b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer import limit, run_peer, run_single

from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir


def run_adaptipe(
    *,
    schedule: str,
    stages: int,
    hidden: int,
    blocks: int,
    batch: int,
    microbatches: int,
    iterations: int,
    warmup: int,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="adaptipe-bench-") as tmp:
        config = RunConfig.from_dict(
            {
                "model": {
                    "name": "mlp",
                    "config": {
                        "in_features": hidden,
                        "hidden": hidden,
                        "out_features": hidden,
                        "depth": blocks,
                        "num_samples": batch * 8,
                    },
                },
                "data": {"batch_size": batch, "microbatches": microbatches},
                "optimizer": {"name": "sgd", "lr": 1e-3},
                "pipeline": {"stages": stages, "schedule": schedule},
                "train": {
                    "iterations": warmup + iterations,
                    "threads_per_stage": 1,
                    "run_dir": f"{tmp}/run",
                },
            },
            source="bench_pipeline",
        )
        summary = train(config)
        records = RunDir(summary.run_dir).read_metrics()[warmup:]
    times = [r["iteration_s"] for r in records]
    return {
        "samples_per_s": batch * len(times) / sum(times),
        "samples_per_s_median": batch / statistics.median(times),
        "iteration_s": times,
        "stages": summary.stages,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedules", default="gpipe,1f1b")
    args = parser.parse_args()
    common = dict(
        hidden=args.hidden,
        blocks=args.blocks,
        batch=args.batch,
        iterations=args.iterations,
        warmup=args.warmup,
    )
    rows: list[dict[str, Any]] = []
    started = time.time()
    for schedule in args.schedules.split(","):
        for pair in range(args.pairs):
            for who in ("peer", "adaptipe"):
                single = run_single(threads=1, **common)["samples_per_s"]
                if who == "peer":
                    got = run_peer(
                        schedule=schedule,  # type: ignore[arg-type]
                        stages=args.stages,
                        microbatches=args.microbatches,
                        **common,
                    )["samples_per_s"]
                else:
                    got = run_adaptipe(
                        schedule=schedule,
                        stages=args.stages,
                        microbatches=args.microbatches,
                        **common,
                    )["samples_per_s"]
                rows.append(
                    {
                        "schedule": schedule,
                        "pair": pair,
                        "who": who,
                        "samples_per_s": got,
                        "single_samples_per_s": single,
                        "x_single": got / single,
                        "x_limit": got / limit(single, args.stages),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr)
    summary: dict[str, Any] = {}
    for schedule in args.schedules.split(","):
        mine = [r["x_single"] for r in rows if r["schedule"] == schedule and r["who"] == "adaptipe"]
        peer = [r["x_single"] for r in rows if r["schedule"] == schedule and r["who"] == "peer"]
        summary[schedule] = {
            "adaptipe_x_single": statistics.median(mine),
            "peer_x_single": statistics.median(peer),
            "adaptipe_over_peer": statistics.median(mine) / statistics.median(peer),
            "adaptipe_x_limit": statistics.median(mine) / args.stages,
        }
    print(
        json.dumps(
            {
                "bench": "pipeline",
                "model": f"{args.blocks} x Linear({args.hidden})+ReLU",
                "batch": args.batch,
                "microbatches": args.microbatches,
                "stages": args.stages,
                "threads_per_process": 1,
                "summary": summary,
                "runs": rows,
                "seconds": time.time() - started,
            }
        )
    )


if __name__ == "__main__":
    main()
