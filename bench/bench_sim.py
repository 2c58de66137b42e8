"""Benchmark the simulator: many iterations of 8-stage 1F1B x 32 micro-batches with
communication on, via `simulate_iterations` (max-plus, vectorised) versus a loop of
`simulate(record=False)` chained iteration by iteration; and the schedule validator on
a big schedule (interleaved 8 stages x 64 micro-batches x 4 chunks with recomputation;
target under 0.5 s). Prints one JSON object."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from adaptipe.schedule.build import build_schedule
from adaptipe.schedule.interleaved import interleaved
from adaptipe.schedule.validate import validate
from adaptipe.sim import CostModel, simulate, simulate_iterations
from adaptipe.sim.engine import compile_schedule

STAGES, MICROBATCHES, ITERATIONS, LOOP_ITERATIONS = 8, 32, 1000, 200


def main() -> None:
    schedule = build_schedule("1f1b", stages=STAGES, microbatches=MICROBATCHES)
    g = schedule.num_virtual_stages
    costs = dataclasses.replace(
        CostModel.uniform_for(schedule, forward=0.010, backward=0.020),
        activation_bytes=[[4e6] * g],
        gradient_bytes=[[4e6] * g],
        bandwidth_Bps=10e9,
        latency_s=20e-6,
    )
    slowdown = np.random.default_rng(0).uniform(1.0, 1.5, size=(ITERATIONS, STAGES))

    t = time.perf_counter()
    compiled = compile_schedule(schedule)
    compile_s = time.perf_counter() - t

    simulate_iterations(schedule, costs, 10, slowdown=slowdown[:10])  # warm caches
    t = time.perf_counter()
    fast = simulate_iterations(schedule, costs, ITERATIONS, slowdown=slowdown)
    fast_s = time.perf_counter() - t

    t = time.perf_counter()
    prev = simulate(schedule, dataclasses.replace(costs, slowdown=tuple(slowdown[0])), record=False)
    for i in range(1, LOOP_ITERATIONS):
        step = dataclasses.replace(costs, slowdown=tuple(slowdown[i]))
        prev = simulate(
            schedule, step, record=False, start_s=prev.end_s, link_free_s=prev.link_free_s
        )
    loop_s = time.perf_counter() - t
    loop_per_iter = loop_s / LOOP_ITERATIONS
    agree = bool(np.allclose(fast.worker_end_s[LOOP_ITERATIONS - 1], prev.end_s, rtol=1e-12))

    big = interleaved(8, 64, 4, recompute=True)
    validate(big)  # warm up
    t = time.perf_counter()
    validate(big)
    validate_s = time.perf_counter() - t

    print(
        json.dumps(
            {
                "bench": "sim",
                "schedule": "1f1b",
                "stages": STAGES,
                "microbatches": MICROBATCHES,
                "instructions": schedule.num_instructions(),
                "ops": compiled.num_ops,
                "links": len(compiled.links),
                "state_size": compiled.num_state,
                "compile_s": round(compile_s, 6),
                "iterations": ITERATIONS,
                "simulate_iterations_s": round(fast_s, 6),
                "simulate_iterations_per_iter_s": round(fast_s / ITERATIONS, 9),
                "loop_iterations": LOOP_ITERATIONS,
                "simulate_loop_s": round(loop_s, 6),
                "simulate_loop_per_iter_s": round(loop_per_iter, 9),
                "loop_estimated_s_for_all_iterations": round(loop_per_iter * ITERATIONS, 6),
                "speedup": round(loop_per_iter * ITERATIONS / fast_s, 2),
                "loop_matches_fast": agree,
                "mean_iteration_s": round(fast.mean_iteration_s, 9),
                "under_1s": fast_s < 1.0,
                "validate_8x64x4_instructions": big.num_instructions(),
                "validate_8x64x4_s": round(validate_s, 6),
                "validate_under_0_5s": validate_s < 0.5,
            }
        )
    )


if __name__ == "__main__":
    main()
