"""Job-arrays against training the same sibling jobs one after another.

Peer: each job trained alone by ``torch.distributed.pipelining`` (Schedule1F1B and
ScheduleGPipe, at their best micro-batch count among 2, 4, 8) over 2 stage processes;
sequential training of J identical-size jobs runs at one job's throughput. adaptipe:
the J jobs as one job-array through one 2-stage pipeline (each job's mini-batch one
block, block order from the JAPSP solver, ``--windows`` iterations scheduled as one
window). Limit: one single-thread process times 2. Each contender is paired with a
single-process run just before it. Prints one JSON object.

    python bench/bench_jobarray.py [--jobs 4,8] [--iterations 12] [--windows 1,4]
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

from _peer import mlp_model, run_concurrent_singles, run_peer, run_single

from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir


def run_array(
    *,
    jobs: int,
    hidden: int,
    blocks: int,
    batch: int,
    iterations: int,
    warmup: int,
    solver: str,
    window: int,
) -> dict[str, Any]:
    warmup = -(-warmup // window) * window  # whole windows: the first holds start-up costs
    lrs = [1e-3 * (1 + j) for j in range(jobs)]
    with tempfile.TemporaryDirectory(prefix="adaptipe-jobarray-") as tmp:
        config = RunConfig.from_dict(
            {
                "model": mlp_model(hidden, blocks, batch * 4),
                "data": {"batch_size": batch, "microbatches": 1},
                "optimizer": {"name": "sgd", "lr": 1e-3},
                "pipeline": {"stages": 2},
                "train": {
                    "iterations": warmup + iterations,
                    "threads_per_stage": 1,
                    "run_dir": f"{tmp}/run",
                },
                "sweep": {
                    "jobs": [{"name": f"lr{j}", "lr": lr} for j, lr in enumerate(lrs)],
                    "solver": solver,
                    "window": window,
                },
            },
            source="bench_jobarray",
        )
        summary = train(config)
        records = RunDir(summary.run_dir).read_metrics()[warmup:]
        solution = json.loads((Path(summary.run_dir) / "japsp-solution.json").read_text())
    times = [r["iteration_s"] for r in records]
    predicted = solution.get("window", {}).get("per_iteration", solution.get("makespan"))
    return {
        "window": window,
        "samples_per_s": jobs * batch * len(times) / sum(times),
        "solver": solution.get("solver"),
        "iteration_predicted_s": predicted,
        "iteration_measured_s": sum(times) / len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", default="4,8")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument(
        "--windows", default="4", help="[sweep] window values to run (e.g. 1,4: without and with)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--peer-microbatches", default="2,4,8")
    args = parser.parse_args()
    common = dict(
        hidden=args.hidden,
        blocks=args.blocks,
        batch=args.batch,
        iterations=args.iterations,
        warmup=args.warmup,
    )
    started = time.time()
    peer_rows = []
    for schedule in ("1f1b", "gpipe"):
        for m in (int(v) for v in args.peer_microbatches.split(",")):
            single = run_single(threads=1, **common)["samples_per_s"]
            got = run_peer(schedule=schedule, stages=2, microbatches=m, **common)["samples_per_s"]  # type: ignore[arg-type]
            peer_rows.append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "samples_per_s": got,
                    "single": single,
                    "x_single": got / single,
                }
            )
            print(json.dumps(peer_rows[-1]), file=sys.stderr)
    best_peer = max(peer_rows, key=lambda r: r["x_single"])
    array_rows = []
    for jobs in (int(v) for v in args.jobs.split(",")):
        single = run_single(threads=1, **common)["samples_per_s"]
        ceiling = run_concurrent_singles(2, **common)["samples_per_s"]
        for window in (int(v) for v in args.windows.split(",")):
            got = run_array(jobs=jobs, solver=args.solver, window=window, **common)
            array_rows.append(
                {
                    "jobs": jobs,
                    **got,
                    "single": single,
                    "x_single": got["samples_per_s"] / single,
                    # Two independent single-thread trainings at once: what 2 busy
                    # processes get from this machine (memory bandwidth, caches), next to
                    # the nominal limit of 2x one process alone.
                    "two_concurrent_x_single": ceiling / single,
                    "x_ceiling": got["samples_per_s"] / ceiling,
                }
            )
            print(json.dumps(array_rows[-1]), file=sys.stderr)
    print(
        json.dumps(
            {
                "bench": "jobarray",
                "model": f"{args.blocks} x Linear({args.hidden})+ReLU",
                "batch_per_job": args.batch,
                "stages": 2,
                "best_peer": best_peer,
                "arrays": [
                    r
                    | {
                        "over_best_peer": r["x_single"] / best_peer["x_single"],
                        "x_limit": r["x_single"] / 2,
                    }
                    for r in array_rows
                ],
                "peer_runs": peer_rows,
                "median_array_over_peer": statistics.median(
                    r["x_single"] / best_peer["x_single"] for r in array_rows
                ),
                "seconds": time.time() - started,
            }
        )
    )


if __name__ == "__main__":
    main()
