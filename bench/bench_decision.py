"""What a whole learned decision costs on this CPU: features, forest, candidates,
predictor, policy.

Replays episodes of the held-out traces (the zoo GPT, 16 layers, on 4 stages) and, at
every step's observation, times each part of one decision as the learned controllers
chain it, on one thread:

1. **features + forest**: each stage's input row (`adaptipe.controllers.interference`:
   its device features and stage features) and the forest's predicted slowdowns;
2. **candidates**: `top_k` (4 candidates) on those slowdowns, scored by the simulator;
3. **predictor**: the LSTM's mean iteration time of the partition in force and of each
   candidate over the next 10 iterations;
4. **policy**: the PPO switch policy on the encoded observation.

Prints one JSON object: the median and p99 milliseconds of each part and of the
whole, and of the whole's CPU time on its thread (``whole_cpu``: what it costs when
other jobs share the cores, as wall time then also counts the waits for a core).
Target: a whole decision under 10 ms.

    python bench/bench_decision.py [--traces 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from adaptipe.controllers.candidates import top_k
from adaptipe.controllers.encode import encode
from adaptipe.controllers.interference import features, load_interference, stage_info
from adaptipe.controllers.predictor import load_predictor
from adaptipe.controllers.switch_policy import load_switch
from adaptipe.envs.episode import Episode, EpisodeSettings
from adaptipe.envs.heldout import heldout_traces

PARTS = ("features_forest", "candidates", "predictor", "policy", "whole")
SERIES = (*PARTS, "whole_cpu")


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": round(statistics.median(ordered) * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--traces", type=int, default=6, help="held-out traces to replay (one a family)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    forest, predictor, policy = load_interference(), load_predictor(), load_switch(stages=4)
    settings = EpisodeSettings(model="gpt", stages=4)
    profile = settings.profile
    traces = heldout_traces()[:: max(len(heldout_traces()) // args.traces, 1)][: args.traces]
    times: dict[str, list[float]] = {p: [] for p in SERIES}
    for trace in traces:
        episode = Episode(trace, settings, seed=trace.seed or 0)
        episode.run()
        while not episode.done:
            obs = episode.observation()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            rows = np.stack([
                features(obs.device[s], stage_info(profile, obs.bounds, s))
                for s in range(obs.num_stages)
            ])  # fmt: skip
            slow = tuple(float(v) for v in forest.predict(rows))
            t1 = time.perf_counter()
            found = top_k(obs, slow, 4)
            t2 = time.perf_counter()
            predictor.predict(obs, [obs.bounds, *(b for b, _ in found)])
            t3 = time.perf_counter()
            k = policy.config.candidates
            best = [t for _, t in found[:k]] + [found[-1][1] if found else 0.0] * max(
                k - len(found), 0
            )
            policy.act(encode(obs, best[:k], slowdowns=slow))
            t4 = time.perf_counter()
            times["whole_cpu"].append(time.thread_time() - c0)
            for part, seconds in zip(
                PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True
            ):
                times[part].append(seconds)
            episode.run()
    out: dict[str, Any] = {
        "setting": "gpt (16 layers), 4 stages, 8 micro-batches; one thread",
        "decisions": len(times["whole"]),
        "target": "whole decision under 10 ms at p99",
    }
    out |= {part: _ms(samples) for part, samples in times.items()}
    out["target_met"] = out["whole"]["p99_ms"] < 10.0
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
