"""Memory manager cost: one stage of a job-array with fewer resident job states than jobs.

One stage holds ``--layers`` Linear(width, width) layers per job with Adam state, and
runs its blocks in two-stage 1F1B order over ``--jobs`` jobs (F0 F1 B0 F2 B1 ...; a
forward and a backward with its just-in-time step per job). Three ways, in one run,
interleaved round by round so drift hits them alike:

- ``resident``: every state stays on the device (the peer);
- ``prefetch``: ``--budget`` states resident, the next blocks' states copied in the
  background (a CUDA stream on GPU, a thread on CPU) in schedule order;
- ``on-demand``: the same budget, each state loaded only when its block needs it.

Prints JSON: per-iteration seconds (medians), their ratios to ``resident``, the seconds
per iteration the host waited for copies (on CUDA a block waits for its state on the
GPU, which shows in the iteration time only), and how many job states were on the
device at most (the memory the budget saves is that count times ``job_state_bytes``).

    python bench/bench_memory.py [--device cuda] [--jobs 8 --budget 3 --batch 8192]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from adaptipe.runtime.binder import Binder
from adaptipe.runtime.config import OptimizerSection
from adaptipe.runtime.memory import MemoryManager
from adaptipe.runtime.sweep import JobSpec

MODES = ("resident", "prefetch", "on-demand")


def _order(jobs: int) -> list[int]:
    """Stage 0 of two-stage 1F1B, one block per job: F0 F1 B0 F2 B1 ... F(J-1) B(J-2) B(J-1)."""
    out = [0]
    for j in range(1, jobs):
        out += [j, j - 1]
    return [*out, jobs - 1]


def _binder(args: argparse.Namespace, device: torch.device) -> Binder:
    def build_layer(index: int, seed: int) -> nn.Module:
        torch.manual_seed(seed * 1000 + index)
        return nn.Linear(args.width, args.width).to(device)

    jobs = [
        JobSpec(
            index=j,
            name=f"job{j}",
            optimizer=OptimizerSection(name="adam", lr=1e-4 * (j + 1)),
            batch_size=args.batch,
            seed=j,
            data_seed=j,
        )
        for j in range(args.jobs)
    ]
    return Binder(
        layers=list(range(args.layers)),
        jobs=jobs,
        build_layer=build_layer,
        make_optimizer=lambda job, params: job.optimizer.build(params),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _iteration(
    binder: Binder, mm: MemoryManager | None, order: list[int], x: torch.Tensor, layers: list[int]
) -> None:
    first = {j: order.index(j) for j in set(order)}
    losses: dict[int, torch.Tensor] = {}
    if mm is not None:
        mm.begin_iteration()
    for pos, job in enumerate(order):
        if mm is not None:
            mm.before_block(job)
        if pos == first[job]:
            losses[job] = binder.run(job, layers, x).square().mean()
        else:
            losses.pop(job).backward()
            binder.step(job)
            if mm is not None:
                mm.after_step(job)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--budget", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, help="layer width (default 2048 on CUDA, 512 on CPU)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--iterations", type=int, default=10, help="timed rounds per mode")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.width = args.width or (2048 if device.type == "cuda" else 512)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is false")
    if not 0 < args.budget < args.jobs:
        p.error(f"--budget must be in 1..{args.jobs - 1} (got {args.budget})")
    order, layers = _order(args.jobs), list(range(args.layers))
    x = torch.randn(args.batch, args.width, device=device)
    runs: dict[str, tuple[Binder, MemoryManager | None]] = {}
    for mode in MODES:
        binder = _binder(args, device)
        mm = (
            None
            if mode == "resident"
            else MemoryManager(
                binder, budget=args.budget, device=device, order=order, prefetch=mode == "prefetch"
            )
        )
        runs[mode] = (binder, mm)
        _iteration(binder, mm, order, x, layers)  # warm-up: optimizer state, allocator
    _sync(device)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.iterations):
        for mode in MODES:
            binder, mm = runs[mode]
            t0 = time.perf_counter()
            _iteration(binder, mm, order, x, layers)
            _sync(device)
            times[mode].append(time.perf_counter() - t0)
    state_bytes = sum(
        p.numel() * p.element_size() * 4  # parameter, gradient, Adam's two moments
        for p in runs["resident"][0].params(0, layers)[0].values()
    ) * len(layers)
    median = {m: statistics.median(times[m]) for m in MODES}
    out: dict[str, Any] = {
        "bench": "memory",
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "jobs": args.jobs,
        "budget": args.budget,
        "job_state_bytes": state_bytes,
        "iteration_s": median,
        "ratio_to_resident": {m: median[m] / median["resident"] for m in MODES},
        "host_wait_s": {
            m: (mm.wait_s / (args.iterations + 1)) for m, (_, mm) in runs.items() if mm is not None
        },
        "misses": {m: mm.misses for m, (_, mm) in runs.items() if mm is not None},
        "peak_resident_states": {
            m: args.jobs if mm is None else mm.peak_resident for m, (_, mm) in runs.items()
        },
    }
    for _, mm in runs.values():
        if mm is not None:
            mm.close()
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
