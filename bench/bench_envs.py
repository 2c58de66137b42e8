"""What an environment step costs: the simulation, the candidates and the observation.

Runs whole episodes of ``adaptipe/PipelineRepartition-v0`` and ``PipelineSwitch-v0``
(the zoo GPT, 16 layers, on 4 stages, 8 micro-batches, 10 iterations a step) under the
training families, with random actions, and prints one JSON object: seconds per step
and per simulated iteration (median over episodes), and the simulator alone per
iteration for the same partitions, as the reference. Target: well under 1 ms of
simulation per iteration.

    python bench/bench_envs.py [--episodes 5] [--candidates 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from adaptipe.envs.episode import Episode
from adaptipe.envs.gym_envs import PipelineRepartition, PipelineSwitch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--candidates", type=int, default=4)
    args = ap.parse_args()
    out: dict[str, object] = {"model": "gpt (16 layers)", "stages": 4, "microbatches": 8}
    for name, env in (
        ("PipelineRepartition-v0", PipelineRepartition(candidates=args.candidates)),
        ("PipelineSwitch-v0", PipelineSwitch()),
    ):
        per_step, per_iteration, sim_only = [], [], []
        for e in range(args.episodes):
            env.reset(seed=e)
            rng = np.random.default_rng(e)
            steps, t0, done = 0, time.perf_counter(), False
            while not done:
                _, _, done, _, _ = env.step(int(rng.integers(env.action_space.n)))
                steps += 1
            seconds = time.perf_counter() - t0
            per_step.append(seconds / steps)
            per_iteration.append(seconds / (steps * env.settings.iterations_per_step))
            episode = env.episode
            assert episode is not None
            replay = Episode(episode.trace, env.settings)
            t0 = time.perf_counter()
            for r in episode.history:
                replay.run(r.bounds)
            sim_only.append((time.perf_counter() - t0) / episode.trace.iterations)
        out[name] = {
            "episodes": args.episodes,
            "step_s": statistics.median(per_step),
            "per_iteration_s": statistics.median(per_iteration),
            "simulation_per_iteration_s": statistics.median(sim_only),
            "target": "well under 1e-3 s of simulation per iteration",
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
