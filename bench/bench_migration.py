"""What moving layers costs a running pipeline: streamed migration (base copy plus
gradient log, `adaptipe.runtime.streamed`) with and without prioritisation, against
stop-and-copy, the restart the field uses, and an A/A control.

Each variant is one training run of 1F1B over 2 stage processes (one thread each) with
``--migrations`` scripted re-partitions back and forth (``[[adapt.repartition]]`` every
``--every`` iterations, bounds 0,2,L <-> 0,4,L: two GPT blocks change stage each time,
with their Adam moments). Models (fixed, stated in the output):

- ``gpt``: the zoo GPT of examples/gpt-1f1b.toml (d_model 128; 1.6 MB of parameters
  and 4.7 MB of state in the two moving blocks), batch 32 in 4 micro-batches;
- ``gpt-50mb``: d_model 512 (25 MB of parameters, 76 MB of state moving), batch 8 in 4.

Per migration, from ``metrics.jsonl`` (an iteration's span is the end of it less the end
of the one before, so a boundary's work counts in the iteration after it) and the stage
logs (``stream_start`` where the workers saw the new partition, ``migration`` where they
switched):

- *decision to switch*: iterations from the decision (the scripted iteration) to the
  switch, against the target max(5, 1.5 x bytes / spare bandwidth / iteration time),
  spare bandwidth being the telemetry's link estimate times the share of an iteration
  the link is idle;
- *streaming slowdown*: the median span of the iterations that ran while state streamed
  (decision to switch) over the median span of the quiet ones before the decision (same
  partition, two iterations after the previous switch on); pooled over migrations, with
  a 95% bootstrap interval (migrations resampled);
- *worst stall*: the largest span in decision..switch less the quiet median.

``streamed`` and ``unprioritised`` do the streaming work in threads of the stage
processes (``streamed`` paces the base copy over ``[adapt] pace_iterations``, 3;
``unpaced`` is ``streamed`` with 0, as fast as the stage's sends let it); ``courier`` and ``courier_unprioritised`` in each worker's helper process
(``[adapt] streamer = "process"``, `adaptipe.runtime.courier`).

The A/A control commits the same plan versions at the same iterations, each to the
partition in force (a migration that sends nothing), and is measured at the streamed
run's decision and switch iterations: its slowdown is the noise floor (about 1). Restart runs
``--restart-migrations`` moves (each stops and starts the workers). Prints one JSON object.
DynPipe reports 9.8-35.1 iterations from decision to new partition with asynchronous
checkpoints and 5 s against 70 s for a restart (seed 004).

    python bench/bench_migration.py [--models gpt,gpt-50mb] [--migrations 10]
        [--every 8] [--device cpu|cuda]
        [--variants streamed,unpaced,unprioritised,courier,courier_unprioritised,
                    stop_and_copy,restart,control]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig

MODELS: dict[str, dict[str, Any]] = {
    "gpt": {
        "model": {"name": "gpt", "config": {"n_layer": 4, "d_model": 128, "n_head": 4}},
        "data": {"batch_size": 32, "microbatches": 4},
    },
    "gpt-50mb": {
        "model": {"name": "gpt", "config": {"n_layer": 4, "d_model": 512, "n_head": 8}},
        "data": {"batch_size": 8, "microbatches": 4},
    },
}
_STREAMED = {"method": "live", "transfer": "streamed"}
VARIANTS: dict[str, dict[str, Any]] = {
    "streamed": {**_STREAMED, "prioritise": True, "streamer": "thread"},
    "unpaced": {**_STREAMED, "prioritise": True, "streamer": "thread", "pace_iterations": 0},
    "unprioritised": {**_STREAMED, "prioritise": False, "streamer": "thread"},
    "courier": {**_STREAMED, "prioritise": True, "streamer": "process"},
    "courier_unprioritised": {**_STREAMED, "prioritise": False, "streamer": "process"},
    "stop_and_copy": {"method": "live", "transfer": "stop_and_copy"},
    "restart": {"method": "restart"},
    "control": {},
}
BOUNDS = ([0, 2, 6], [0, 4, 6])
WARMUP = 6


def _config(
    run_dir: Path, model: str, variant: str, moves: int, every: int, device: str = "cpu"
) -> RunConfig:
    scripted = [
        {"iteration": WARMUP + every * (k + 1), "bounds": BOUNDS[(k + 1) % 2]} for k in range(moves)
    ]
    adapt = dict(VARIANTS[variant], timeout_s=120.0)
    if variant == "control":  # A/A: the same versions committed, to the same partition
        scripted = [dict(entry, bounds=BOUNDS[0]) for entry in scripted]
    adapt["repartition"] = scripted
    return RunConfig.from_dict(
        {
            **MODELS[model],
            "optimizer": {"name": "adam", "lr": 3e-4},
            "pipeline": {"stages": 2, "schedule": "1f1b", "partition": BOUNDS[0]},
            "train": {
                "iterations": WARMUP + every * (moves + 1),
                "seed": 0,
                "device": device,
                "threads_per_stage": 1,
                "checkpoint_every": 0,
                "telemetry": True,
                "link_telemetry": True,
                "run_dir": str(run_dir),
            },
            "adapt": adapt,
        },
        source="bench_migration",
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _migrations(run_dir: Path, scripted: Sequence[int]) -> list[dict[str, Any]]:
    """Per migration: decision and switch iterations, bytes and the manager's seconds."""
    said = [e for e in _lines(run_dir / "control.jsonl") if e.get("event") == "migration"]
    out = []
    for event in said:  # a move that never switched (superseded) logs no migration
        earlier = [it for it in scripted if it <= event["iteration"]]
        if not earlier:
            continue
        out.append(
            {
                "decided": earlier[-1],
                "switched": event["iteration"],
                "ok": event["ok"],
                "transfer": event.get("transfer", "stop_and_copy"),
                "bytes": event["bytes"],
                "log_bytes": event.get("log_bytes", 0),
                "switch_s": event["seconds"],
                "streamed_s": event.get("streamed_s", 0.0),
            }
        )
    if not said:  # restart: the stage logs say where each restart happened
        restarts = sorted(
            {e["iteration"] for s in (0, 1) for e in _stage_events(run_dir, s, "restart")}
        )
        out = [
            {"decided": it, "switched": it, "ok": True, "transfer": "restart"} for it in restarts
        ]
    return out


