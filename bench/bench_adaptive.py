"""Adaptation: how close a controller keeps a pipeline to the best static partition
when one stage slows down part-way through a run (issue 19, "Must show: Adaptation").

Model: the zoo CNN (``width`` 2: six layers whose boundary tensors shrink from 8 KiB
to 0.5 KiB a sample as it pools), SGD, batch 64 in 4 micro-batches, 1F1B over 2 stage
processes with one thread each. A scenario slows stage 1 from iteration ``--onset`` for
``--duration`` iterations, out of ``--iterations``:

- ``slowdown``: the injector stretches stage 1's compute ``--factor`` times (a clean
  signal);
- ``cpu_hog``: spinning processes share stage 1's core (a real one);
- ``link``: stage 1's link to stage 0, between two namespace hosts (`adaptipe.netbed`,
  needs root; skipped with the reason otherwise), is shaped to ``--rate`` Mbit/s; the
  stages run under torchrun and ``adaptipe manage`` as in ``bench_links.py``.

Part 1, the static matrix: every cut point ``[0, k, 6]`` runs the scenario, and each
phase's throughput (samples/s from ``metrics.jsonl``: samples over the summed spans,
the first ``--settle`` iterations of a phase left out) is taken as a ratio to the
initial plan's in the same round; rounds run the cuts in alternating order (this
machine's speed drifts) and the figures are medians over rounds. The initial plan is
the best cut before the onset (or ``--initial``). A scenario is valid only when the
best cut during the injection differs from the one before it and beats the initial
plan by at least 20%; otherwise it cannot tell a controller from doing nothing, and the
bench prints ``"valid": false`` with why, and exits 1.

Part 2, the controllers (run only on a valid scenario): the threshold controller
(``[adapt] controller = "threshold"``) with live migration and with restart-based
re-partitioning, each in rounds beside the static initial plan and the best static
cuts of the phases. Per run and phase: throughput over the whole phase against the
best static cut's for that phase in the same round, and the iterations from the onset
(and from the end) until the rolling mean of 5 iteration spans stays within
10% of that cut's mean span. Target: within 10% of the best static partition within
10 iterations of the onset. Where the installed runtime has no ``[adapt].controller``
yet, part 2 says so instead of running those. Beside them runs an oracle that knows
the scenario: scripted live moves (``[[adapt.repartition]]``) to each phase's best
static cut two iterations after the phase begins, the most a controller can get here.

Prints one JSON object.

    python bench/bench_adaptive.py [--scenarios slowdown,cpu_hog,link] [--rounds 2]
        [--iterations 80] [--onset 20] [--duration 40] [--factor 3] [--hog-threads 2]
        [--rate 20] [--link-rounds 1] [--initial K] [--controllers live,restart]
        [--min-idle 0.8] [--max-wait-s 120]

Each round waits (at most ``--max-wait-s``) until the machine is ``--min-idle`` idle
(other work shares its cores) and the output says how idle each round began, with the
load averages before and after. On this 2-core machine a local run takes about 8 s and
a run on the bed about 30 s (torchrun's start): the default takes about 6 minutes.
"""

from __future__ import annotations

import argparse
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


def phase_ranges(*, iterations: int, onset: int, end: int, warmup: int) -> dict[str, range]:
    """The iterations of each phase: before the onset (after ``warmup``), during the
    injection, and after it ends (absent when it lasts to the end of the run)."""
    if not 0 <= warmup < onset < min(end, iterations):
        raise ValueError(
            f"need warmup < onset < end and onset < iterations (got warmup={warmup}, "
            f"onset={onset}, end={end}, iterations={iterations})"
        )
    out = {"before": range(warmup, onset), "during": range(onset, min(end, iterations))}
    if end < iterations:
        out["after"] = range(end, iterations)
    return out


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
    """Issue 19's rule: the best static cut during the injection must differ from the
    best before it, and beat the initial plan by at least ``min_gain`` during it.

    Args:
        rel: per cut and phase, throughput relative to the initial plan (`relative`).
    """
    best = {p: max(rel, key=lambda c: rel[c][p]) for p in rel[initial]}
    gain = rel[best["during"]]["during"] / rel[initial]["during"] - 1
    # How clearly the best cut before the onset won: near 0, noise may pick another.
    before = sorted((rel[c]["before"] for c in rel), reverse=True)
    margin = before[0] / before[1] - 1 if len(before) > 1 else None
    why = []
    if best["during"] == best["before"]:
        why.append(f"cut {best['before']} is the best static partition both before and during")
    if gain < min_gain:
        why.append(
            f"the best static partition during the injection (cut {best['during']}) beats "
            f"the initial plan (cut {initial}) by {gain:.1%}, under {min_gain:.0%}"
        )
    return {
        "valid": not why,
        "why": "; ".join(why) if why else (
            f"cut {best['during']} beats the initial plan (cut {initial}) by {gain:.1%} "
            f"during the injection, and cut {best['before']} is best before it"
        ),
        "best": best,
        "gain_over_initial": gain,
        "best_before_margin": margin,
    }  # fmt: skip


