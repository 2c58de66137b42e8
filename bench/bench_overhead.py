"""Monitoring and control overhead, per thread, with paired throughput. Prints one JSON object.

Issue 22's "Overhead": monitoring and control CPU seconds at most 1% of the stages' CPU
seconds, measured per thread, with the throughput with and without them beside it.

The same run (2-stage ``mlp``, 1F1B, one thread per stage, the default partition) is
trained in pairs: (A) ``[train] telemetry = false``, no controller; (B) telemetry on and
``[adapt] controller`` (``threshold`` by default) with ``dry_run = true``, so no layer
moves and the two halves train the same thing. The halves alternate (AB BA AB ...) so a
steady drift of the machine cancels in the median.

While each run trains, a thread of this process (``_threadcpu.Sampler``) reads
``/proc/<pid>/task/<tid>/{stat,schedstat}`` (each thread's ``comm`` and CPU time) of this
process, the manager, and of each stage process (its children) every ``--sample-s``,
keeping every snapshot: threads vanish with their process. The window runs from the
merged iteration ``--warmup`` to the last snapshot taken before a stage finished its
last iteration; per-iteration figures divide by the iterations the stages finished in
it (from their end times).

Threads are told apart by tid and name (``adaptipe.monitor.threadname`` names the
telemetry threads): the manager's main thread (tid = pid: the poll loop, which merges
metrics and writes logs with or without telemetry and, since session 15, drives the
telemetry collector itself, so B's collector work is in B's main thread less A's),
``adaptipe-collec``tor where a collector runs its own thread (before session 15),
ZeroMQ's ``ZMQbg/*``, this bench's own sampler (left out), and "exited" (the process's
CPU less its live threads': before session 23 the short-lived ``adaptipe-decide``
threads, one per call; since, the loop's one ``adaptipe-decide`` thread is "other"); in a stage, the
training thread (tid = pid), ``adaptipe-sample``r, ``ZMQbg/*``, link watchers
(``adaptipe-l*``) and the rest.

``--model gpt-array`` trains ``adaptipe demo``'s 4 GPT jobs as one job-array instead;
``--act`` adds one mlp run that moves (``always_best`` from lopsided bounds);
``--adapt-poll-s`` tries another manager poll period while a controller call runs;
``--telemetry-interval-s`` another device-sampling period for B; ``--adapt FIELD=VALUE``
sets B's other ``[adapt]`` fields (``check_every=1 --adapt unchanged=0``: a check every
iteration, the controller asked at each).

    python bench/bench_overhead.py [--pairs 4] [--iterations 80] [--warmup 10]
        [--model mlp|gpt-array] [--controller threshold] [--act] [--adapt-poll-s S]
        [--telemetry-interval-s S] [--adapt FIELD=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer import mlp_model
from _threadcpu import Sampler, account, window
from bench_monitor import _iqr

TARGET = 0.01

# ------------------------------------------------------------------------------ runs


def _config(args: argparse.Namespace, run_dir: str, *, monitored: bool, act: bool) -> Any:
    from adaptipe.runtime.config import RunConfig

    if args.model == "gpt-array":
        from adaptipe.adaptive_demo import demo_config

        controller = args.controller if monitored else "none"
        iterations = args.warmup + args.iterations
        demo = demo_config(Path(run_dir), controller=controller, iterations=iterations, window=3)
        demo["train"]["telemetry"] = monitored
        if args.telemetry_interval_s is not None:
            demo["train"]["telemetry_interval_s"] = args.telemetry_interval_s
        if monitored:
            demo["adapt"] |= {"dry_run": True, **adapt_overrides(args.adapt)}
        return RunConfig.from_dict(demo, source="bench_overhead")
    raw: dict[str, Any] = {
        "model": mlp_model(args.hidden, args.blocks, args.batch * 8),
        "data": {"batch_size": args.batch, "microbatches": 8},
        "optimizer": {"name": "sgd", "lr": 1e-3},
        "pipeline": {"stages": 2, "schedule": "1f1b"},
        "train": {
            "iterations": args.warmup + args.iterations,
            "threads_per_stage": 1,
            "checkpoint_every": 0,
            "telemetry": monitored,
            "run_dir": run_dir,
        },
    }
    if args.telemetry_interval_s is not None:
        raw["train"]["telemetry_interval_s"] = args.telemetry_interval_s
    if monitored:
        raw["adapt"] = {"controller": args.controller, "dry_run": not act}
        raw["adapt"] |= adapt_overrides(args.adapt)
    if act:  # a lopsided start, which always_best moves from at its first check
        raw["adapt"]["controller"] = "always_best"
        raw["pipeline"]["partition"] = [0, 1, args.blocks]
    return RunConfig.from_dict(raw, source="bench_overhead")


def adapt_overrides(pairs: list[str]) -> dict[str, Any]:
    """``--adapt FIELD=VALUE`` as an ``[adapt]`` table (the value read as TOML: 1, 0.05,
    true, "ppo")."""
    import tomllib

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--adapt wants FIELD=VALUE (got {pair!r})")
        out |= tomllib.loads(f"{key.strip()} = {value.strip()}")
    return out


def _stage_ends(run_dir: Path, stages: int) -> dict[int, list[float]]:
    """Per stage process (by pid): the wall end times of its iterations."""
    out: dict[int, list[float]] = {}
    for stage in range(stages):
        recs = [json.loads(x) for x in (run_dir / "stages" / f"stage-{stage}.jsonl").open()]
        pid = next(r["pid"] for r in reversed(recs) if r.get("event") == "ready")
        out[pid] = sorted(r["end_time"] for r in recs if "end_time" in r)
    return out


def decisions(control: Path) -> dict[str, Any]:
    """The controller calls' own ``seconds`` from control.jsonl (median, p99, max) and
    their threads' CPU (``cpu_seconds``, where logged: median and max)."""
    events = [json.loads(x) for x in control.read_text().splitlines()] if control.exists() else []
    calls = [e for e in events if e.get("event") == "decision"]
    secs = sorted(e["seconds"] for e in calls)
    if not secs:
        return {"count": 0}
    p99 = secs[min(len(secs) - 1, math.ceil(0.99 * len(secs)) - 1)]
    cpu = sorted(e["cpu_seconds"] for e in calls if "cpu_seconds" in e)
    return {
        "count": len(secs),
        "median_ms": round(statistics.median(secs) * 1e3, 3),
        "p99_ms": round(p99 * 1e3, 3),
        "max_ms": round(secs[-1] * 1e3, 3),
        "over_10ms": sum(1 for s in secs if s > 0.010),
        "cpu_median_ms": round(statistics.median(cpu) * 1e3, 3) if cpu else None,
        "cpu_max_ms": round(cpu[-1] * 1e3, 3) if cpu else None,
        "unchanged": sum(1 for e in calls if "unchanged_since" in (e.get("inputs") or {})),
        "acted": sum(1 for e in events if e.get("event") == "decision" and e.get("acted")),
        "errors": sum(1 for e in events if e.get("event") == "decision" and "error" in e),
        "migrations": sum(1 for e in events if e.get("event") == "migration"),
    }


