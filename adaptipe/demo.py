"""``python -m adaptipe.demo --simulate``: profile the GPT on this machine, plan, simulate
every schedule, then train it once for real. (``make demo`` runs `adaptipe.adaptive_demo`.)

Writes the profile, partitions, Gantt charts and a comparison table into ``--out``.
Everything here is reachable from the CLI too; the demo just chains the steps.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from adaptipe.profile.types import Profile

if TYPE_CHECKING:
    from rich.console import Console

    from adaptipe.models import ModelSpec

__all__ = ["run_demo", "train_demo"]

_SCHEDULES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved", {"chunks": 2}),
    ("pipedream", {}),
    ("2bw", {}),
)


def run_demo(
    out: Path,
    *,
    microbatch: int = 8,
    microbatches: int = 8,
    stage_counts: Sequence[int] = (2, 4),
    bandwidth_Bps: float = 1e9,
    latency_s: float = 50e-6,
    repeats: int = 5,
    model_overrides: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run the demo pipeline and return one row per (planner, stages, schedule)."""
    from rich.console import Console

    from adaptipe.serial import write_json

    # Off a terminal rich assumes 80 columns, too narrow for the comparison table.
    console = Console(width=None if sys.stdout.isatty() else 120)
    out.mkdir(parents=True, exist_ok=True)
    profile = _profile_gpt(
        console, microbatch=microbatch, repeats=repeats, model_overrides=model_overrides
    )
    write_json(out / "profile.json", profile.to_json())
    total_ms = sum(lp.compute_s for lp in profile.layers) * 1e3
    console.print(
        f"profiled [bold]{profile.model}[/] ({profile.num_layers} layers, micro-batch {microbatch}, "
        f"1 thread): {total_ms:.2f} ms forward+backward per micro-batch -> {out / 'profile.json'}"
    )
    rows: list[dict[str, Any]] = []
    for planner in ("pipedream", "dynpipe"):
        for stages in stage_counts:
            for name, extra in _SCHEDULES:
                chunks = int(extra.get("chunks", 1))
                if stages * chunks > profile.num_layers:
                    continue
                rows.append(
                    _simulate(
                        out,
                        profile,
                        planner=planner,
                        stages=stages,
                        schedule=name,
                        chunks=chunks,
                        microbatch=microbatch,
                        microbatches=microbatches,
                        bandwidth_Bps=bandwidth_Bps,
                        latency_s=latency_s,
                    )
                )
    write_json(out / "comparison.json", rows)
    single = microbatch / (total_ms / 1e3)
    _print_comparison(
        console, rows, single=single, microbatch=microbatch, microbatches=microbatches
    )
    console.print(
        f"Gantt charts and JSON in {out}/ (one process, one thread: {single:.0f} samples/s)"
    )
    return rows


def _profile_gpt(
    console: Console, *, microbatch: int, repeats: int, model_overrides: dict[str, Any] | None
) -> Profile:
    """Profile the demo GPT on one thread, with a progress bar."""
    from rich.progress import Progress

    from adaptipe.models import get_model
    from adaptipe.profile import profile_model

    # Six blocks give 8 layers: enough for 4 stages x 2 virtual stages (interleaved).
    spec = get_model("gpt", **({"n_layer": 6} | (model_overrides or {})))
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("profiling gpt", total=spec.num_layers)
        return profile_model(
            spec,
            microbatch=microbatch,
            repeats=repeats,
            threads=1,
            progress=lambda done, total, name: bar.update(
                task, completed=done, description=f"profiling {name}"
            ),
        )


def _simulate(
    out: Path,
    profile: Profile,
    *,
    planner: str,
    stages: int,
    schedule: str,
    chunks: int,
    microbatch: int,
    microbatches: int,
    bandwidth_Bps: float,
    latency_s: float,
) -> dict[str, Any]:
    """Plan, simulate and chart one (planner, stages, schedule); its comparison row."""
    from adaptipe.plan.api import plan
    from adaptipe.schedule.build import build_schedule
    from adaptipe.serial import write_json
    from adaptipe.sim import CostModel, plot_gantt, simulate

    partition = plan(
        profile, planner=planner, num_stages=stages * chunks, bandwidth_Bps=bandwidth_Bps
    )
    write_json(out / f"partition-{planner}-{stages * chunks}.json", partition.to_json())
    built = build_schedule(schedule, stages=stages, microbatches=microbatches, chunks=chunks)
    costs = CostModel.from_profile(
        profile, partition, bandwidth_Bps=bandwidth_Bps, latency_s=latency_s
    )
    result = simulate(built, costs)
    gantt = out / f"gantt-{planner}-{stages}-{schedule}.png"
    plot_gantt(result, gantt, title=f"{schedule}, {planner} plan, S={stages}, M={microbatches}")
    return {
        "planner": planner,
        "stages": stages,
        "schedule": schedule,
        "bounds": list(partition.bounds),
        "makespan_s": result.makespan,
        "bubble_ratio": result.bubble_ratio,
        "samples_per_s": result.throughput * microbatch,
        "peak_activation_bytes": max(result.peak_activation_bytes),
        "peak_weight_bytes": max(result.peak_weight_bytes),
        "gantt": str(gantt),
    }