def _stage_events(run_dir: Path, stage: int, kind: str) -> list[dict[str, Any]]:
    found = sorted((run_dir / "stages").glob(f"stage-{stage}*.jsonl")) or sorted(
        run_dir.glob(f"**/stage-{stage}.jsonl")
    )
    return [e for path in found for e in _lines(path) if e.get("event") == kind]


def _link_bandwidth(telemetry: list[dict[str, Any]]) -> float | None:
    """The telemetry's median smoothed 0 -> 1 link bandwidth (bytes/s)."""
    samples = [
        r["bandwidth_Bps"]
        for r in telemetry
        if r.get("type") == "link_sample" and r.get("src") == 0
    ]
    return statistics.median(samples) if samples else None


def _fit(results: dict[str, Any]) -> dict[str, Any]:
    """The cost model fitted on what was measured here (`adaptipe.sim.migration`): the
    stop-and-copy stall on every such move, the streamed cost on every streamed one."""
    from adaptipe.sim.migration import MigrationCost

    def samples(variant: str) -> list[dict[str, Any]]:
        return [
            m
            for model in results.values()
            for m in model.get(variant, {}).get("migrations", [])
            if m.get("ok") and "stall_s" in m
        ]

    copied, streamed = samples("stop_and_copy"), samples("streamed")
    out: dict[str, Any] = {
        "stop_and_copy": [[m["bytes"], m["bandwidth_Bps"], m["stall_s"]] for m in copied],
        "streamed": [[m["bytes"], m["lost_s"]] for m in streamed],
    }
    try:
        cost = MigrationCost.fit([tuple(x) for x in out["stop_and_copy"]])  # type: ignore[misc]
        cost = cost.fit_streamed([tuple(x) for x in out["streamed"]])  # type: ignore[misc]
    except Exception as exc:  # too few or too alike: say so
        out["error"] = str(exc)
        return out
    out["cost"] = cost.to_json()
    return out