def train_once(args: argparse.Namespace, *, monitored: bool, act: bool = False) -> dict[str, Any]:
    from adaptipe.controllers.live import decider
    from adaptipe.runtime import pace, train
    from adaptipe.runtime.rundir import RunDir

    if args.adapt_poll_s is not None:
        pace.ADAPT_POLL_S = args.adapt_poll_s  # read by the manager's loop each pass

    with tempfile.TemporaryDirectory(prefix="adaptipe-bench-overhead-") as tmp:
        config = _config(args, f"{tmp}/run", monitored=monitored, act=act)
        with Sampler(args.sample_s) as sampler:

            def on_iteration(rec: dict[str, Any], total: int) -> None:
                if rec["iteration"] >= args.warmup:
                    sampler.mark()

            summary = train(
                config, on_iteration=on_iteration, decider=decider if monitored else None
            )
        run = RunDir(summary.run_dir)
        times = [r["iteration_s"] for r in run.read_metrics()[args.warmup :]]
        ends = _stage_ends(Path(summary.run_dir), 2)
        assert sampler.mark_at is not None
        first, last = window(sampler.snaps, sampler.mark_at, ends)
        acc = account(sampler.snaps, first, last, os.getpid(), ends)
        control = decisions(Path(summary.run_dir) / "control.jsonl")
    return {
        "median_s": statistics.median(times),
        "account": acc,
        "decisions": control,
        "window_s": round(sampler.snaps[last].time_s - sampler.snaps[first].time_s, 2),
    }