def _print_comparison(
    console: Console,
    rows: list[dict[str, Any]],
    *,
    single: float,
    microbatch: int,
    microbatches: int,
) -> None:
    """The comparison table; ``single`` is one process's samples/s."""
    from rich.table import Table

    table = Table(
        title=f"Simulated GPT pipelines ({microbatches} micro-batches of {microbatch}, link 1 GB/s)"
    )
    for col in (
        "planner",
        "stages",
        "schedule",
        "bounds",
        "makespan ms",
        "bubble",
        "samples/s",
        "x 1 process",
    ):
        table.add_column(
            col, justify="left" if col in ("planner", "schedule", "bounds") else "right"
        )
    for r in rows:
        table.add_row(
            r["planner"],
            str(r["stages"]),
            r["schedule"],
            ",".join(map(str, r["bounds"])),
            f"{r['makespan_s'] * 1e3:.2f}",
            f"{r['bubble_ratio']:.3f}",
            f"{r['samples_per_s']:.0f}",
            f"{r['samples_per_s'] / single:.2f}",
        )
    console.print(table)


_TRAIN_CONFIG: dict[str, Any] = {
    "model": {"name": "gpt", "config": {"n_layer": 4}},
    "data": {"batch_size": 32, "microbatches": 4},
    "optimizer": {"name": "adam", "lr": 2e-3},
    "pipeline": {"stages": 2, "schedule": "1f1b", "partition": "dynpipe"},
    "train": {"iterations": 100, "seed": 0, "checkpoint_every": 50, "threads_per_stage": 1},
}


def train_demo(out: Path, *, iterations: int = 100) -> dict[str, Any]:
    """Train the GPT for real over 2 stage processes (1F1B); compare with the simulator."""
    import shutil

    from rich.console import Console

    from adaptipe.cli.progress import training_progress
    from adaptipe.runtime import train
    from adaptipe.runtime.config import RunConfig
    from adaptipe.runtime.export import load_trained_model
    from adaptipe.runtime.rundir import RunDir
    from adaptipe.sim import CostModel, simulate

    console = Console(width=None if sys.stdout.isatty() else 120)
    data = json.loads(json.dumps(_TRAIN_CONFIG))
    data["train"].update(iterations=iterations, run_dir=str(out / "train"))
    config = RunConfig.from_dict(data, source="adaptipe.demo")
    shutil.rmtree(out / "train", ignore_errors=True)  # the demo always starts afresh
    console.print("training gpt over 2 stage processes (1F1B, DynPipe partition) ...")
    with training_progress(console=console, remaining=False) as on_iteration:
        summary = train(config, on_iteration=on_iteration)
    run = RunDir(summary.run_dir)
    metrics = run.read_metrics()
    first = next(r["loss"] for r in metrics if r["loss"] is not None)
    profile = Profile.from_json(json.loads(run.profile_json.read_text()))
    costs = CostModel.from_profile(profile, run.read_partition())
    predicted = simulate(run.read_schedule(), costs, record=False).makespan
    measured = config.data.batch_size / summary.samples_per_s
    console.print(
        f"loss {first:.3f} -> {summary.final_loss:.3f} in {len(metrics)} iterations; "
        f"{summary.samples_per_s:.0f} samples/s; iteration {measured * 1e3:.1f} ms measured, "
        f"{predicted * 1e3:.1f} ms simulated ({(predicted - measured) / measured:+.0%})"
    )
    for s, st in enumerate(summary.stages):
        console.print(
            f"  stage {s}: compute {st['compute_s'] * 1e3:.1f} ms, waiting {st['wait_s'] * 1e3:.1f} ms, "
            f"communication {st['comm_s'] * 1e3:.1f} ms per iteration"
        )
    spec, model = load_trained_model(summary.run_dir)
    console.print(f"sample from the trained model: [italic]{_sample(spec, model)!r}[/]")
    console.print(f"run directory: {summary.run_dir} (metrics.jsonl, checkpoints/, plans)")
    return summary.to_json() | {
        "predicted_iteration_s": predicted,
        "measured_iteration_s": measured,
    }


def _sample(
    spec: ModelSpec, model: torch.nn.Module, *, length: int = 120, prompt: str = "The "
) -> str:
    """Sample text from the trained GPT (temperature 0.8, fixed seed)."""
    from adaptipe.models.gpt import decode, encode

    block = int(spec.config["block_size"])
    ids = encode(prompt).to(torch.int64)[None, :]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(length):
            logits = model(ids[:, -block:])[0, -1]
            probs = torch.softmax(logits / 0.8, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)[None, :]], dim=1)
    return decode(ids[0])


if __name__ == "__main__":  # `make demo`; the options live in adaptipe.cli.demo
    from adaptipe.cli.demo import main

    sys.exit(main())