def _spare_bandwidth(telemetry: list[dict[str, Any]], link: float | None) -> float | None:
    """The ``link`` bandwidth times the share of an iteration it is idle (bytes/s)."""
    stats = [r for r in telemetry if r.get("type") == "stage_stats"]
    if link is None or not stats:
        return None
    busy = statistics.median(
        min(r["comm_s"] / r["iteration_s"], 1.0) for r in stats if r["iteration_s"] > 0
    )
    return link * max(1.0 - busy, 0.05)


def _windows(spans: dict[int, float], moves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per migration: the spans of its streaming iterations and of the quiet ones before."""
    out, after = [], WARMUP
    for m in moves:
        d, s = m["decided"], m["switched"]
        quiet = [spans[i] for i in range(after, d) if i in spans]
        streaming = [spans[i] for i in range(d, s) if i in spans]
        switch = spans.get(s)
        out.append({"quiet": quiet, "streaming": streaming, "switch": switch})
        after = s + 2
    return out


def _ratio(windows: Sequence[dict[str, Any]]) -> float | None:
    streaming = [x for w in windows for x in w["streaming"]]
    quiet = [x for w in windows for x in w["quiet"]]
    if not streaming or not quiet:
        return None
    return statistics.median(streaming) / statistics.median(quiet)


def _bootstrap(windows: Sequence[dict[str, Any]], draws: int = 2000) -> list[float] | None:
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        pick = [rng.choice(windows) for _ in windows]
        r = _ratio(pick)
        if r is not None:
            ratios.append(r)
    if len(ratios) < draws // 2:
        return None
    ratios.sort()
    return [ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]]


def _summarise(
    run_dir: Path, moves: list[dict[str, Any]], spans: dict[int, float]
) -> dict[str, Any]:
    windows = _windows(spans, moves)
    quiet_all = [x for w in windows for x in w["quiet"]]
    typical = statistics.median(quiet_all) if quiet_all else None
    stalls = [
        max([*w["streaming"], w["switch"] or 0.0]) - statistics.median(w["quiet"])
        for w in windows
        if w["quiet"]
    ]
    telemetry = _lines(run_dir / "telemetry.jsonl")
    link = _link_bandwidth(telemetry)
    spare = _spare_bandwidth(telemetry, link)
    for m, w in zip(moves, windows, strict=True):
        if link and w["quiet"] and w["switch"] is not None and m.get("bytes"):
            # what the cost model is fitted on: the switch's stall, and the training time
            # the whole move cost (streaming iterations and switch) over the quiet median
            quiet = statistics.median(w["quiet"])
            m["stall_s"] = w["switch"] - quiet
            m["lost_s"] = sum(x - quiet for x in w["streaming"]) + m["stall_s"]
            m["bandwidth_Bps"] = link
    for m in moves:
        m["iterations_to_switch"] = m["switched"] - m["decided"]
        if spare and typical and m.get("bytes"):
            m["target_iterations"] = max(5.0, 1.5 * m["bytes"] / spare / typical)
    return {
        "quiet_iteration_s": typical,
        "streaming_slowdown": _ratio(windows),
        "streaming_slowdown_95": _bootstrap(windows),
        "worst_stall_s": max(stalls) if stalls else None,
        "median_switch_span_s": statistics.median(
            w["switch"] for w in windows if w["switch"] is not None
        )
        if windows
        else None,
        "spare_bandwidth_Bps": spare,
        "iterations_to_switch": [m["iterations_to_switch"] for m in moves],
        "within_target": all(
            m["iterations_to_switch"] <= m["target_iterations"]
            for m in moves
            if "target_iterations" in m
        ),
        "migrations": moves,
        # every iteration's span (ms), for a second look at where the time went
        "spans_ms": [round(spans[i] * 1000, 1) for i in sorted(spans)],
    }


def _spans(run_dir: Path) -> dict[int, float]:
    return {r["iteration"]: r["iteration_s"] for r in _lines(run_dir / "metrics.jsonl")}


def _train(config: RunConfig, bed: Any) -> None:
    """Train here, or across the two hosts of ``bed`` (torchrun + ``adaptipe manage``)."""
    if bed is None:
        train(config)
        return
    from adaptipe.runtime.bedrun import run_on_bed
    from adaptipe.runtime.launch import prepare

    run, _ = prepare(config)
    head, other = bed.hosts
    run_on_bed(run, head, [head, other], port=29523)


def measure(
    root: Path, model: str, variants: Sequence[str], args: argparse.Namespace, bed: Any = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    streamed_moves: list[dict[str, Any]] | None = None
    for variant in variants:
        if variant == "restart" and bed is not None:
            out[variant] = {"skipped": "adaptipe manage cannot restart torchrun's workers"}
            continue
        moves = args.restart_migrations if variant == "restart" else args.migrations
        run_dir = root / f"{model}-{variant}{'-bed' if bed is not None else ''}"
        _train(_config(run_dir, model, variant, moves, args.every, args.device), bed)
        scripted = [WARMUP + args.every * (k + 1) for k in range(moves)]
        if variant == "control":
            if streamed_moves is None:
                continue  # measured at the streamed run's iterations
            found = [dict(decided=m["decided"], switched=m["switched"]) for m in streamed_moves]
            summary = _summarise(run_dir, found, _spans(run_dir))
            summary.pop("within_target")
        else:
            found = _migrations(run_dir, scripted)
            summary = _summarise(run_dir, found, _spans(run_dir))
            summary["scripted"], summary["switched"] = len(scripted), len(found)
            if streamed_moves is None and variant in ("streamed", "courier"):
                streamed_moves = found
        out[variant] = summary
    return out


def _on_bed(root: Path, variants: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """Every model again between two namespace hosts whose links are shaped to
    ``--bed`` (skipped, with why, where this machine cannot make a bed)."""
    from adaptipe import netbed
    from adaptipe.netbed import parse_shape

    reason = netbed.available()
    key = f"bed {args.bed}"
    if reason is not None:
        return {key: {"skipped": f"needs a namespace test bed: {reason}"}}
    prefix, state = "bm" + secrets.token_hex(2), root / "netbed"
    bed = netbed.up(prefix=prefix, hosts=2, shape=parse_shape(rate=args.bed), state_dir=state)
    try:
        return {
            f"{model} {key}": measure(root, model, variants, args, bed)
            for model in args.models.split(",")
        }
    finally:
        netbed.down(prefix=prefix, state_dir=state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,gpt-50mb")
    parser.add_argument("--migrations", type=int, default=10)
    parser.add_argument("--restart-migrations", type=int, default=3)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument(
        "--device", default="cpu", help="[train].device: cpu, or cuda (both stages share GPU 0)"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument(
        "--bed", default="", help="also run between two namespace hosts at this rate (500mbit)"
    )
    parser.add_argument(
        "--variants", default="streamed,unprioritised,courier,stop_and_copy,restart,control"
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    if "control" in variants:  # measured after the streamed run, at its iterations
        variants = [v for v in variants if v != "control"] + ["control"]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep if args.keep is not None else Path(tmp)
        for model in args.models.split(","):
            results[model] = measure(root, model, variants, args)
        if args.bed:
            results.update(_on_bed(root, variants, args))
    out = {
        "setup": {
            "models": {m: MODELS[m] for m in args.models.split(",")},
            "pipeline": "2 stages, 1F1B, Adam, one thread per stage; loopback, and with "
            "--bed one stage on each of two namespace hosts whose links are shaped",
            "bed": args.bed or None,
            "moves": f"bounds {BOUNDS[0]} <-> {BOUNDS[1]} every {args.every} iterations "
            f"after {WARMUP}, {args.migrations} times ({args.restart_migrations} for restart)",
            "variants": {v: VARIANTS[v] for v in variants},
            "device": args.device,
            "cpus": os.cpu_count(),
            "load": os.getloadavg(),
        },
        "targets": {
            "iterations_to_switch": "<= max(5, 1.5 x bytes / spare bandwidth / iteration)",
            "streaming_slowdown": "< 1.05 with prioritisation on",
        },
        "results": results,
        # one fit per environment: a move's cost depends on where it runs (off loopback
        # the state channel is encrypted); the defaults of MigrationCost are loopback's
        "cost_model": _fit({k: v for k, v in results.items() if " bed " not in k}),
        "cost_model_bed": _fit({k: v for k, v in results.items() if " bed " in k}),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