# --- runs ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """What every run of a scenario shares."""

    scenario: str
    iterations: int
    onset: int
    end: int
    injection: dict[str, Any]  # one [[inject]] table, less its timing
    warmup: int = 3
    settle: int = 3
    window: int = 5
    bed: Any = None  # the netbed.Bed of the link scenario
    state_dir: Path | None = None
    scratch: Path = field(default_factory=Path)
    quiet_rule: dict[str, float] = field(default_factory=lambda: {"min_idle": 0.0, "max_wait_s": 0})
    quiet: list[dict[str, Any]] = field(default_factory=list)  # how idle each round began

    @property
    def phases(self) -> dict[str, range]:
        return phase_ranges(
            iterations=self.iterations, onset=self.onset, end=self.end, warmup=self.warmup
        )


def _config(
    run_dir: Path, s: Setting, cut: int, adapt: Mapping[str, Any] | None = None
) -> RunConfig:
    raw: dict[str, Any] = {
        "model": MODEL,
        "data": {"batch_size": BATCH, "microbatches": MICROBATCHES},
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "pipeline": {"stages": 2, "schedule": "1f1b", "partition": [0, cut, NUM_LAYERS]},
        "train": {
            "iterations": s.iterations,
            "seed": 0,
            "threads_per_stage": 1,
            "checkpoint_every": 0,
            "link_telemetry": True,  # the controller reads the links (all runs pay it)
            "run_dir": str(run_dir),
        },
    }
    if adapt is not None:
        raw["adapt"] = dict(adapt)
    return RunConfig.from_dict(raw, source="bench_adaptive")


def _scenario_file(s: Setting, tag: str) -> Path:
    inj = {**s.injection, "at_iteration": s.onset, "iterations": s.end - s.onset}
    lines = []
    if s.bed is not None:
        lines += [f'bed = "{s.bed.prefix}"', f'state_dir = "{s.state_dir}"']
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


def controller_missing() -> str | None:
    """Why this runtime cannot run the threshold controller (None when it can)."""
    probe = Setting(scenario="probe", iterations=8, onset=4, end=6, injection={})
    try:
        _config(
            Path("unused"), probe, 3, {"method": "live", "controller": "threshold", **CONTROLLER}
        )
    except PlanError as exc:  # no [adapt].controller yet, or other names for its settings
        return f"this runtime does not take the threshold controller's [adapt] settings: {exc}"
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


def _adapt(method: str, s: Setting, best: Mapping[str, int]) -> dict[str, Any]:
    """The ``[adapt]`` table of a method: the threshold controller moving live or by a
    restart, or the oracle, a scripted live move to the best static cut of each phase
    `ORACLE_LAG` iterations after it begins (what knowing the scenario buys)."""
    if method != "oracle":
        return {"method": method, "controller": "threshold", **CONTROLLER}
    moves = [(s.onset, best["during"])]
    if "after" in best and best["after"] != best["during"]:
        moves.append((s.end, best["after"]))
    return {
        "method": "live",
        "repartition": [
            {"iteration": at + ORACLE_LAG, "bounds": [0, cut, NUM_LAYERS]} for at, cut in moves
        ],
    }


