"""Adaptation: how close a controller keeps a pipeline to the best static partition
when the conditions of one stage or link change part-way through a run (issue 19,
"Must show: Adaptation"; issue 22, "Adaptation on the real runtime").

Model: the zoo CNN (``width`` 2: six layers whose boundary tensors shrink from 8 KiB
to 0.5 KiB a sample as it pools), SGD, batch 64 in 4 micro-batches, 1F1B over 2 stage
processes with one thread each; with ``--jobs 4`` a job-array of 4 sibling learning
rates (`LRS`), 16 samples a job, one block each (the same 64 samples an iteration),
``[sweep].window`` ``--sweep-window``. ``--jobs 1,4`` runs every scenario both ways.
A scenario changes conditions from iteration ``--onset`` for ``--duration``
iterations, out of ``--iterations``:

- ``slowdown``: the injector stretches stage 1's compute ``--factor`` times (a clean
  signal);
- ``cpu_hog``: spinning processes share stage 1's core (a real one);
- ``link``: stage 1's link to stage 0, between two namespace hosts (`adaptipe.netbed`,
  needs root; skipped with the reason otherwise), is shaped to ``--rate`` Mbit/s; the
  stages run under torchrun and ``adaptipe manage`` as in ``bench_links.py``;
- ``bandwidth_steps``: AutoPipe's bandwidth steps on the same bed: the link steps
  through ``--levels`` Mbit/s, evenly over the duration (one phase per step).

Links are measured (``[train].link_telemetry``, which the controllers price moves and
cuts with) on the bed only, unless ``--link-telemetry``: a run's default is off. Until
session 20 the passive measurement read a loopback link on this 2-core machine at
20-75 MB/s, which made the planner move to cut 2 before any slowdown; links now report
their fast end when lightly used (docs/telemetry.md), and ``--link-telemetry`` gives
the same results as without on the slowdown scenario.

Part 1, the static matrix: every cut point ``[0, k, 6]`` runs the scenario, and each
phase's throughput (samples/s from ``metrics.jsonl``: samples over the summed spans,
the first ``--settle`` iterations of a phase left out) is taken as a ratio to the
initial plan's in the same round; rounds run the cuts in alternating order (this
machine's speed drifts) and the figures are medians over rounds. The initial plan is
the best cut before the onset (or ``--initial``). A scenario is valid only when the
best cut under the injection (in at least one step) differs from the one before it and
beats the initial plan by at least 20% there; otherwise it cannot tell a controller
from doing nothing, and the bench prints ``"valid": false`` with why, and exits 1.

Part 2, the controllers (run only on a valid scenario, or with ``--run-invalid`` as a
labelled smoke test), in ``--controller-rounds`` paired rounds, each beside the static
initial plan (also reported as ``never``: a controller that never moves trains it) and
the best static cuts of the phases: ``ppo`` (the shipped 2-stage switch policy, live
migration), ``threshold`` (live), ``restart`` (threshold, restart-based; not on the
bed) and an oracle that knows the scenario: scripted live moves
(``[[adapt.repartition]]``) to each phase's best static cut two iterations after the
phase begins, the most a controller can get here. Per run and phase: throughput over
the whole phase against the best static cut's for that phase in the same round, and the
iterations from the phase's start until the rolling mean of 5 iteration spans stays
within 10% of that cut's mean span. Target: within 10% of the best static partition
within 10 iterations of the onset (of each step); the summary gives each controller's
medians and its share of (round, phase) pairs that met it. PPO against threshold: per
round, PPO's throughput under the injection (mean over its phases, against the best
static cut) minus threshold's, its median, and the round-to-round spread (the larger of
the two controllers' standard deviations over rounds); PPO is "not worse" when the
median is above minus the spread.

Prints one JSON object.

    python bench/bench_adaptive.py [--scenarios slowdown,cpu_hog,link,bandwidth_steps]
        [--jobs 1,4] [--rounds 2] [--controller-rounds 5] [--iterations 80] [--onset 20]
        [--duration 40] [--factor 3] [--hog-threads 2] [--rate 20] [--levels 20,200,10]
        [--link-rounds 1] [--initial K] [--controllers ppo,threshold,restart,oracle]
        [--link-telemetry]
        [--min-idle 0.8] [--max-wait-s 120] [--run-invalid] [--keep DIR]

Each round waits (at most ``--max-wait-s``) until the machine is ``--min-idle`` idle
(other work shares its cores) and the output says how idle each round began, with the
load averages before and after. On this 2-core machine a local run takes about 8 s and
a run on the bed about 30 s (torchrun's start): a scenario takes 5 static runs a round
and 4-6 controller runs a round; the default (4 scenarios, 2 job counts, 5 paired
rounds) takes about 2 hours on a quiet machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptipe.controllers.live import decider as live_decider
from adaptipe.errors import PlanError
from adaptipe.runtime import train
from adaptipe.runtime.bedrun import run_on_bed
from adaptipe.runtime.config import RunConfig

_PORT = 29521  # the bed runs' torchrun rendezvous

MODEL = {"name": "cnn", "config": {"width": 2}}
NUM_LAYERS = 6
BATCH, MICROBATCHES = 64, 4
LRS = (0.005, 0.01, 0.02, 0.04)  # --jobs N: the job-array's sibling learning rates
CUTS = tuple(range(1, NUM_LAYERS))  # stage 0 holds layers [0, k), stage 1 [k, 6)
MIN_GAIN = 0.20  # the best static cut under the injection beats the initial plan by this
TOLERANCE = 0.10  # "recovered": within 10% of the best static partition's iteration time
TARGET_ITERATIONS = 10  # ... within 10 iterations of the onset
# The threshold controller's settings (issue 19's [adapt] fields): checks every 2
# iterations over a 4-iteration window, two checks in a row, so it can act within the
# 10-iteration target; a cooldown shorter than the injection so it can move back after.
ORACLE_LAG = 2  # an injection acts from about its second iteration (the manager's lag)
CONTROLLER = {
    "check_every": 1,
    "window": 4,
    "margin": 0.20,  # the planner's error between neighbouring cuts here: up to 16%
    "patience": 2,
    "cooldown": 10,
    "max_per_hour": 60,
    "horizon": 100,
}


# --- pure helpers (tests/test_bench_adaptive.py) -------------------------------------


def phase_ranges(
    *, iterations: int, onset: int, end: int, warmup: int, steps: Sequence[int] = ()
) -> dict[str, range]:
    """The iterations of each phase: before the onset (after ``warmup``), under the
    injection (``during``; with ``steps``, the iterations where the injected conditions
    step, one phase per level: ``step1`` from the onset, ``step2`` from ``steps[0]``,
    ...), and after it ends (absent when it lasts to the end of the run)."""
    if not 0 <= warmup < onset < min(end, iterations):
        raise ValueError(
            f"need warmup < onset < end and onset < iterations (got warmup={warmup}, "
            f"onset={onset}, end={end}, iterations={iterations})"
        )
    last = min(end, iterations)
    if list(steps) != sorted(set(steps)) or any(not onset < k < last for k in steps):
        raise ValueError(f"steps must rise strictly between the onset and the end (got {steps})")
    out = {"before": range(warmup, onset)}
    starts = [onset, *steps, last]
    if steps:
        for n, (a, b) in enumerate(itertools.pairwise(starts), start=1):
            out[f"step{n}"] = range(a, b)
    else:
        out["during"] = range(onset, last)
    if end < iterations:
        out["after"] = range(end, iterations)
    return out


def injected(phases: Mapping[str, Any]) -> list[str]:
    """The phases under the injection (``during`` or the steps), in order."""
    return [p for p in phases if p not in ("before", "after")]


@dataclass(frozen=True, slots=True)
class Spans:
    """One run's merged metrics: each iteration's span (s) and samples."""

    seconds: Mapping[int, float]
    samples: Mapping[int, int]

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, Any]]) -> Spans:
        return cls(
            seconds={int(r["iteration"]): float(r["iteration_s"]) for r in records},
            samples={int(r["iteration"]): int(r["samples"]) for r in records},
        )

    def throughput(self, span: range, *, settle: int = 0) -> float:
        """Samples/s over ``span`` less its first ``settle`` iterations."""
        its = [i for i in span[settle:] if i in self.seconds]
        if not its:
            raise ValueError(f"no iterations recorded in {span} (after {settle} settling)")
        return sum(self.samples[i] for i in its) / sum(self.seconds[i] for i in its)

    def mean_span(self, span: range, *, settle: int = 0) -> float:
        its = [i for i in span[settle:] if i in self.seconds]
        return sum(self.seconds[i] for i in its) / len(its)


def recovery(
    seconds: Mapping[int, float],
    phase: range,
    target_s: float,
    *,
    tolerance: float = TOLERANCE,
    window: int = 5,
) -> int | None:
    """Iterations from the phase's start to the first iteration after which the rolling
    mean of ``window`` spans (within the phase) stays at most ``(1 + tolerance) *
    target_s`` to the phase's end; None when it never does, or only in the phase's last
    ``window - 1`` iterations (too few to show that it stays)."""
    limit = target_s * (1 + tolerance)
    its = [i for i in phase if i in seconds]
    since: int | None = None  # index into its
    for n in range(len(its)):
        recent = its[max(0, n - window + 1) : n + 1]
        if sum(seconds[i] for i in recent) / len(recent) <= limit:
            since = n if since is None else since
        else:
            since = None
    if since is None or len(its) - since < window:
        return None
    return its[since] - phase.start


def relative(
    rounds: Sequence[Mapping[int, Mapping[str, float]]], *, reference: int
) -> dict[int, dict[str, float]]:
    """Per cut and phase, the median over rounds of its throughput over ``reference``'s
    in the same round."""
    cuts, phases = rounds[0].keys(), rounds[0][reference].keys()
    return {
        c: {p: statistics.median(r[c][p] / r[reference][p] for r in rounds) for p in phases}
        for c in cuts
    }


def initial_cut(rounds: Sequence[Mapping[int, Mapping[str, float]]]) -> int:
    """The best cut before the onset (what a planner on the quiet machine would use):
    ranked by throughput relative to the first cut in the same round, median of rounds."""
    first = next(iter(rounds[0]))
    rel = relative(rounds, reference=first)
    return max(rel, key=lambda c: rel[c]["before"])


def validity(
    rel: Mapping[int, Mapping[str, float]], *, initial: int, min_gain: float = MIN_GAIN
) -> dict[str, Any]:
    """Issue 19's rule: the best static cut under the injection must differ from the
    best before it, and beat the initial plan by at least ``min_gain`` there. With
    steps, a phase per level: valid when at least one step meets both (the others are
    reported, ``phases``).

    Args:
        rel: per cut and phase, throughput relative to the initial plan (`relative`).
    """
    best = {p: max(rel, key=lambda c: rel[c][p]) for p in rel[initial]}
    gains = {p: rel[best[p]][p] / rel[initial][p] - 1 for p in injected(best)}
    # How clearly the best cut before the onset won: near 0, noise may pick another.
    before = sorted((rel[c]["before"] for c in rel), reverse=True)
    margin = before[0] / before[1] - 1 if len(before) > 1 else None
    whys: dict[str, list[str]] = {}
    for p, gain in gains.items():
        why = whys.setdefault(p, [])
        if best[p] == best["before"]:
            why.append(f"cut {best['before']} is the best static partition both before and {p}")
        if gain < min_gain:
            when = "during the injection" if p == "during" else f"in {p}"
            why.append(
                f"the best static partition {when} (cut {best[p]}) beats the initial plan "
                f"(cut {initial}) by {gain:.1%}, under {min_gain:.0%}"
            )
    good = [p for p, why in whys.items() if not why]
    top = max(gains, key=lambda p: gains[p])
    if good:
        p = max(good, key=lambda q: gains[q])
        when = "during the injection" if p == "during" else f"in {p}"
        text = (
            f"cut {best[p]} beats the initial plan (cut {initial}) by {gains[p]:.1%} {when}, "
            f"and cut {best['before']} is best before it"
        )
    else:
        text = "; ".join(w for why in whys.values() for w in why)
    return {
        "valid": bool(good),
        "why": text,
        "best": best,
        "gain_over_initial": gains[good[0] if len(good) == 1 else top],
        "gains_over_initial": gains,
        "valid_phases": good,
        "best_before_margin": margin,
    }


# --- runs ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """What every run of a scenario shares."""

    scenario: str
    iterations: int
    onset: int
    end: int
    injection: dict[str, Any]  # one [[inject]] table, less its timing
    levels: tuple[Any, ...] = ()  # bandwidth_steps: the rate of each step ("20mbit", ...)
    jobs: int = 1  # > 1: a job-array of sibling learning rates (`LRS`)
    sweep_window: int = 1
    link_telemetry: bool = False  # the controllers read the links (every run pays it)
    warmup: int = 3
    settle: int = 3
    window: int = 5
    bed: Any = None  # the netbed.Bed of the link scenarios
    state_dir: Path | None = None
    scratch: Path = field(default_factory=Path)
    quiet_rule: dict[str, float] = field(default_factory=lambda: {"min_idle": 0.0, "max_wait_s": 0})
    quiet: list[dict[str, Any]] = field(default_factory=list)  # how idle each round began

    @property
    def steps(self) -> tuple[int, ...]:
        """The iterations where a step after the first begins (evenly spaced)."""
        n, span = len(self.levels), self.end - self.onset
        return tuple(self.onset + k * span // n for k in range(1, n)) if n > 1 else ()

    @property
    def phases(self) -> dict[str, range]:
        return phase_ranges(
            iterations=self.iterations,
            onset=self.onset,
            end=self.end,
            warmup=self.warmup,
            steps=self.steps,
        )

    def tables(self) -> list[dict[str, Any]]:
        """The scenario's ``[[inject]]`` tables with their timing: one, or one per step
        (each an excursion that ends where the next begins)."""
        if not self.levels:
            return [
                {**self.injection, "at_iteration": self.onset, "iterations": self.end - self.onset}
            ]
        starts = [self.onset, *self.steps, self.end]
        return [
            {**self.injection, "rate": rate, "at_iteration": a, "iterations": b - a}
            for rate, (a, b) in zip(self.levels, itertools.pairwise(starts), strict=True)
        ]


def _config(
    run_dir: Path, s: Setting, cut: int, adapt: Mapping[str, Any] | None = None
) -> RunConfig:
    raw: dict[str, Any] = {
        "model": MODEL,
        "data": {"batch_size": BATCH, "microbatches": MICROBATCHES},
        "optimizer": {"name": "sgd", "lr": LRS[1], "momentum": 0.9},
        "pipeline": {"stages": 2, "schedule": "1f1b", "partition": [0, cut, NUM_LAYERS]},
        "train": {
            "iterations": s.iterations,
            "seed": 0,
            "threads_per_stage": 1,
            "checkpoint_every": 0,
            "link_telemetry": s.link_telemetry,
            "run_dir": str(run_dir),
        },
    }
    if s.jobs > 1:  # the same samples per iteration: a job's mini-batch is one block
        raw["data"] = {"batch_size": BATCH // s.jobs, "microbatches": 1}
        raw["sweep"] = {"window": s.sweep_window, "grid": {"lr": list(LRS[: s.jobs])}}
    if adapt is not None:
        raw["adapt"] = {k: v for k, v in adapt.items() if k != _TRAIN}
        raw["train"].update(adapt.get(_TRAIN, {}))
    return RunConfig.from_dict(raw, source="bench_adaptive")


def _scenario_file(s: Setting, tag: str) -> Path:
    lines = []
    if s.bed is not None:
        lines += [f'bed = "{s.bed.prefix}"', f'state_dir = "{s.state_dir}"']
    for inj in s.tables():
        lines.append("[[inject]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in inj.items()]
    path = s.scratch / f"{tag}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(s: Setting, tag: str, cut: int, adapt: Mapping[str, Any] | None = None) -> Path:
    """Train the scenario on ``[0, cut, 6]``; the run directory."""
    run_dir = s.scratch / tag
    config = _config(run_dir, s, cut, adapt)
    inject = _scenario_file(s, tag)
    if s.bed is None:
        adaptive = config.adapt.controller != "none"
        train(config, inject=inject, decider=live_decider if adaptive else None)
    else:
        _bed_train(s.bed, config, run_dir, inject)
    return run_dir


def _bed_train(bed: Any, config: RunConfig, run_dir: Path, inject: Path) -> None:
    """The run with one torchrun stage on each of the bed's two hosts, managed (with the
    scenario) from host 0 (`adaptipe.runtime.bedrun`)."""
    from adaptipe.runtime.launch import prepare

    run, _ = prepare(config)
    head, other = bed.hosts
    run_on_bed(run, head, [head, other], port=_PORT, extra=("--inject", str(inject)), timeout_s=300)


def _spans(run_dir: Path) -> Spans:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return Spans.from_records([json.loads(line) for line in lines if line.strip()])


def _phase_throughputs(s: Setting, spans: Spans, *, settle: int) -> dict[str, float]:
    return {p: spans.throughput(r, settle=settle) for p, r in s.phases.items()}


def _idle(seconds: float = 2.0) -> float:
    """The machine's idle share of CPU time over ``seconds`` (``/proc/stat``)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            ticks = [int(x) for x in fh.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, all

    idle0, all0 = sample()
    time.sleep(seconds)
    idle1, all1 = sample()
    return (idle1 - idle0) / max(all1 - all0, 1)


