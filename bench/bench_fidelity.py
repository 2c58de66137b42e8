"""How well the simulator, fed this machine's profile, predicts real iteration times.

For each schedule: profile the model at the micro-batch size (one thread), train the
config for real over stage processes, profile it again, and simulate the run's schedule
and partition with the two profiles' mean; compare with the median iteration time after
warm-up. Bracketing the run evens out a steady drift of the machine's speed (``profile_drift``
is the second profile's compute time over the first's; ``--no-bracket`` profiles only
before the run).
Prints one JSON object; the target is |error| <= 15% for 2-stage GPipe and 1F1B.
``--batch-wgrad`` trains with batched weight gradients and simulates them (the profile
then also times the input-gradient-only backward and the batched weight gradients).
On a shared machine one measurement can be off by tens of percent either way:
``--rounds N`` (default 3) repeats profile, run and simulation per schedule and reports the
median error (each round's is under ``errors``).

The simulator models the link between the stage processes with the latency and
bandwidth `adaptipe.profile.link.probe_link` measures before each run (gloo p2p between
two pinned processes, median round trips); ``error_without_links`` is the error with
free transfers (``--no-links`` uses those for ``error``).

Each run also traces ``--trace`` iterations after warm-up (`adaptipe.runtime.trace`), so
an error can be told apart: ``per_microbatch`` compares each stage's profiled forward and
backward time of one micro-batch with the traced one (``ratio`` = real / profiled), and
``replay_error`` is the simulator's error when fed the traced times instead of the
profile's: what is left of the error when the compute estimates are exact (waits,
transfers, the schedule itself). ``--plots DIR`` writes the simulated and the traced
Gantt charts of each round.

    python bench/bench_fidelity.py [--model gpt|mlp] [--iterations 30] [--schedules gpipe,1f1b]
        [--batch-wgrad] [--rounds 3] [--trace 5] [--plots DIR] [--co-run] [--no-bracket] [--no-links]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from adaptipe.models import get_model
from adaptipe.plan.partition import Partition
from adaptipe.profile import Profile, profile_model
from adaptipe.profile.corun import profile_co_running
from adaptipe.profile.link import probe_link
from adaptipe.profile.types import mean_profile
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.trace import compare
from adaptipe.sim import plot_gantt
from adaptipe.sim.gantt import plot_timeline

MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"name": "gpt", "config": {"n_layer": 4}},
    "mlp": {
        "name": "mlp",
        "config": {"in_features": 1024, "hidden": 1024, "out_features": 1024, "depth": 16},
    },
}


def _attrs(batch_wgrad: bool) -> tuple[tuple[str, str], ...]:
    # With batched weight gradients a micro-batch's backward is the input gradient only.
    return (
        ("forward", "forward_s"),
        ("backward", "backward_input_s" if batch_wgrad else "backward_s"),
    )


def _per_microbatch(
    profile: Profile, partition: Partition, traced: dict[str, Any], batch_wgrad: bool
) -> list[dict[str, Any]]:
    """Per stage and kind: one micro-batch's profiled and traced seconds."""
    rows = []
    for s in range(partition.num_stages):
        layers = profile.layers[partition.bounds[s] : partition.bounds[s + 1]]
        kinds = traced[str(s)]["kinds"]
        row: dict[str, Any] = {"stage": s}
        for kind, attr in _attrs(batch_wgrad):
            prof = sum(getattr(layer, attr) or 0.0 for layer in layers)
            real = kinds[kind]["mean_s"] if kind in kinds else 0.0
            row[kind] = {
                "profile_s": prof,
                "real_s": real,
                "ratio": real / prof if prof > 0 else None,
            }
        rows.append(row)
    return rows


def _compute_s(profile: Profile) -> float:
    return sum(layer.forward_s + layer.backward_s for layer in profile.layers)


