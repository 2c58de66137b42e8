"""How well the LSTM speed predictor predicts, and what a prediction costs.

Replays the held-out traces (`adaptipe.envs.heldout.heldout_traces`: 5 seeds per
family, 200 iterations, the zoo GPT on 4 stages, 8 micro-batches, K = 10) with the
training rollouts' candidates (the partition in force, the analytical model's best
three, two at random) and prints one JSON object: per family the MAPE of the predictor,
of the analytical model (the simulator fed the window's measured slowdowns and links,
`adaptipe.controllers.candidates.score`) and of persistence (the simulator fed the true
conditions of the last observed iteration: what remains is the conditions changing in
the next K iterations); the noise floor (each measured K-iteration mean predicted by
the previous one on a run with no interference); and the seconds of one
`Predictor.predict` for the partition in force and its four best candidates (median
over the replayed decisions, one thread). Targets: MAPE under 5% per family, a
decision under 10 ms.

``--bound`` adds per family the state oracle's MAPE (`adaptipe.envs.predictor_bound`:
it knows the present exactly, not the arrivals and departures to come; a floor for any
predictor that sees only the past). ``--recorded`` takes real runs: a run directory
(or a `compact_run` copy, as ``tests/data/predictor/``) is evaluated on its own
measured iteration times (`adaptipe.envs.predictor_eval.recorded_report`; a run with
no injection gives the noise floor as its ``previous``), a trace file (``adaptipe
controllers record``) is replayed through the simulator as the held-out traces are.

    python bench/bench_predictor.py [--artifact DIR] [--bound] [--recorded RUN|TRACE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from adaptipe.controllers.candidates import top_k
from adaptipe.controllers.predictor import load_predictor
from adaptipe.controllers.replan import stage_slowdowns
from adaptipe.envs.episode import Episode, EpisodeSettings
from adaptipe.envs.heldout import heldout_traces
from adaptipe.envs.predictor_eval import recorded_report
from adaptipe.envs.predictor_train import evaluate, heldout_report
from adaptipe.envs.trace import load_trace


def _decision_s(predictor, traces) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median seconds of `predict` (5 candidates) and of choosing the 4 (top_k)."""
    predict, choose = [], []
    for n, trace in enumerate(traces):
        episode = Episode(trace, EpisodeSettings(), seed=n)
        episode.run()
        while not episode.done:
            obs = episode.observation()
            t0 = time.perf_counter()
            cands = [b for b, _ in top_k(obs, stage_slowdowns(obs), 4)]
            t1 = time.perf_counter()
            predictor.predict(obs, [obs.bounds, *cands])
            t2 = time.perf_counter()
            choose.append(t1 - t0)
            predict.append(t2 - t1)
            episode.run()
    return statistics.median(predict), statistics.median(choose)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default=None, help="an artifact folder (default: shipped)")
    ap.add_argument("--bound", action="store_true", help="add the state oracle's MAPE")
    ap.add_argument(
        "--recorded", nargs="+", default=[], help="run directories or recorded trace files"
    )
    ap.add_argument("--skip-heldout", action="store_true", help="only the recorded runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    predictor = load_predictor(args.artifact)
    t0 = time.perf_counter()
    report = {} if args.skip_heldout else heldout_report(predictor, bound=args.bound)
    seconds = time.perf_counter() - t0
    if args.recorded:
        runs = [p for p in args.recorded if Path(p).is_dir()]
        traces = [load_trace(p) for p in args.recorded if not Path(p).is_dir()]
        report["recorded_runs"] = recorded_report(predictor, runs) if runs else {}
        if traces:
            report["recorded_traces_replayed"] = evaluate(predictor, traces)
    if args.skip_heldout:
        print(json.dumps(report, indent=1))
        return
    predict_s, choose_s = _decision_s(predictor, heldout_traces()[::5])
    out = {
        "model": "gpt (16 layers)",
        "stages": 4,
        "microbatches": 8,
        "horizon_k": predictor.config.horizon,
        "target": "< 5% MAPE per family",
        **report,
        "predict_ms_5_candidates": round(predict_s * 1e3, 3),
        "top_k_4_ms": round(choose_s * 1e3, 3),
        "eval_seconds": round(seconds, 1),
        "training": dict(predictor.meta.get("training", {})),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
