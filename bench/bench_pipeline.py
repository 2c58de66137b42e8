"""adaptipe's pipeline executor against torch.distributed.pipelining and the limit.

Model: ``blocks`` x Linear(hidden)+ReLU (adaptipe's ``mlp`` with in = hidden = out),
MSE loss, SGD; batch 256 in 8 micro-batches; 2 stage processes with one thread each.
adaptipe runs twice: with batched weight gradients (``[pipeline].batch_weight_grads``,
reported as ``adaptipe``) and with per-micro-batch ones (``adaptipe-per-mb-wgrad``);
``--no-batch-wgrad`` or ``--batch-wgrad-only`` keeps one of them. Each pipelined run
(peer or adaptipe) is paired with a single-process single-thread run just before it,
because this machine's speed drifts by tens of percent between passes; ratios are
taken within a pair. Prints one JSON object: per schedule, throughput as a multiple of
single-process (``x_single``), of the peer (``over_peer``) and of the limit, stages x
single (``x_limit``).

    python bench/bench_pipeline.py [--pairs 2] [--iterations 20] [--schedules gpipe,1f1b]
        [--no-batch-wgrad | --batch-wgrad-only]
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

from _peer import limit, mlp_model, run_peer, run_single

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
    batch_wgrad: bool = True,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="adaptipe-bench-") as tmp:
        config = RunConfig.from_dict(
            {
                "model": mlp_model(hidden, blocks, batch * 8),
                "data": {"batch_size": batch, "microbatches": microbatches},
                "optimizer": {"name": "sgd", "lr": 1e-3},
                "pipeline": {
                    "stages": stages,
                    "schedule": schedule,
                    "batch_weight_grads": batch_wgrad,
                },
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
    wgrad = parser.add_mutually_exclusive_group()
    wgrad.add_argument(
        "--no-batch-wgrad",
        action="store_true",
        help="adaptipe computes weight gradients per micro-batch",
    )
    wgrad.add_argument(
        "--batch-wgrad-only",
        action="store_true",
        help="run adaptipe only with batched weight gradients",
    )
    args = parser.parse_args()
    mine: dict[str, bool] = {}  # name in the report -> batch_weight_grads
    if not args.no_batch_wgrad:
        mine["adaptipe"] = True
    if not args.batch_wgrad_only:
        mine["adaptipe-per-mb-wgrad"] = False
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
            for who in ("peer", *mine):
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
                        batch_wgrad=mine[who],
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

        def x_single(who: str, schedule: str = schedule) -> float:
            return statistics.median(
                r["x_single"] for r in rows if r["schedule"] == schedule and r["who"] == who
            )

        peer = x_single("peer")
        entry: dict[str, Any] = {"peer_x_single": peer, "peer_x_limit": peer / args.stages}
        for who in mine:
            entry[f"{who}_x_single"] = x_single(who)
            entry[f"{who}_over_peer"] = x_single(who) / peer
            entry[f"{who}_x_limit"] = x_single(who) / args.stages
        summary[schedule] = entry
    print(
        json.dumps(
            {
                "bench": "pipeline",
                "model": f"{args.blocks} x Linear({args.hidden})+ReLU",
                "batch": args.batch,
                "microbatches": args.microbatches,
                "stages": args.stages,
                "threads_per_process": 1,
                "adaptipe_batch_weight_grads": mine,
                "summary": summary,
                "runs": rows,
                "seconds": time.time() - started,
            }
        )
    )


if __name__ == "__main__":
    main()