def _replayed(
    profile: Profile, partition: Partition, per_mb: list[dict[str, Any]], batch_wgrad: bool
) -> Profile:
    """The profile with each stage's layers scaled to the traced micro-batch times."""
    layers = list(profile.layers)
    for row in per_mb:
        s = row["stage"]
        for i in range(partition.bounds[s], partition.bounds[s + 1]):
            changes = {}
            for kind, attr in _attrs(batch_wgrad):
                ratio = row[kind]["ratio"]
                if ratio is not None and getattr(layers[i], attr) is not None:
                    changes[attr] = getattr(layers[i], attr) * ratio
            layers[i] = dataclasses.replace(layers[i], **changes)
    return dataclasses.replace(profile, layers=tuple(layers))


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
    trace: int = 5,
    plots: Path | None = None,
    tag: str = "",
    model_links: bool = True,
    bracket: bool = True,
    co_run: bool = False,
) -> dict[str, Any]:
    spec = get_model(model["name"], **model["config"])

    settings: dict[str, Any] = {
        "microbatch": batch // microbatches,
        "threads": 1,
        "repeats": 7,
        "warmup": 2,
        "wgrad_microbatches": microbatches if batch_wgrad else 0,
    }

    def measure_profile() -> Profile:
        if co_run:  # one profiler per stage core, all at once, as the stages will run
            return profile_co_running(model["name"], model["config"], processes=stages, **settings)
        return profile_model(spec, **settings)

    before = measure_profile()
    partition = Partition.even(model=spec.name, num_layers=spec.num_layers, num_stages=stages)
    # The link between two stage processes, measured the way they talk (gloo p2p).
    link = probe_link() if model_links else None
    links = {"latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps} if link else {}
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
                    "trace_start": warmup,
                    "trace_iterations": min(trace, iterations),
                    "run_dir": f"{tmp}/run",
                },
            },
            source="bench_fidelity",
        )
        summary = train(config)
        run = RunDir(summary.run_dir)
        # Bracket the run: the machine's speed drifts by tens of percent within a minute.
        after = measure_profile() if bracket else before
        profile = mean_profile([before, after]) if bracket else before
        records = run.read_metrics()[warmup:]
        # The simulator on the run's own schedule and partition, fed the profile ...
        found = compare(run, profile, **links)
        unlinked = compare(run, profile) if link else found
        per_mb = _per_microbatch(profile, partition, found.real, batch_wgrad)
        # ... and fed the traced compute times instead: what is left is not compute.
        replay = compare(run, _replayed(profile, partition, per_mb, batch_wgrad), **links)
    real = statistics.median(r["iteration_s"] for r in records)
    compute_real = [
        statistics.median(r["stages"][s]["compute_s"] for r in records) for s in range(stages)
    ]
    predicted = found.simulation
    first, end = found.iterations
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
        plot_gantt(predicted, plots / f"{tag}{schedule}-simulated.png")
        plot_timeline(
            found.timeline,
            plots / f"{tag}{schedule}-traced.png",
            workers=stages,
            title=f"{schedule}: iterations {first}-{end - 1} as run",
        )
    return {
        "schedule": schedule,
        "stages": stages,
        "microbatches": microbatches,
        "predicted_s": predicted.makespan,
        "measured_s": real,
        "error": (predicted.makespan - real) / real,
        "link": links or None,
        "error_without_links": (unlinked.predicted_s - real) / real,
        "predicted_busy_s": list(predicted.busy_s),
        "measured_compute_s": compute_real,
        "per_microbatch": per_mb,
        "profile_drift": _compute_s(after) / _compute_s(before),
        "replay_s": replay.predicted_s,
        "replay_error": replay.error,
        "idle_s": {
            "predicted": [found.simulated[str(s)]["idle_s"] for s in range(stages)],
            "traced": [found.real[str(s)]["idle_s"] for s in range(stages)],
        },
    }


def _median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median error, and every round's error."""
    errors = [r["error"] for r in rounds]
    ranked = sorted(rounds, key=lambda r: r["error"])
    return {
        **ranked[(len(ranked) - 1) // 2],
        "errors": errors,
        "replay_errors": [r["replay_error"] for r in rounds],
    }


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
    parser.add_argument("--rounds", type=int, default=3, help="runs per schedule (median)")
    parser.add_argument("--trace", type=int, default=5, help="iterations to trace per run")
    parser.add_argument("--plots", type=Path, help="write simulated and traced Gantt PNGs here")
    parser.add_argument(
        "--no-links",
        action="store_true",
        help="simulate free transfers instead of the measured gloo link",
    )
    parser.add_argument(
        "--no-bracket",
        action="store_true",
        help="profile only before each run (default: before and after, times averaged)",
    )
    parser.add_argument(
        "--co-run",
        action="store_true",
        help="profile in one pinned process per stage at once (contention of co-running stages)",
    )
    args = parser.parse_args()
    if args.trace < 1:
        parser.error("--trace must be >= 1")
    started = time.time()
    schedules = args.schedules.split(",")
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in schedules}
    for r in range(args.rounds):
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
                    trace=args.trace,
                    plots=args.plots,
                    tag=f"round{r}-",
                    model_links=not args.no_links,
                    bracket=not args.no_bracket,
                    co_run=args.co_run,
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
                "co_running_profile": args.co_run,
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
