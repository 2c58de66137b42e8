"""Benchmark the cost of telemetry to a training stage. Prints one JSON object.

Default mode, per message: a collector runs in its own process, as the manager would.
The stage side measures (1) the CPU cost of one StageStats publish (build with
validation, encode, queue) and of queueing a ready frame, and (2) the CPU share of the
device-sampler thread at its default interval. The overhead ratio is for a 50 ms
iteration that publishes one StageStats and carries a sample every 200 ms; the target
(docs/benchmarks.md, Targets) is monitoring and control together under 1%.

``--training``, end to end: the same run (2-stage ``mlp``, 1F1B, one thread per stage)
trained with ``[train] telemetry = true`` (collector, stage stats, device sampler, link
timing) and ``= false``, in pairs, compares the median iteration time after warm-up.
The machine's speed drifts between runs, so the ratio is taken within each pair, and
every other pair runs its two halves in the other order (AB BA AB ...) so a steady drift
cancels out in the median. Wall time on a shared machine mostly measures the other load,
so each run also reports the stage processes' CPU time per iteration (from /proc, read
while they train, against how far each had got by then): what monitoring costs in CPU,
which is what it takes from training whenever the cores are contended.

    python bench/bench_monitor.py
    python bench/bench_monitor.py --training [--pairs 4] [--iterations 100] [--warmup 10]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer import mlp_model

from adaptipe.monitor import Publisher, StageStats

ROOT = Path(__file__).resolve().parent.parent
MESSAGES, WARMUP, LAYERS = 20_000, 2_000, 16
ITERATION_S, INTERVAL_S, SAMPLER_S = 0.050, 0.2, 4.0
COLLECTOR = """
import sys
from adaptipe.monitor import Collector
with Collector(hwm=1_000_000).start() as c:
    print(c.address, flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin
    print(c.accepted, sum(c.rejected.values()), flush=True)
"""


def _stats(iteration: int) -> StageStats:
    return StageStats(
        run_id="bench",
        stage=0,
        iteration=iteration,
        time_s=time.time(),
        first_layer=0,
        forward_s=(0.001,) * LAYERS,
        backward_s=(0.002,) * LAYERS,
        compute_s=0.045,
        wait_s=0.003,
        comm_s=0.002,
        iteration_s=ITERATION_S,
        in_flight=2,
        memory_allocated_bytes=1 << 28,
        memory_reserved_bytes=1 << 29,
        loss=2.0,
    )


def _cpu_us(fn: Callable[[int], object], n: int) -> float:
    """CPU microseconds of this thread per call (wall time would count the collector)."""
    t0 = time.thread_time()
    for i in range(n):
        fn(i)
    return (time.thread_time() - t0) / n * 1e6


def per_message() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", COLLECTOR],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        address = proc.stdout.readline().strip()
        publisher = Publisher(address, stage=0, hwm=1_000_000)
        _cpu_us(lambda i: publisher.publish(_stats(i)), WARMUP)
        publish_us = _cpu_us(lambda i: publisher.publish(_stats(i)), MESSAGES)
        frame = _stats(0).to_wire()
        send_us = _cpu_us(lambda i: publisher.publish_frame(frame), MESSAGES)
        build_us = _cpu_us(lambda i: _stats(i), MESSAGES)

        sampler = publisher.start_sampler(interval_s=INTERVAL_S)
        t0 = time.monotonic()
        time.sleep(SAMPLER_S)
        wall = time.monotonic() - t0
        samples, sampler_cpu_s = sampler.samples, sampler.cpu_s
        time.sleep(0.5)  # let the last frames out before closing
        sent, dropped = publisher.sent, publisher.dropped
        publisher.close(linger_s=1.0)
        proc.stdin.close()
        accepted, rejected = (int(x) for x in proc.stdout.readline().split())
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    sample_us = sampler_cpu_s / max(samples, 1) * 1e6
    sampler_share = sampler_cpu_s / wall
    per_iteration_s = publish_us * 1e-6 + sample_us * 1e-6 * ITERATION_S / INTERVAL_S
    ratio = per_iteration_s / ITERATION_S
    print(
        json.dumps(
            {
                "bench": "monitor",
                "layers_per_stage": LAYERS,
                "frame_bytes": len(frame),
                "publish_us": round(publish_us, 2),
                "build_us": round(build_us, 2),
                "send_frame_us": round(send_us, 2),
                "sampler_interval_s": INTERVAL_S,
                "sampler_samples": samples,
                "sample_us": round(sample_us, 1),
                "sampler_cpu_share": round(sampler_share, 6),
                "iteration_s": ITERATION_S,
                "overhead_ratio": round(ratio, 6),
                "target_ratio": 0.01,
                "ok": ratio < 0.01,
                "sent": sent,
                "dropped": dropped,
                "collector_accepted": accepted,
                "collector_rejected": rejected,
            }
        )
    )


class _CpuMeter:
    """CPU seconds per iteration of each stage process, sampled during training."""

    def __init__(self, run_dir: Path, stages: int, warmup: int) -> None:
        self.run_dir, self.stages, self.warmup = run_dir, stages, warmup
        self.pids: list[int] = []
        self.marks: list[tuple[float, list[float]]] = []  # (wall time, CPU s per stage)

    def __call__(self, record: dict[str, Any], total: int) -> None:
        if record["iteration"] < self.warmup:
            return
        if not self.pids:
            for stage in range(self.stages):
                path = self.run_dir / "stages" / f"stage-{stage}.jsonl"
                ready = [json.loads(x) for x in path.read_text().splitlines() if '"ready"' in x]
                self.pids.append(ready[-1]["pid"])
        try:
            cpu = [_proc_cpu_s(pid) for pid in self.pids]
        except (OSError, IndexError, ValueError):  # a stage already exited
            return
        self.marks.append((time.time(), cpu))

    def per_iteration_s(self) -> list[float]:
        """Per stage: CPU seconds over iterations done between the first and last mark."""
        if len(self.marks) < 2:
            return [math.nan] * self.stages
        (t0, cpu0), (t1, cpu1) = self.marks[0], self.marks[-1]
        out = []
        for stage in range(self.stages):
            path = self.run_dir / "stages" / f"stage-{stage}.jsonl"
            ends = [
                rec["end_time"]
                for rec in map(json.loads, path.read_text().splitlines())
                if "end_time" in rec
            ]
            done = _progress(ends, t1) - _progress(ends, t0)
            out.append((cpu1[stage] - cpu0[stage]) / done)
        return out


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _progress(ends: list[float], t: float) -> float:
    """Iterations finished at wall time ``t`` (fractional, from each one's end time)."""
    k = sum(1 for e in ends if e <= t)
    if k == 0 or k == len(ends):
        return float(k)
    return k + (t - ends[k - 1]) / (ends[k] - ends[k - 1])


def _train_once(
    *, telemetry: bool, hidden: int, blocks: int, batch: int, iterations: int, warmup: int
) -> dict[str, Any]:
    from adaptipe.runtime import train
    from adaptipe.runtime.config import RunConfig
    from adaptipe.runtime.rundir import RunDir

    with tempfile.TemporaryDirectory(prefix="adaptipe-bench-monitor-") as tmp:
        config = RunConfig.from_dict(
            {
                "model": mlp_model(hidden, blocks, batch * 8),
                "data": {"batch_size": batch, "microbatches": 8},
                "optimizer": {"name": "sgd", "lr": 1e-3},
                "pipeline": {"stages": 2, "schedule": "1f1b"},
                "train": {
                    "iterations": warmup + iterations,
                    "threads_per_stage": 1,
                    "telemetry": telemetry,
                    "run_dir": f"{tmp}/run",
                },
            },
            source="bench_monitor",
        )
        cpu = _CpuMeter(Path(tmp) / "run", 2, warmup)
        summary = train(config, on_iteration=cpu)
        run = RunDir(summary.run_dir)
        times = [r["iteration_s"] for r in run.read_metrics()[warmup:]]
        cpu_s = sum(cpu.per_iteration_s())
        kinds: dict[str, int] = {}
        if run.telemetry.exists():
            for line in run.telemetry.read_text().splitlines():
                kind = json.loads(line)["type"]
                kinds[kind] = kinds.get(kind, 0) + 1
    return {"median_s": statistics.median(times), "cpu_s": cpu_s, "records": kinds}


def training(args: argparse.Namespace) -> None:
    """Median iteration time with and without monitoring, same config and length."""
    shape = {
        "hidden": args.hidden,
        "blocks": args.blocks,
        "batch": args.batch,
        "iterations": args.iterations,
        "warmup": args.warmup,
    }
    pairs: list[dict[str, Any]] = []
    started = time.time()
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        got = {on: _train_once(telemetry=on, **shape) for on in order}
        on, off = got[True]["median_s"], got[False]["median_s"]
        cpu_on, cpu_off = got[True]["cpu_s"], got[False]["cpu_s"]
        pairs.append(
            {
                "pair": pair,
                "first": "on" if order[0] else "off",
                "on_median_ms": round(on * 1e3, 3),
                "off_median_ms": round(off * 1e3, 3),
                "overhead_ratio": round(on / off - 1, 5),
                "on_cpu_ms_per_iteration": round(cpu_on * 1e3, 2),
                "off_cpu_ms_per_iteration": round(cpu_off * 1e3, 2),
                "cpu_overhead_ratio": round(cpu_on / cpu_off - 1, 5),
                "on_records": got[True]["records"],
                "off_records": got[False]["records"],
            }
        )
        print(json.dumps(pairs[-1]), file=sys.stderr)
    ratios = [p["overhead_ratio"] for p in pairs]
    median = statistics.median(ratios)
    cpu_ratios = [p["cpu_overhead_ratio"] for p in pairs]
    print(
        json.dumps(
            {
                "bench": "monitor-training",
                "model": f"mlp {args.blocks} x Linear({args.hidden}), 2 stages, 1f1b, "
                f"batch {args.batch} in 8 micro-batches, 1 thread per stage",
                "iterations_timed": args.iterations,
                "warmup": args.warmup,
                "pairs": pairs,
                "overhead_ratio_median": round(median, 5),
                "overhead_ratio_min": min(ratios),
                "overhead_ratio_max": max(ratios),
                "cpu_overhead_ratio_median": round(statistics.median(cpu_ratios), 5),
                "cpu_overhead_ratio_min": min(cpu_ratios),
                "cpu_overhead_ratio_max": max(cpu_ratios),
                "target_ratio": 0.01,
                # the spread of the pairs' ratios; with it above the target the median
                # says nothing about the target, and "ok" stays false
                "overhead_ratio_iqr": round(_iqr(ratios), 5),
                "cpu_overhead_ratio_iqr": round(_iqr(cpu_ratios), 5),
                "ok": median < 0.01 and _iqr(ratios) < 0.01,
                "seconds": round(time.time() - started, 1),
            }
        )
    )


def _iqr(xs: list[float]) -> float:
    if len(xs) < 2:
        return math.inf
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--training", action="store_true", help="train with and without telemetry, in pairs"
    )
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=100, help="timed, after warm-up")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    if args.training:
        training(args)
    else:
        per_message()


if __name__ == "__main__":
    main()
