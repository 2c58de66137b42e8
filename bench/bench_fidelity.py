"""How well the simulator, fed this machine's profile, predicts real iteration times.

For each schedule: profile the model at the micro-batch size (one thread), simulate the
schedule with that profile and the partition the run uses, then train the same config
for real over stage processes and compare the median iteration time after warm-up.
Prints one JSON object; the target is |error| <= 15% for 2-stage GPipe and 1F1B.
``--batch-wgrad`` trains with batched weight gradients and simulates them (the profile
then also times the input-gradient-only backward and the batched weight gradients).
On a shared machine one measurement can be off by tens of percent either way:
``--rounds N`` repeats profile, simulation and run N times per schedule and reports the
median error (each round's is under ``errors``).

    python bench/bench_fidelity.py [--model gpt|mlp] [--iterations 30] [--schedules gpipe,1f1b]
        [--batch-wgrad] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

from adaptipe.models import get_model
from adaptipe.plan.partition import Partition
from adaptipe.profile import profile_model
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir
from adaptipe.schedule.build import build_schedule
from adaptipe.sim import CostModel, simulate

MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"name": "gpt", "config": {"n_layer": 4}},
    "mlp": {
        "name": "mlp",
        "config": {"in_features": 1024, "hidden": 1024, "out_features": 1024, "depth": 16},
    },
}


def measure(
    *,
    model: dict[str, Any],
    schedule: str,
    stages: int,
    batch: int,
    microbatches: int,
    iterations: int,
    warmup: int,
    batch_wgrad: bool = False,
) -> dict[str, Any]:
    spec = get_model(model["name"], **model["config"])
    micro = batch // microbatches
    profile = profile_model(
        spec,
        microbatch=micro,
        threads=1,
        repeats=7,
        warmup=2,
        wgrad_microbatches=microbatches if batch_wgrad else 0,
    )
    partition = Partition.even(model=spec.name, num_layers=spec.num_layers, num_stages=stages)
    sched = build_schedule(schedule, stages=stages, microbatches=microbatches)
    costs = CostModel.from_profile(
        profile, partition, batch_weight_grads=batch_wgrad, microbatches=microbatches
    )
    predicted = simulate(sched, costs, record=False)
    with tempfile.TemporaryDirectory(prefix="adaptipe-fidelity-") as tmp:
        config = RunConfig.from_dict(
            {
                "model": model,
                "data": {"batch_size": batch, "microbatches": microbatches},
                "optimizer": {"name": "sgd", "lr": 1e-3},
                "pipeline": {
                    "stages": stages,
                    "schedule": schedule,
                    "partition": list(partition.bounds),
                    "batch_weight_grads": batch_wgrad,
                },
                "train": {
                    "iterations": warmup + iterations,
                    "threads_per_stage": 1,
                    "run_dir": f"{tmp}/run",
                },
            },
            source="bench_fidelity",
        )
        summary = train(config)
        records = RunDir(summary.run_dir).read_metrics()[warmup:]
    real = statistics.median(r["iteration_s"] for r in records)
    compute_real = [
        statistics.median(r["stages"][s]["compute_s"] for r in records) for s in range(stages)
    ]
    return {
        "schedule": schedule,
        "stages": stages,
        "microbatches": microbatches,
        "predicted_s": predicted.makespan,
        "measured_s": real,
        "error": (predicted.makespan - real) / real,
        "predicted_busy_s": list(predicted.busy_s),
        "measured_compute_s": compute_real,
    }


def _median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median error, and every round's error."""
    errors = [r["error"] for r in rounds]
    ranked = sorted(rounds, key=lambda r: r["error"])
    return {**ranked[(len(ranked) - 1) // 2], "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--batch-wgrad",
        action="store_true",
        help="train and simulate with batched weight gradients",
    )
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    started = time.time()
    schedules = args.schedules.split(",")
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in schedules}
    for _ in range(args.rounds):
        for s in schedules:
            rounds[s].append(
                measure(
                    model=MODELS[args.model],
                    schedule=s,
                    stages=args.stages,
                    batch=args.batch,
                    microbatches=args.microbatches,
                    iterations=args.iterations,
                    warmup=args.warmup,
                    batch_wgrad=args.batch_wgrad,
                )
            )
    rows = [_median_row(rounds[s]) for s in schedules]
    print(
        json.dumps(
            {
                "bench": "fidelity",
                "model": args.model,
                "batch": args.batch,
                "batch_weight_grads": args.batch_wgrad,
                "rounds": args.rounds,
                "rows": rows,
                "max_abs_error": max(abs(r["error"]) for r in rows),
                "within_15_percent": all(abs(r["error"]) <= 0.15 for r in rows),
                "seconds": time.time() - started,
            }
        )
    )


if __name__ == "__main__":
    main()
