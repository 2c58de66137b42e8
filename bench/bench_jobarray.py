"""Job-arrays against training the same sibling jobs one after another.

Peer: each job trained alone by ``torch.distributed.pipelining`` (Schedule1F1B and
ScheduleGPipe, at their best micro-batch count among 2, 4, 8) over 2 stage processes;
sequential training of J identical-size jobs runs at one job's throughput. adaptipe:
the J jobs as one job-array through one 2-stage pipeline (each job's mini-batch one
block, block order from the JAPSP solver, ``--windows`` iterations scheduled as one
window, "auto" by default). Limit: one single-thread process times 2. Each contender is paired with a
single-process run just before it; with ``--repeats`` above 1, each round also runs
the best peer again and ``over_peer_same_round`` is the median of the array's samples/s
over that round's peer's. Prints one JSON object.

    python bench/bench_jobarray.py [--jobs 4,8] [--iterations 12] [--windows 1,4,auto]
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

from adaptipe.japsp.window import auto_window
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
    window: int | str,
) -> dict[str, Any]:
    length = auto_window(jobs, 2) if window == "auto" else int(window)
    warmup = -(-warmup // length) * length  # whole windows: the first holds start-up costs
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


def _window(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def _paired(run: Any, common: dict[str, Any]) -> dict[str, float]:
    """A contender's samples/s next to a single-thread process run just before it."""
    single = run_single(threads=1, **common)["samples_per_s"]
    got = float(run())
    return {"samples_per_s": got, "single": single, "x_single": got / single}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", default="4,8")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument(
        "--windows",
        default="auto",
        help='[sweep] window values to run (e.g. 1,4,auto: without, 4 iterations, "auto")',
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="paired rounds of every contender after the peer sweep; figures are medians",
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

    def peer(schedule: str, m: int) -> Any:
        return lambda: run_peer(schedule=schedule, stages=2, microbatches=m, **common)[  # type: ignore[arg-type]
            "samples_per_s"
        ]

    def array(jobs: int, window: int | str) -> Any:
        def go() -> float:
            got = run_array(jobs=jobs, solver=args.solver, window=window, **common)
            extra[(jobs, window)].append(got)
            return float(got["samples_per_s"])

        return go

    # 1. The peer's best schedule and micro-batch count, one pass each.
    peer_rows: list[dict[str, Any]] = []
    for schedule in ("1f1b", "gpipe"):
        for m in (int(v) for v in args.peer_microbatches.split(",")):
            row = {"schedule": schedule, "microbatches": m, **_paired(peer(schedule, m), common)}
            peer_rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    best = max(peer_rows, key=lambda r: r["x_single"])
    # 2. Paired rounds: the best peer again, every array, the two-process ceiling.
    arrays = [(int(j), _window(w)) for j in args.jobs.split(",") for w in args.windows.split(",")]
    extra: dict[tuple[int, int | str], list[dict[str, Any]]] = {key: [] for key in arrays}
    peer_x = [best["x_single"]] if args.repeats == 1 else []
    array_x: dict[tuple[int, int | str], list[float]] = {key: [] for key in arrays}
    ceiling_x: list[float] = []
    # Each round's array samples/s over the same round's peer samples/s: a direct ratio
    # of two runs minutes apart, free of the single-process references' noise.
    direct: dict[tuple[int, int | str], list[float]] = {key: [] for key in arrays}
    for rnd in range(args.repeats):
        peer_sps = None
        if args.repeats > 1:
            got = _paired(peer(best["schedule"], best["microbatches"]), common)
            peer_x.append(got["x_single"])
            peer_sps = got["samples_per_s"]
            print(json.dumps({"round": rnd, "peer": got}), file=sys.stderr)
        ceiling = _paired(lambda: run_concurrent_singles(2, **common)["samples_per_s"], common)
        ceiling_x.append(ceiling["x_single"])
        for key in arrays:
            got = _paired(array(*key), common)
            array_x[key].append(got["x_single"])
            if peer_sps is not None:
                direct[key].append(got["samples_per_s"] / peer_sps)
            print(
                json.dumps({"round": rnd, "jobs": key[0], "window": key[1], **got}), file=sys.stderr
            )
    peer_med = statistics.median(peer_x)
    rows = []
    for (jobs, window), xs in array_x.items():
        x = statistics.median(xs)
        runs = extra[(jobs, window)]
        rows.append(
            {
                "jobs": jobs,
                "window": window,
                "x_single": x,
                "x_single_rounds": xs,
                "over_best_peer": x / peer_med,
                "over_peer_same_round": statistics.median(direct[(jobs, window)])
                if direct[(jobs, window)]
                else None,
                "over_peer_same_round_rounds": direct[(jobs, window)],
                "x_limit": x / 2,
                # Two independent single-thread trainings at once: what 2 busy processes
                # get from this machine (memory bandwidth, caches), next to the nominal
                # limit of 2x one process alone.
                "x_ceiling": x / statistics.median(ceiling_x),
                "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
                "iteration_measured_s": statistics.median(r["iteration_measured_s"] for r in runs),
                "iteration_predicted_s": statistics.median(
                    r["iteration_predicted_s"] for r in runs
                ),
                "solver": runs[0]["solver"],
            }
        )
    print(
        json.dumps(
            {
                "bench": "jobarray",
                "model": f"{args.blocks} x Linear({args.hidden})+ReLU",
                "batch_per_job": args.batch,
                "stages": 2,
                "repeats": args.repeats,
                "best_peer": {**best, "x_single_rounds": peer_x, "x_single_median": peer_med},
                "two_concurrent_x_single": statistics.median(ceiling_x),
                "arrays": rows,
                "peer_sweep": peer_rows,
                "seconds": time.time() - started,
            }
        )
    )


if __name__ == "__main__":
    main()