def controller_runs(
    s: Setting, rounds: int, *, initial: int, best: Mapping[str, int], methods: Sequence[str]
) -> list[dict[str, Any]]:
    """Per round: the static cuts that are best in some phase (the initial plan among
    them), then each controller method, in alternating order; each method's phases
    against the same round's best static cut for that phase."""
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
        spans = {
            name: (_run(s, f"ctl-r{r}-{name}", cut, adapt), adapt) for name, cut, adapt in order
        }
        ref = {p: _spans(spans[f"static-{best[p]}"][0]) for p in s.phases}
        row: dict[str, Any] = {"round": r}
        for name, (run_dir, adapt) in spans.items():
            got = _spans(run_dir)
            entry: dict[str, Any] = {"throughput_vs_best_static": {}, "recovery_iterations": {}}
            for p, rng in s.phases.items():
                steady = ref[p].throughput(rng, settle=s.settle)
                entry["throughput_vs_best_static"][p] = got.throughput(rng) / steady
                if p != "before":
                    target = ref[p].mean_span(rng, settle=s.settle)
                    entry["recovery_iterations"][p] = recovery(
                        got.seconds, rng, target, window=s.window
                    )
            if adapt is not None:
                entry |= _control_events(run_dir)
                n = entry["recovery_iterations"]["during"]
                entry["target_met"] = n is not None and n <= TARGET_ITERATIONS
            row[name] = entry
        print(json.dumps({"scenario": s.scenario, **row}), file=sys.stderr)
        out.append(row)
    return out


# --- the bench -----------------------------------------------------------------------


def _medians(rounds: Sequence[Mapping[int, Mapping[str, float]]]) -> dict[int, dict[str, float]]:
    return {
        c: {p: statistics.median(r[c][p] for r in rounds) for p in rounds[0][c]} for c in rounds[0]
    }


def _summary(rows: Sequence[Mapping[str, Any]], methods: Sequence[str]) -> dict[str, Any]:
    """Each controller method's medians over rounds (a recovery that never came: None)."""
    out: dict[str, Any] = {}
    for m in methods:
        entries = [row[m] for row in rows]
        phases = entries[0]["throughput_vs_best_static"]
        recov = {}
        for p in entries[0]["recovery_iterations"]:
            got = [e["recovery_iterations"][p] for e in entries]
            recov[p] = None if None in got else statistics.median(got)
        out[m] = {
            "throughput_vs_best_static": {
                p: statistics.median(e["throughput_vs_best_static"][p] for e in entries)
                for p in phases
            },
            "recovery_iterations": recov,
            "target_met_rounds": sum(e["target_met"] for e in entries),
        }
    return out


def run_scenario(s: Setting, args: argparse.Namespace, rounds_n: int) -> dict[str, Any]:
    """Part 1 (static matrix and validity), then part 2 on a valid scenario."""
    rounds = static_matrix(s, rounds_n)
    initial = args.initial if args.initial is not None else initial_cut(rounds)
    rel = relative(rounds, reference=initial)
    verdict = validity(rel, initial=initial)
    out: dict[str, Any] = {
        "injection": s.injection,
        "quiet": s.quiet,
        "initial_cut": initial,
        "static_samples_per_s": _medians(rounds),
        "static_vs_initial": rel,
        **verdict,
    }
    if not verdict["valid"]:
        out["controllers"] = {"skipped": "the scenario is not valid (see why)"}
        return out
    methods = [m for m in args.controllers.split(",") if m]
    skipped: dict[str, str] = {}
    if s.bed is not None and "restart" in methods:  # adaptipe manage refuses it
        skipped["restart"] = "torchrun's workers: `adaptipe manage` cannot restart them"
    missing = controller_missing()
    for m in ("live", "restart"):
        if missing is not None and m in methods:
            skipped.setdefault(m, missing)
    methods = [m for m in methods if m not in skipped]
    if not methods:
        out["controllers"] = {"skipped": skipped or "no method asked for"}
        return out
    rows = controller_runs(s, rounds_n, initial=initial, best=verdict["best"], methods=methods)
    out["controllers"] = {"summary": _summary(rows, methods), "rounds": rows}
    if skipped:
        out["controllers"]["skipped"] = skipped
    return out