def _ms(d: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v * 1e3, 3) for k, v in sorted(d.items())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=80, help="timed, after warm-up")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--model",
        choices=("mlp", "gpt-array"),
        default="mlp",
        help="gpt-array: `adaptipe demo`'s 4 GPT jobs as one job-array (its [adapt] "
        "settings: a check every 3 iterations), without its slowdown",
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--controller", default="threshold", help="B's [adapt].controller")
    parser.add_argument("--sample-s", type=float, default=0.5, help="/proc sampling period")
    parser.add_argument("--act", action="store_true", help="also one always_best run that moves")
    parser.add_argument(
        "--adapt-poll-s",
        type=float,
        default=None,
        help="the manager's poll period while a controller decides (default: the "
        "runtime's ADAPT_POLL_S); a what-if, patched into this process",
    )
    parser.add_argument(
        "--telemetry-interval-s",
        type=float,
        default=None,
        help="B's [train].telemetry_interval_s, the device samplers' period (default: "
        "the config's); a what-if",
    )
    parser.add_argument(
        "--adapt",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="B's [adapt] FIELD (repeatable), e.g. check_every=1, unchanged=0",
    )
    args = parser.parse_args()
    if args.act and args.model != "mlp":
        parser.error("--act runs the mlp (lopsided bounds over its blocks); drop --model")
    print(json.dumps(measure(args)))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    started, load0 = time.time(), os.getloadavg()
    pairs: list[dict[str, Any]] = []
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        got = {on: train_once(args, monitored=on) for on in order}
        a, b = got[False], got[True]
        acc_a, acc_b = a["account"], b["account"]
        main_extra = acc_b.manager.get("main", 0.0) - acc_a.manager.get("main", 0.0)
        monitor = acc_b.monitor_manager() + max(0.0, main_extra) + acc_b.monitor_stage()
        pairs.append(
            {
                "pair": pair,
                "first": "B" if order[0] else "A",
                "A_median_ms": round(a["median_s"] * 1e3, 3),
                "B_median_ms": round(b["median_s"] * 1e3, 3),
                "throughput_B_over_A": round(a["median_s"] / b["median_s"], 4),
                "A_manager_ms_per_it": _ms(acc_a.manager),
                "B_manager_ms_per_it": _ms(acc_b.manager),
                "A_stages_ms_per_it": _ms(acc_a.stages),
                "B_stages_ms_per_it": _ms(acc_b.stages),
                "B_main_extra_ms_per_it": round(main_extra * 1e3, 3),
                "B_monitor_ms_per_it": round(monitor * 1e3, 3),
                "B_training_ms_per_it": round(acc_b.training() * 1e3, 3),
                "ratio": round(monitor / acc_b.training(), 5),
                # everything the manager process did in the window (merging and logging
                # too, which a run without telemetry also pays), plus the stages' monitors
                "ratio_manager_total": round(
                    (acc_b.manager_total() + acc_b.monitor_stage()) / acc_b.training(), 5
                ),
                # the stages' own training threads, B over A: the inline publish's cost
                "training_cpu_B_over_A": round(acc_b.training() / acc_a.training(), 4),
                "window_s": {"A": a["window_s"], "B": b["window_s"]},
                "iterations_in_window": {
                    "A": round(acc_a.iterations, 1),
                    "B": round(acc_b.iterations, 1),
                },
                "decisions": b["decisions"],
            }
        )
        print(json.dumps(pairs[-1]), file=sys.stderr)

    def med(key: str) -> float:
        return round(float(statistics.median(p[key] for p in pairs)), 5)

    ratios = [p["ratio"] for p in pairs]
    out: dict[str, Any] = {
        "bench": "overhead",
        "model": (
            f"mlp {args.blocks} x Linear({args.hidden}), 2 stages, 1f1b, batch "
            f"{args.batch} in 8 micro-batches, 1 thread per stage, partition even"
            if args.model == "mlp"
            else "adaptipe demo's 4 GPT jobs as one job-array, 2 stages, 1f1b, dynpipe"
        ),
        "B": f"telemetry on, [adapt] controller = {args.controller!r}, dry_run = true",
        "adapt": adapt_overrides(args.adapt),
        "A": "telemetry off, no controller",
        "adapt_poll_s": args.adapt_poll_s or _adapt_poll_s(),
        "telemetry_interval_s": args.telemetry_interval_s or _telemetry_interval_s(),
        "iterations_timed": args.iterations,
        "warmup": args.warmup,
        "sample_s": args.sample_s,
        "pairs": pairs,
        "ratio_median": med("ratio"),
        "ratio_max": max(ratios),
        "ratio_iqr": round(_iqr(ratios), 5),
        "ratio_manager_total_median": med("ratio_manager_total"),
        "throughput_B_over_A_median": med("throughput_B_over_A"),
        "throughput_B_over_A_range": [
            min(p["throughput_B_over_A"] for p in pairs),
            max(p["throughput_B_over_A"] for p in pairs),
        ],
        "training_cpu_B_over_A_median": med("training_cpu_B_over_A"),
        "decision_ms": _pooled([p["decisions"] for p in pairs]),
        "target_ratio": TARGET,
        "ok": statistics.median(ratios) < TARGET,
    }
    if args.act:
        b = train_once(args, monitored=True, act=True)
        acc = b["account"]
        out["acting_run"] = {
            "config": "always_best, dry_run = false, partition [0, 1, blocks]",
            "median_ms": round(b["median_s"] * 1e3, 3),
            "manager_ms_per_it": _ms(acc.manager),
            "stages_ms_per_it": _ms(acc.stages),
            "ratio_without_main": round(
                (acc.monitor_manager() + acc.monitor_stage()) / acc.training(), 5
            ),
            "decisions": b["decisions"],
        }
    out["load_average"] = {"start": load0, "end": os.getloadavg()}
    out["seconds"] = round(time.time() - started, 1)
    return out


def _adapt_poll_s() -> float:
    from adaptipe.runtime.pace import ADAPT_POLL_S

    return float(ADAPT_POLL_S)


def _telemetry_interval_s() -> float:
    from adaptipe.runtime.config_sections import TrainSection

    return float(TrainSection().telemetry_interval_s)


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The pairs' decision figures together: count, and the worst median, p99 and max."""
    runs = [r for r in runs if r.get("count")]
    if not runs:
        return {"count": 0}
    return {
        "count": sum(r["count"] for r in runs),
        "median_ms_max_over_runs": max(r["median_ms"] for r in runs),
        "p99_ms_max_over_runs": max(r["p99_ms"] for r in runs),
        "max_ms": max(r["max_ms"] for r in runs),
        "over_10ms": sum(r.get("over_10ms", 0) for r in runs),
        "unchanged": sum(r.get("unchanged", 0) for r in runs),
        "cpu_max_ms": max((r["cpu_max_ms"] for r in runs if r.get("cpu_max_ms")), default=None),
    }


if __name__ == "__main__":
    main()
