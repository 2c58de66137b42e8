"""What moving layers costs a running pipeline: stop-and-copy migration against the
field's baseline (checkpoint, stop the workers, start them again on the new partition).

Model: the zoo GPT of examples/gpt-1f1b.toml (4 blocks + embedding + head = 6 layers,
d_model 128), Adam, batch 32 in 4 micro-batches, 1F1B over 2 stage processes with one
thread each. Each method trains the same run with one scripted re-partition
(``[[adapt.repartition]]``, bounds 0,3,6 -> 0,2,6: one block moves from stage 0 to stage
1, with its Adam moments). The *stall* is the span of the iteration the switch comes
before (``metrics.jsonl``: end of that iteration minus end of the one before) less the
median span of the steady iterations around it. The methods run in alternating rounds,
and the ratio restart/live is taken within a round (this machine's speed drifts).
Prints one JSON object. DynPipe reports 5 s against 70 s for a restart (seed 004).

    python bench/bench_migration.py [--rounds 2] [--iterations 40] [--at 20]
        [--methods live,checkpoint,restart]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig


def _config(run_dir: Path, *, method: str, iterations: int, at: int) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": "gpt", "config": {"n_layer": 4, "d_model": 128, "n_head": 4}},
            "data": {"batch_size": 32, "microbatches": 4},
            "optimizer": {"name": "adam", "lr": 3e-4},
            "pipeline": {"stages": 2, "schedule": "1f1b", "partition": [0, 3, 6]},
            "train": {
                "iterations": iterations,
                "seed": 0,
                "threads_per_stage": 1,
                "checkpoint_every": 0,
                "run_dir": str(run_dir),
            },
            "adapt": {"method": method, "repartition": [{"iteration": at, "bounds": [0, 2, 6]}]},
        },
        source="bench_migration",
    )


def _measure(root: Path, method: str, iterations: int, at: int) -> dict[str, Any]:
    run_dir = root / method
    summary = train(_config(run_dir, method=method, iterations=iterations, at=at))
    spans = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        spans[rec["iteration"]] = rec["iteration_s"]
    steady = [spans[i] for i in range(3, iterations) if abs(i - at) > 2 and i in spans]
    typical = statistics.median(steady)
    moved = []
    control = run_dir / "control.jsonl"
    if control.exists():
        for line in control.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "migration":
                moved.append({k: event[k] for k in ("ok", "bytes", "seconds")})
    return {
        "iteration_s": typical,
        "switch_iteration_s": spans[at],
        "stall_s": spans[at] - typical,
        "stall_iterations": (spans[at] - typical) / typical,
        "migration": moved,
        "wall_s": summary.wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--at", type=int, default=20)
    parser.add_argument("--methods", default="live,checkpoint,restart")
    args = parser.parse_args()
    methods = args.methods.split(",")
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            row = {m: _measure(Path(tmp) / f"r{r}", m, args.iterations, args.at) for m in methods}
            if "live" in row and "restart" in row:
                row["restart_over_live_stall"] = row["restart"]["stall_s"] / max(
                    row["live"]["stall_s"], 1e-9
                )
            rounds.append(row)
    out: dict[str, Any] = {
        "model": "gpt n_layer=4 d_model=128 (6 pipeline layers), 2 stages, 1F1B, batch 32/4",
        "move": f"bounds 0,3,6 -> 0,2,6 at iteration {args.at}",
        "rounds": rounds,
        "median_stall_s": {m: statistics.median(r[m]["stall_s"] for r in rounds) for m in methods},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