def wait_quiet(*, min_idle: float, max_wait_s: float) -> dict[str, Any]:
    """Wait (at most ``max_wait_s``) until the machine is at least ``min_idle`` idle:
    other engineers' tests share these cores. Says how idle it was and how long it took."""
    t0 = time.monotonic()
    idle = _idle()
    while idle < min_idle and time.monotonic() - t0 < max_wait_s:
        idle = _idle()
    return {"idle": round(idle, 3), "waited_s": round(time.monotonic() - t0, 1)}


def static_matrix(s: Setting, rounds: int) -> list[dict[int, dict[str, float]]]:
    """Per round, every cut's steady throughput per phase (cuts in alternating order)."""
    out = []
    for r in range(rounds):
        s.quiet.append({"part": "static", "round": r, **wait_quiet(**s.quiet_rule)})
        row = {}
        for cut in CUTS if r % 2 == 0 else reversed(CUTS):
            spans = _spans(_run(s, f"static-r{r}-c{cut}", cut))
            row[cut] = _phase_throughputs(s, spans, settle=s.settle)
            print(json.dumps({"scenario": s.scenario, "round": r, "cut": cut, **row[cut]}),
                  file=sys.stderr)  # fmt: skip
        out.append(dict(sorted(row.items())))
    return out


def controller_missing(method: str = "threshold") -> str | None:
    """Why this runtime cannot run ``method``'s controller (None when it can)."""
    probe = Setting(scenario="probe", iterations=8, onset=4, end=6, injection={})
    name = CONTROLLERS.get(method, ("", "threshold"))[1]
    try:
        _config(Path("unused"), probe, 3, {"method": "live", "controller": name, **CONTROLLER})
        if name == "ppo":
            from adaptipe.controllers.switch_policy import load_switch

            load_switch(stages=2)
    except PlanError as exc:  # no [adapt].controller yet, or no policy for 2 stages
        return f"this runtime cannot run the {name} controller here: {exc}"
    return None


