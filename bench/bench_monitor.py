"""Benchmark the cost of telemetry to a training stage. Prints one JSON object.

A collector runs in its own process, as the manager would. The stage side measures
(1) the CPU cost of one StageStats publish (build with validation, encode, queue) and
of queueing a ready frame, and (2) the CPU share of the device-sampler thread at its
default interval. The overhead ratio is for a 50 ms iteration that publishes one
StageStats and carries a sample every 200 ms; DESIGN.md asks for monitoring and
control together to stay under 1%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

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


def main() -> None:
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


if __name__ == "__main__":
    main()
