"""A trace recorded from a real run, replayed in the environments' simulator: does the
episode predict the run's iteration times?

Trains the zoo GPT (4 blocks, 6 layers) over 2 stage processes with 1F1B, planned by
DynPipe on a profile taken first (the run keeps it as ``profile.json``), with a
``slowdown`` injected on stage 1 from iteration ``--onset`` for ``--duration``
iterations. Then records the run's trace (`adaptipe.envs.record.record_trace`: per
iteration the stages' measured slowdowns over the profile, the links, the device) and
replays it in an `Episode` on the same profile and partition. Prints one JSON object:
per phase (before, during, after the injection; the first ``--warmup`` iterations left
out) the run's and the replay's mean iteration seconds and the relative error of the
replay. Target: |error| <= 15% in every phase (the simulator's target on this machine,
`bench/bench_fidelity.py`).

    python bench/bench_trace_replay.py [--iterations 60] [--onset 20] [--duration 20]
        [--factor 2.5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from adaptipe.envs.episode import Episode, EpisodeSettings
from adaptipe.envs.record import record_trace
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir


def _config(run_dir: Path, iterations: int) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": "gpt", "config": {"n_layer": 4, "d_model": 128, "n_head": 4}},
            "data": {"batch_size": 32, "microbatches": 4},
            "optimizer": {"name": "adam", "lr": 3e-4},
            "pipeline": {"stages": 2, "schedule": "1f1b", "partition": "dynpipe"},
            "train": {
                "iterations": iterations,
                "seed": 0,
                "device": "cpu",
                "run_dir": str(run_dir),
                "log_every": 10,
            },
        },
        source="bench_trace_replay",
    )


def _scenario(path: Path, onset: int, duration: int, factor: float) -> Path:
    path.write_text(
        "[[inject]]\n"
        'kind = "slowdown"\n'
        f"at_iteration = {onset}\n"
        f"iterations = {duration}\n"
        "stage = 1\n"
        f"factor = {factor}\n"
    )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--onset", type=int, default=20)
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--factor", type=float, default=2.5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep if args.keep is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        run_dir = root / "run"
        cfg = _config(run_dir, args.iterations)
        scenario = _scenario(root / "scenario.toml", args.onset, args.duration, args.factor)
        train(cfg, inject=scenario)
        run = RunDir(run_dir)
        trace = record_trace(run_dir)
        trace.save(root / "trace.jsonl")
        bounds = run.read_partition().bounds
        settings = EpisodeSettings(
            model=str(run.profile_json),
            stages=2,
            microbatches=cfg.data.microbatches,
            iterations_per_step=trace.iterations,
            noise=0.0,
        )
        episode = Episode(trace, settings, bounds=bounds)
        predicted = list(episode.run().iteration_s)
        measured = {
            int(rec["iteration"]): float(rec["iteration_s"])
            for rec in map(json.loads, run.metrics.read_text().splitlines())
            if "iteration_s" in rec
        }
    end = args.onset + args.duration
    phases = {
        "before": range(args.warmup, args.onset),
        "during": range(args.onset, end),
        "after": range(end, args.iterations),
    }
    out: dict[str, Any] = {
        "model": "gpt, 4 blocks (6 layers), batch 32 in 4 micro-batches, adam",
        "pipeline": "2 stage processes, 1f1b, DynPipe partition on the run's profile",
        "partition": list(bounds),
        "injection": {
            "kind": "slowdown",
            "stage": 1,
            "factor": args.factor,
            "from": args.onset,
            "iterations": args.duration,
        },
        "target": "|error| <= 15% per phase",
        "phases": {},
    }
    ok = True
    for name, its in phases.items():
        its = [i for i in its if i in measured and i < len(predicted)]
        real = statistics.fmean(measured[i] for i in its)
        sim = statistics.fmean(predicted[i] for i in its)
        error = sim / real - 1.0
        ok &= abs(error) <= 0.15
        out["phases"][name] = {
            "iterations": len(its),
            "measured_s": real,
            "replayed_s": sim,
            "error": error,
            "median_iteration_error": statistics.median(
                predicted[i] / measured[i] - 1 for i in its
            ),
        }
    out["target_met"] = ok
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
