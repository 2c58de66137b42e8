"""The PPO switch policy on the held-out traces, against every baseline and the oracle.

Tunes the baselines on training traces (`adaptipe.envs.tuning`, as ``adaptipe
controllers eval`` does), runs them, the policy (`LearnedSwitch`, the shipped artifact
or ``--artifact``) and the oracle on the held-out manifest (5 seeds of each family),
and prints one JSON object:

- ``table``: per controller and family, mean/std/min/max fraction of the oracle;
- ``overall``: per controller, the mean fraction over all traces and the std over the
  seeds of each family's fractions (the mean of those stds: the seed-to-seed spread);
- ``must_show``: PPO against each non-oracle baseline (mean fraction minus the
  baseline's, against the baseline's spread; and the families where PPO trails a
  baseline by more than that baseline's std there) and against the oracle (throughput
  within 5%?);
- ``latency_s``: `LearnedSwitch.decide`'s median and p99 over observations taken from
  held-out episodes.

    python bench/bench_switch.py [--artifact DIR] [--families a,b] [--no-tune]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from adaptipe.controllers.switch_policy import LearnedSwitch, load_switch
from adaptipe.envs.episode import Episode, EpisodeSettings
from adaptipe.envs.evaluate import EvalReport, evaluate, warm_steps
from adaptipe.envs.heldout import heldout_traces
from adaptipe.envs.trace import Trace
from adaptipe.envs.tuning import baseline_factories, training_traces, tune_baselines


def _overall(report: EvalReport) -> dict[str, dict[str, float]]:
    rows = report.table()
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["controller"] for r in rows):
        runs = [r for r in report.runs if r.controller == name]
        mine = [r for r in rows if r["controller"] == name]
        out[name] = {
            "mean_fraction": statistics.fmean(r.fraction for r in runs),
            "throughput_over_oracle": sum(r.samples_per_s for r in runs)
            / sum(r.oracle_samples_per_s for r in runs),
            "spread": statistics.fmean(r["std"] for r in mine),
            "switches": statistics.fmean(r.switches for r in runs),
        }
    return out


def _per_family(report: EvalReport, learned: str) -> list[dict[str, Any]]:
    """Per baseline and family: the learned controller's mean fraction minus the
    baseline's, against the baseline's std over that family's seeds."""
    rows = {(r["controller"], r["family"]): r for r in report.table()}
    out = []
    for (name, family), row in rows.items():
        if name in (learned, "oracle"):
            continue
        diff = rows[(learned, family)]["mean"] - row["mean"]
        out.append({"baseline": name, "family": family, "ppo_minus_baseline": diff,
                    "baseline_std": row["std"], "ok": bool(diff >= -row["std"])})  # fmt: skip
    return out


def _must_show(report: EvalReport, overall: dict[str, dict[str, float]], learned: str) -> Any:
    ppo = overall[learned]
    against = {}
    for name, row in overall.items():
        if name in (learned, "oracle"):
            continue
        diff = ppo["mean_fraction"] - row["mean_fraction"]
        against[name] = {
            "ppo_minus_baseline": diff,
            "baseline_spread": row["spread"],
            "ok": bool(diff >= -row["spread"]),
        }
    return {
        "against_baselines": against,
        "per_family_failures": [r for r in _per_family(report, learned) if not r["ok"]],
        "oracle": {
            "throughput_over_oracle": ppo["throughput_over_oracle"],
            "ok": bool(ppo["throughput_over_oracle"] >= 0.95),
        },
    }


def _latency(controller: LearnedSwitch, traces: list[Trace], settings: EpisodeSettings) -> Any:
    seconds = []
    for trace in traces:
        episode = Episode(trace, settings, seed=trace.seed or 0)
        for _ in range(warm_steps(settings)):
            episode.run()
        while not episode.done:
            obs = episode.observation()
            t0 = time.perf_counter()
            decision = controller.decide(obs)
            seconds.append(time.perf_counter() - t0)
            episode.run(decision.bounds)
    return {
        "decisions": len(seconds),
        "median": statistics.median(seconds),
        "p99": float(np.percentile(seconds, 99)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", help="the switch artifact's folder (default: the shipped one)")
    ap.add_argument("--families", help="comma-separated held-out families (default: all)")
    ap.add_argument("--no-tune", action="store_true", help="the baselines' default settings")
    args = ap.parse_args()
    torch.set_num_threads(1)
    policy = load_switch(args.artifact)
    settings = EpisodeSettings(stages=policy.config.stages)
    traces = heldout_traces(families=args.families.split(",") if args.families else None)
    tuned = {} if args.no_tune else tune_baselines(training_traces(stages=4), settings)
    factories = baseline_factories(tuned)
    factories["ppo"] = lambda: LearnedSwitch(policy)
    t0 = time.perf_counter()
    report = evaluate(factories, traces, settings)
    overall = _overall(report)
    out = {
        "settings": report.settings,
        "tuned": {t.name: t.params for t in tuned.values()},
        "traces": len(traces),
        "eval_seconds": time.perf_counter() - t0,
        "table": report.table(),
        "overall": overall,
        "must_show": _must_show(report, overall, "ppo"),
        "latency_s": _latency(LearnedSwitch(policy), traces[::5], settings),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