def _control_events(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "control.jsonl"
    events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    decisions = [e for e in events if e.get("event") == "decision"]
    moves = [e for e in events if e.get("event") == "migration"]
    # {"event": "decision", "iteration", "bounds" (in force), "decision": Decision.to_json()
    # or null, "acted", ...} (adaptipe.runtime.adapt_loop)
    moving = [e for e in decisions if (e.get("decision") or {}).get("bounds") is not None]
    outcomes = [e for e in events if e.get("event") == "decision_outcome"]
    return {
        "decisions": len(decisions),
        "moves_decided": [
            {
                "iteration": e.get("iteration"),
                "to": e["decision"]["bounds"],
                "acted": e.get("acted"),
                "predicted_gain_s": e["decision"].get("predicted_gain_s"),
                "reason": e["decision"].get("reason"),
            }
            for e in moving
        ],
        "outcomes": [
            {k: e.get(k) for k in ("iteration", "switched_at", "realised_gain_s")} for e in outcomes
        ],
        "migrations": [{k: e.get(k) for k in ("iteration", "bounds", "ok")} for e in moves],
    }


_TRAIN = "[train]"  # a variant's key for what it changes in [train], not [adapt]

CONTROLLERS = {  # bench name: ([adapt].method, [adapt].controller)
    "ppo": ("live", "ppo"),
    "threshold": ("live", "threshold"),
    "restart": ("restart", "threshold"),
    "ppo_norecall": ("live", "ppo"),
    "threshold_norecall": ("live", "threshold"),
    "ppo_measured": ("live", "ppo"),
    "threshold_measured": ("live", "threshold"),
    "ppo_raw": ("live", "ppo"),
    "threshold_raw": ("live", "threshold"),
    "ppo_noprobe": ("live", "ppo"),
    "threshold_noprobe": ("live", "threshold"),
    "ppo_norevisit": ("live", "ppo"),
    "threshold_norevisit": ("live", "threshold"),
    "ppo_everycheck": ("live", "ppo"),
    "threshold_everycheck": ("live", "threshold"),
}
"""The controllers run in part 2, beside the oracle and ``never`` (the static initial
plan, which a controller that never moves trains: its runs are the initial plan's).
``*_norecall``: the same with ``[adapt].recall = false`` (no memory of what the
partitions held measured, `adaptipe.controllers.recall`); ``*_measured``: with
``[adapt].baseline = "measured"`` (slowdowns against the layers as the run measured
them, not the profile); ``*_raw``: with ``[adapt].calibrate = false`` (each stage's
readings as measured, its place's cost in them, `adaptipe.controllers.positions`);
``*_noprobe``: with ``[train].link_probe_every = 0`` (no live probe of a link a remembered
throttle bounds, `adaptipe.runtime.link_probe`: the end of a throttle does not show on a
cut that sends little); ``*_norevisit``: with ``[adapt].revisit_checks = 0`` (a partition
just left ranks at the model's figure where its remembered conditions no longer match);
``*_everycheck``: with ``[adapt].unchanged = 0`` (the controller asked at every check, not
only where the readings moved, `adaptipe.controllers.unchanged`).
"""
VARIANTS = {
    "_norecall": {"recall": False},
    "_measured": {"baseline": "measured"},
    "_raw": {"calibrate": False},
    "_noprobe": {_TRAIN: {"link_probe_every": 0}},
    "_norevisit": {"revisit_checks": 0},
    "_everycheck": {"unchanged": 0},
}


def _adapt(method: str, s: Setting, best: Mapping[str, int]) -> dict[str, Any]:
    """The ``[adapt]`` table of a method: a controller (`CONTROLLERS`) with the bench's
    settings, or the oracle, a scripted live move to the best static cut of each phase
    `ORACLE_LAG` iterations after it begins (what knowing the scenario buys)."""
    if method != "oracle":
        how, name = CONTROLLERS[method]
        extra = next((v for k, v in VARIANTS.items() if method.endswith(k)), {})
        return {"method": how, "controller": name, **CONTROLLER, **extra}
    moves, cut = [], best["before"]
    for p, rng in s.phases.items():
        if p != "before" and best[p] != cut:
            moves.append((rng.start, best[p]))
        cut = best[p]
    return {
        "method": "live",
        "repartition": [
            {"iteration": at + ORACLE_LAG, "bounds": [0, c, NUM_LAYERS]} for at, c in moves
        ],
    }


def _entry(s: Setting, run_dir: Path, ref: Mapping[str, Spans]) -> dict[str, Any]:
    """One run's phases against the same round's best static cut for each phase."""
    got = _spans(run_dir)
    entry: dict[str, Any] = {"throughput_vs_best_static": {}, "recovery_iterations": {}}
    for p, rng in s.phases.items():
        steady = ref[p].throughput(rng, settle=s.settle)
        entry["throughput_vs_best_static"][p] = got.throughput(rng) / steady
        if p != "before":
            target = ref[p].mean_span(rng, settle=s.settle)
            entry["recovery_iterations"][p] = recovery(got.seconds, rng, target, window=s.window)
    phases = injected(s.phases)
    entry["injected_vs_best_static"] = statistics.fmean(
        entry["throughput_vs_best_static"][p] for p in phases
    )
    met = {p: _met(entry["recovery_iterations"][p]) for p in phases}
    entry["target_met_phases"], entry["target_met"] = met, all(met.values())
    return entry


def _met(n: int | None) -> bool:
    return n is not None and n <= TARGET_ITERATIONS


def controller_runs(
    s: Setting, rounds: int, *, initial: int, best: Mapping[str, int], methods: Sequence[str]
) -> list[dict[str, Any]]:
    """Per round: the static cuts that are best in some phase (the initial plan among
    them), then each controller method, in alternating order; each run's phases against
    the same round's best static cut for that phase. A run that fails is recorded with
    its error (and left out of the summary)."""
    statics = sorted({initial, *best.values()})
    out = []
    for r in range(rounds):
        s.quiet.append({"part": "controllers", "round": r, **wait_quiet(**s.quiet_rule)})
        order: list[tuple[str, int, dict[str, Any] | None]] = [
            (f"static-{c}", c, None) for c in statics
        ]
        order += [(m, initial, _adapt(m, s, best)) for m in methods]
        if r % 2:
            order.reverse()
        runs: dict[str, tuple[Path, dict[str, Any] | None]] = {}
        row: dict[str, Any] = {"round": r}
        for name, cut, adapt in order:
            if adapt is None:  # the reference: a failure here ends the bench
                runs[name] = (_run(s, f"ctl-r{r}-{name}", cut), None)
                continue
            try:  # one controller's failed run must not end the bench
                runs[name] = (_run(s, f"ctl-r{r}-{name}", cut, adapt), adapt)
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {exc}"}
        ref = {p: _spans(runs[f"static-{best[p]}"][0]) for p in s.phases}
        for name, (run_dir, adapt) in runs.items():
            row[name] = _entry(s, run_dir, ref)
            if adapt is not None:
                row[name] |= _control_events(run_dir)
        row["never"] = row[f"static-{initial}"]
        print(json.dumps({"scenario": s.scenario, **row}), file=sys.stderr)
        out.append(row)
    return out


# --- the summary (tests/test_bench_adaptive.py) --------------------------------------


def controller_summary(rows: Sequence[Mapping[str, Any]], method: str) -> dict[str, Any]:
    """A controller's medians over the rounds it ran in (a recovery that never came:
    None), and how often it was within 10% of the best static partition within 10
    iterations of each injected phase's start."""
    entries = [row[method] for row in rows if "error" not in row[method]]
    out: dict[str, Any] = {
        "rounds": len(entries),
        "errors": [row[method]["error"] for row in rows if "error" in row[method]],
    }
    if not entries:
        return out
    recov = {}
    for p in entries[0]["recovery_iterations"]:
        got = [e["recovery_iterations"][p] for e in entries]
        recov[p] = None if None in got else statistics.median(got)
    met = [ok for e in entries for ok in e["target_met_phases"].values()]
    return out | {
        "throughput_vs_best_static": {
            p: statistics.median(e["throughput_vs_best_static"][p] for e in entries)
            for p in entries[0]["throughput_vs_best_static"]
        },
        "injected_vs_best_static": statistics.median(e["injected_vs_best_static"] for e in entries),
        "recovery_iterations": recov,
        "target_met_rounds": sum(bool(e["target_met"]) for e in entries),
        "target_met_share": sum(met) / len(met) if met else None,
    }


def paired(
    rows: Sequence[Mapping[str, Any]], a: str = "ppo", b: str = "threshold"
) -> dict[str, Any]:
    """``a`` minus ``b`` per round (throughput under the injection against the best
    static partition: `injected_vs_best_static`), its median, and the round-to-round
    spread: the larger of the two controllers' standard deviations over the rounds
    (how far one controller's own figure moves between rounds). ``a`` is "not worse"
    when the median difference is above minus the spread; None with fewer than 2
    paired rounds."""
    pairs = [
        (row[a]["injected_vs_best_static"], row[b]["injected_vs_best_static"])
        for row in rows
        if a in row and b in row and "error" not in row[a] and "error" not in row[b]
    ]
    diffs = [x - y for x, y in pairs]
    out: dict[str, Any] = {"pair": f"{a} - {b}", "rounds": len(pairs), "per_round": diffs}
    if len(pairs) < 2:
        return out | {"median": diffs[0] if diffs else None, "spread": None, "not_worse": None}
    spread = max(statistics.stdev(x for x, _ in pairs), statistics.stdev(y for _, y in pairs))
    median = statistics.median(diffs)
    return out | {
        "median": median,
        "spread": spread,
        "diff_stdev": statistics.stdev(diffs),
        "not_worse": median >= -spread,
    }


# --- the bench -----------------------------------------------------------------------


def _medians(rounds: Sequence[Mapping[int, Mapping[str, float]]]) -> dict[int, dict[str, float]]:
    return {
        c: {p: statistics.median(r[c][p] for r in rounds) for p in rounds[0][c]} for c in rounds[0]
    }


def run_scenario(s: Setting, args: argparse.Namespace, rounds_n: int) -> dict[str, Any]:
    """Part 1 (static matrix and validity), then part 2 on a valid scenario."""
    rounds = static_matrix(s, rounds_n)
    initial = args.initial if args.initial is not None else initial_cut(rounds)
    rel = relative(rounds, reference=initial)
    verdict = validity(rel, initial=initial)
    out: dict[str, Any] = {
        "injection": s.tables(),
        "jobs": s.jobs,
        "phases": {p: [r.start, r.stop] for p, r in s.phases.items()},
        "quiet": s.quiet,
        "initial_cut": initial,
        "static_samples_per_s": _medians(rounds),
        "static_vs_initial": rel,
        **verdict,
    }
    if not verdict["valid"] and not args.run_invalid:
        out["controllers"] = {"skipped": "the scenario is not valid (see why)"}
        return out
    methods = [m for m in args.controllers.split(",") if m]
    skipped: dict[str, str] = {}
    if s.bed is not None and "restart" in methods:  # adaptipe manage refuses it
        skipped["restart"] = "torchrun's workers: `adaptipe manage` cannot restart them"
    for m in methods:
        why = controller_missing(m) if m in CONTROLLERS else None
        if why is not None:
            skipped.setdefault(m, why)
    methods = [m for m in methods if m not in skipped]
    rows = controller_runs(
        s, args.controller_rounds, initial=initial, best=verdict["best"], methods=methods
    )
    out["controllers"] = {
        "summary": {m: controller_summary(rows, m) for m in [*methods, "never"]},
        "ppo_vs_threshold": paired(rows),
        "rounds": rows,
    }
    if skipped:
        out["controllers"]["skipped"] = skipped
    if not verdict["valid"]:
        out["controllers"]["note"] = (
            "ran on an invalid scenario (--run-invalid): these runs show the bench works, "
            "they cannot tell a controller from doing nothing"
        )
    return out


ON_BED = ("link", "bandwidth_steps")


def _injections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {
        "slowdown": {"kind": "slowdown", "stage": 1, "factor": args.factor},
        "cpu_hog": {"kind": "cpu_hog", "cores": [1], "threads": args.hog_threads},
        "link": {"kind": "link_shape", "host": 1, "rate": f"{args.rate:g}mbit"},
        "bandwidth_steps": {"kind": "link_shape", "host": 1},
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="slowdown,cpu_hog,link,bandwidth_steps")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the static matrix")
    parser.add_argument(
        "--controller-rounds", type=int, default=5, help="paired rounds of the controllers"
    )
    parser.add_argument("--jobs", default="1,4", help="comma-separated: 1 (one job), 4 (job-array)")
    parser.add_argument(
        "--sweep-window", type=int, default=1, help="the job-array's [sweep].window"
    )
    parser.add_argument(
        "--link-telemetry",
        action="store_true",
        help="[train].link_telemetry = true off the bed too (on the bed it always is; "
        "elsewhere a run's default, off, prices every link as unmeasured)",
    )
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--onset", type=int, default=20)
    parser.add_argument("--duration", type=int, default=40, help="iterations the injection lasts")
    parser.add_argument("--factor", type=float, default=3.0, help="slowdown of stage 1")
    parser.add_argument("--hog-threads", type=int, default=2, help="cpu_hog spinners on core 1")
    parser.add_argument("--rate", type=float, default=20.0, help="link scenario, Mbit/s")
    parser.add_argument(
        "--levels",
        default="20,200,10",
        help="bandwidth_steps: the link's Mbit/s at each step (evenly over the duration)",
    )
    parser.add_argument(
        "--link-rounds", type=int, default=1, help="static rounds on the bed (~30 s a run)"
    )
    parser.add_argument("--initial", type=int, choices=CUTS, help="initial plan's cut")
    parser.add_argument(
        "--controllers",
        default="ppo,threshold,restart,oracle",
        help=f"of {', '.join(CONTROLLERS)}, oracle (never: always, the static initial plan)",
    )
    parser.add_argument(
        "--min-idle", type=float, default=0.8, help="wait before a round until this idle"
    )
    parser.add_argument("--max-wait-s", type=float, default=120.0)
    parser.add_argument(
        "--run-invalid",
        action="store_true",
        help="run the controllers on an invalid scenario too (a smoke test; labelled)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The bench's arguments, checked (unknown scenarios, controllers or job counts)."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.scenario_list = [n for n in args.scenarios.split(",") if n]
    unknown = sorted(set(args.scenario_list) - set(_injections(args)))
    if unknown:
        parser.error(f"unknown scenarios {unknown} (allowed: {', '.join(_injections(args))})")
    bad = sorted({m for m in args.controllers.split(",") if m} - {*CONTROLLERS, "oracle"})
    if bad:
        parser.error(f"unknown controllers {bad} (allowed: {', '.join(CONTROLLERS)}, oracle)")
    try:
        args.job_list = [int(j) for j in args.jobs.split(",") if j]
        args.level_list = [float(x) for x in args.levels.split(",") if x]
    except ValueError as exc:
        parser.error(f"--jobs and --levels take comma-separated numbers ({exc})")
    if not args.job_list or any(j < 1 or BATCH % j for j in args.job_list):
        parser.error(f"--jobs: each must divide the batch of {BATCH} (got {args.jobs})")
    if len(args.level_list) < 2 or min(args.level_list) <= 0:
        parser.error(f"--levels: at least 2 positive rates (got {args.levels})")
    if args.controller_rounds < 1 or args.rounds < 1:
        parser.error("--rounds and --controller-rounds must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    out: dict[str, Any] = {
        "model": MODEL,
        "partition": "[0, cut, 6]: stage 0 holds layers [0, cut)",
        "batch": BATCH,
        "microbatches": MICROBATCHES,
        "jobs": args.job_list,
        "job_array": f"N jobs of lr {list(LRS)}[:N], batch {BATCH}/N each, one block a job, "
        f"[sweep].window {args.sweep_window}",
        "schedule": "1f1b, 2 stage processes, 1 thread each (stage s on core s)",
        "iterations": args.iterations,
        "onset": args.onset,
        "end": args.onset + args.duration,
        "rounds": args.rounds,
        "controller_rounds": args.controller_rounds,
        "link_rounds": args.link_rounds,
        "link": "2 namespace hosts (adaptipe.netbed): stage 0 and adaptipe manage on host 0 "
        "(core 0), stage 1 on host 1 (core 1), torchrun; links unshaped but for the injection",
        "warmup": 3,
        "settle": 3,
        "rolling_window": 5,
        "controller": CONTROLLER,
        "link_telemetry": "every scenario" if args.link_telemetry else "the bed's scenarios",
        "rule": f"valid: the best static cut under the injection (in some step) differs from "
        f"the best before it and beats the initial plan by >= {MIN_GAIN:.0%} there",
        "target": f"within {TOLERANCE:.0%} of the best static partition within "
        f"{TARGET_ITERATIONS} iterations of the onset (of each step)",
        "load_1_5_15_before": os.getloadavg(),
        "scenarios": {},
    }
    with tempfile.TemporaryDirectory(prefix="adaptipe-adaptive-") as tmp:
        for name, jobs in itertools.product(args.scenario_list, args.job_list):
            key = name if jobs == 1 else f"{name}/jobs={jobs}"
            scratch = (args.keep if args.keep is not None else Path(tmp)) / key.replace("/", "-")
            scratch.mkdir(parents=True, exist_ok=True)
            s = Setting(
                scenario=key,
                iterations=args.iterations,
                onset=args.onset,
                end=args.onset + args.duration,
                injection=_injections(args)[name],
                levels=tuple(f"{x:g}mbit" for x in args.level_list)
                if name == "bandwidth_steps"
                else (),
                jobs=jobs,
                sweep_window=args.sweep_window,
                link_telemetry=args.link_telemetry or name in ON_BED,
                scratch=scratch,
                quiet_rule={"min_idle": args.min_idle, "max_wait_s": args.max_wait_s},
            )
            if name not in ON_BED:
                out["scenarios"][key] = run_scenario(s, args, args.rounds)
            else:
                out["scenarios"][key] = _on_bed(s, args, Path(tmp))
    out["load_1_5_15_after"] = os.getloadavg()
    ran = [v for v in out["scenarios"].values() if "valid" in v]
    out["valid"] = bool(ran) and all(v["valid"] for v in ran)
    print(json.dumps(out, indent=2))
    if not out["valid"]:
        sys.exit(1)


def _on_bed(s: Setting, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A link scenario on a bed of two namespace hosts (skipped, with why, without)."""
    from dataclasses import replace

    from adaptipe import netbed

    reason = netbed.available()
    if reason is not None:
        return {"injection": s.tables(), "skipped": f"needs a namespace test bed: {reason}"}
    prefix = "ba" + secrets.token_hex(2)
    state = tmp / f"netbed-{prefix}"
    bed = netbed.up(prefix=prefix, hosts=2, state_dir=state)
    try:
        return run_scenario(replace(s, bed=bed, state_dir=state), args, args.link_rounds)
    finally:
        netbed.down(prefix=prefix, state_dir=state)


if __name__ == "__main__":
    main()