def _injections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {
        "slowdown": {"kind": "slowdown", "stage": 1, "factor": args.factor},
        "cpu_hog": {"kind": "cpu_hog", "cores": [1], "threads": args.hog_threads},
        "link": {"kind": "link_shape", "host": 1, "rate": f"{args.rate:g}mbit"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="slowdown,cpu_hog,link")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--onset", type=int, default=20)
    parser.add_argument("--duration", type=int, default=40, help="iterations the injection lasts")
    parser.add_argument("--factor", type=float, default=3.0, help="slowdown of stage 1")
    parser.add_argument("--hog-threads", type=int, default=2, help="cpu_hog spinners on core 1")
    parser.add_argument("--rate", type=float, default=20.0, help="link scenario, Mbit/s")
    parser.add_argument(
        "--link-rounds", type=int, default=1, help="rounds of the link scenario (~30 s a run)"
    )
    parser.add_argument("--initial", type=int, choices=CUTS, help="initial plan's cut")
    parser.add_argument(
        "--controllers", default="live,restart,oracle", help="threshold live/restart; oracle"
    )
    parser.add_argument(
        "--min-idle", type=float, default=0.8, help="wait before a round until this idle"
    )
    parser.add_argument("--max-wait-s", type=float, default=120.0)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = parser.parse_args()
    names = args.scenarios.split(",")
    injections = _injections(args)
    unknown = sorted(set(names) - set(injections))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown} (allowed: {', '.join(injections)})")
    out: dict[str, Any] = {
        "model": MODEL,
        "partition": "[0, cut, 6]: stage 0 holds layers [0, cut)",
        "batch": BATCH,
        "microbatches": MICROBATCHES,
        "schedule": "1f1b, 2 stage processes, 1 thread each (stage s on core s)",
        "iterations": args.iterations,
        "onset": args.onset,
        "end": args.onset + args.duration,
        "rounds": args.rounds,
        "link_rounds": args.link_rounds,
        "link": "2 namespace hosts (adaptipe.netbed): stage 0 and adaptipe manage on host 0 "
        "(core 0), stage 1 on host 1 (core 1), torchrun; links unshaped but for the injection",
        "warmup": 3,
        "settle": 3,
        "rolling_window": 5,
        "controller": {"controller": "threshold", **CONTROLLER},
        "rule": f"valid: the best static cut differs before/during and beats the initial "
        f"plan by >= {MIN_GAIN:.0%} during the injection",
        "target": f"within {TOLERANCE:.0%} of the best static partition within "
        f"{TARGET_ITERATIONS} iterations of the onset",
        "load_1_5_15_before": os.getloadavg(),
        "scenarios": {},
    }
    with tempfile.TemporaryDirectory(prefix="adaptipe-adaptive-") as tmp:
        for name in names:
            scratch = (args.keep if args.keep is not None else Path(tmp)) / name
            scratch.mkdir(parents=True, exist_ok=True)
            s = Setting(
                scenario=name,
                iterations=args.iterations,
                onset=args.onset,
                end=args.onset + args.duration,
                injection=injections[name],
                scratch=scratch,
                quiet_rule={"min_idle": args.min_idle, "max_wait_s": args.max_wait_s},
            )
            if name != "link":
                out["scenarios"][name] = run_scenario(s, args, args.rounds)
            else:
                out["scenarios"][name] = _on_bed(s, args, Path(tmp))
    out["load_1_5_15_after"] = os.getloadavg()
    ran = [v for v in out["scenarios"].values() if "valid" in v]
    out["valid"] = bool(ran) and all(v["valid"] for v in ran)
    print(json.dumps(out, indent=2))
    if not out["valid"]:
        sys.exit(1)


def _on_bed(s: Setting, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The link scenario on a bed of two namespace hosts (skipped, with why, without)."""
    from dataclasses import replace

    from adaptipe import netbed

    reason = netbed.available()
    if reason is not None:
        return {"injection": s.injection, "skipped": f"needs a namespace test bed: {reason}"}
    prefix = "ba" + secrets.token_hex(2)
    state = tmp / "netbed"
    bed = netbed.up(prefix=prefix, hosts=2, state_dir=state)
    try:
        return run_scenario(replace(s, bed=bed, state_dir=state), args, args.link_rounds)
    finally:
        netbed.down(prefix=prefix, state_dir=state)


if __name__ == "__main__":
    main()
