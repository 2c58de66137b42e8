"""What asking "does this window go on?" before every round costs a job-array stage.

A job-array window ends at the next iteration when a plan version is committed while it
runs (`adaptipe.runtime.windowcut`): before each round rank 0 reads the run's newest
version and sends one word to every other stage, which waits for it at its own first
instruction of the round. This bench times that exchange alone in two gloo processes
(what each round pays), and the work one stage does per round in the job-array
bench's setting (`bench_jobarray.py`: 16 x Linear(1024) over 2 stages, so 8 layers
per stage, 4 jobs of batch 256, forward and backward, one thread), measured here in the
same run; the share is the first over the second. Prints one JSON object.

    python bench/bench_window_cut.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from adaptipe.runtime.planversion import current_version
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.windowcut import WindowCut


def _stage_round_s(repeats: int = 5) -> float:
    """One stage's compute per round in bench_jobarray's setting (median seconds)."""
    import torch

    torch.set_num_threads(1)
    layers = [m for _ in range(8) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())]
    stage = torch.nn.Sequential(*layers)
    x = torch.randn(256, 1024)
    samples = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for _job in range(4):
            stage(x).sum().backward()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, run_dir: str, rounds: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    run = RunDir(Path(run_dir))
    cut = WindowCut(
        rank=rank,
        world=2,
        per_round=1,
        newer=lambda: current_version(run) > 0,
        group=dist.new_group(backend="gloo"),
        max_rounds=32,
    )
    times = []
    for epoch in range(rounds // 31):
        dist.barrier()
        cut.begin(epoch, 32)
        t0 = time.perf_counter()
        for r in range(1, 32):
            assert cut.enter(r)
        cut.end()
        times.append((time.perf_counter() - t0) / 31)
    out.put((rank, statistics.median(times)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "control").mkdir()
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        port = _free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, port, tmp, args.rounds, out)) for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        per_rank = dict(out.get() for _ in procs)
    worst = max(per_rank.values())
    round_s = _stage_round_s()
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "per_round_s": {str(r): per_rank[r] for r in sorted(per_rank)},
                "stage_round_s": round_s,
                "share_of_round": worst / round_s,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
