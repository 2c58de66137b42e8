"""``adaptipe controllers ACTION``: the controllers' proving ground (docs/traces.md).

Each action is a sub-parser built by one small ``_add_*`` function and run by one
``_run_*`` function (``args.action_func``), so an action is added by writing two more.
Building the parser imports no torch; each ``_run_*`` imports what it calls.

- ``generate FAMILY``: a seeded trace (`adaptipe.envs.generators`);
- ``record RUN_DIR``: a real run's trace (`adaptipe.envs.record`);
- ``scenario TRACE``: a trace as an injection scenario (`adaptipe.envs.replay`);
- ``eval``: every baseline and the oracle on the held-out traces (`adaptipe.envs.evaluate`);
- ``train MODEL``: retrain a learned controller (``predictor``, ``switch``,
  ``interference``) and write its artifact.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptipe.errors import PlanError

if TYPE_CHECKING:
    from adaptipe.controllers.base import Controller
    from adaptipe.envs.episode import EpisodeSettings
    from adaptipe.envs.trace import Trace

    Actions = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Actions) -> argparse.ArgumentParser:
    """Add ``adaptipe controllers ACTION`` to the ``adaptipe`` command."""
    p = subparsers.add_parser(
        "controllers",
        help="the re-partitioning controllers' traces and evaluation: generate, record, "
        "scenario, eval",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for add in (_add_generate, _add_record, _add_scenario, _add_eval, _add_train):
        add(actions)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    code: int = args.action_func(args)
    return code


def _add_generate(actions: Actions) -> None:
    p = actions.add_parser("generate", help="write a seeded trace of a family (docs/traces.md)")
    p.add_argument("family", help="bandwidth-steps, colocated, poisson-light, poisson-heavy, ...")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages")
    p.add_argument("--iterations", type=int, required=True, help="rows of the trace")
    p.add_argument("--seed", type=int, required=True, help="the same seed, the same trace")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a family parameter (repeat; a mixture's component: FAMILY.NAME=VALUE)",
    )
    p.add_argument("--out", required=True, help="the trace file to write (JSON lines)")
    p.set_defaults(action_func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from adaptipe.envs.generators import generate

    params = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise PlanError(f"--set {item!r} must look like NAME=VALUE (e.g. iteration_s=0.5)")
        params[name.strip()] = value.strip()
    trace = generate(
        args.family, stages=args.stages, iterations=args.iterations, seed=args.seed, **params
    )
    _report(trace.save(args.out), trace)
    return 0


def _add_record(actions: Actions) -> None:
    p = actions.add_parser("record", help="write the trace of a real run from its telemetry")
    p.add_argument("run_dir", help="the run directory (telemetry.jsonl, config.json)")
    p.add_argument("--out", help="the trace file to write (default: RUN_DIR/trace.jsonl)")
    p.set_defaults(action_func=_run_record)


def _run_record(args: argparse.Namespace) -> int:
    from adaptipe.envs.record import record_trace

    trace = record_trace(args.run_dir)
    out = args.out if args.out is not None else Path(args.run_dir) / "trace.jsonl"
    _report(trace.save(out), trace)
    print(f"  baseline: {trace.meta['baseline']}")
    if trace.meta.get("filled"):
        print(f"  filled from a neighbour: iterations {trace.meta['filled']}")
    return 0


def _add_scenario(actions: Actions) -> None:
    p = actions.add_parser("scenario", help="write a trace as an injection scenario (TOML)")
    p.add_argument("trace", help="a trace file")
    p.add_argument("--out", help="the scenario file to write (default: print it)")
    p.add_argument("--bed", help="shape the links of this namespace-host bed (link_shape)")
    p.add_argument(
        "--resolution",
        type=float,
        default=0.0,
        help="relative step to round slowdowns and bandwidths to first (e.g. 0.1; default exact)",
    )
    p.set_defaults(action_func=_run_scenario)


def _run_scenario(args: argparse.Namespace) -> int:
    from adaptipe.envs.replay import trace_to_scenario
    from adaptipe.envs.trace import load_trace
    from adaptipe.inject.scenario import load_scenario
    from adaptipe.serial import atomic_write_text

    trace = load_trace(args.trace)
    text = trace_to_scenario(trace, bed=args.bed, resolution=args.resolution)
    if args.out is None:
        print(text, end="")
        return 0
    atomic_write_text(args.out, text)
    scenario = load_scenario(args.out, num_stages=trace.stages)  # it loads back
    print(f"wrote {args.out}: {len(scenario.injections)} injections from {args.trace}")
    return 0


def _add_eval(actions: Actions) -> None:
    p = actions.add_parser(
        "eval", help="every baseline and the oracle on the held-out traces (docs/envs.md)"
    )
    p.add_argument("--traces", help="evaluate on the *.jsonl traces in this folder instead")
    p.add_argument("--out", default="runs/controllers-eval", help="where eval.json and eval.png go")
    p.add_argument("--model", default="gpt", help="gpt, cnn or a profile .json (default gpt)")
    p.add_argument("--families", help="comma-separated: only these held-out families")
    p.add_argument(
        "--stages", type=int, default=4, help="the held-out set's stages (2 or 4; default 4)"
    )
    p.add_argument("--no-tune", action="store_true", help="the baselines' default settings")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(action_func=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    import json
    import sys

    from adaptipe.envs.episode import EpisodeSettings
    from adaptipe.envs.evaluate import evaluate, plot_report
    from adaptipe.envs.heldout import heldout_traces, manifest_for
    from adaptipe.envs.trace import load_trace
    from adaptipe.envs.tuning import baseline_factories, training_traces, tune_baselines
    from adaptipe.serial import write_json

    if args.traces is not None:
        files = sorted(Path(args.traces).glob("*.jsonl"))
        if not files:
            raise PlanError(f"{args.traces}: no *.jsonl trace files")
        traces = [load_trace(f) for f in files]
    else:
        wanted = args.families.split(",") if args.families else None
        traces = heldout_traces(manifest_for(args.stages), families=wanted)
    stages = {t.stages for t in traces}
    if len(stages) != 1:
        raise PlanError(f"eval: the traces have different stage counts {sorted(stages)}")
    settings = EpisodeSettings(model=args.model, stages=stages.pop())
    tuned = {}
    if not args.no_tune:
        print("tuning the baselines on training traces ...", file=sys.stderr)
        tuned = tune_baselines(training_traces(stages=settings.stages), settings)
        for t in tuned.values():
            print(f"  {t.name}: {t.params}", file=sys.stderr)

    def progress(done: int, total: int) -> None:
        print(f"\r  {done}/{total} runs", end="", file=sys.stderr, flush=True)

    factories = baseline_factories(tuned) | _learned(settings)
    report = evaluate(factories, traces, settings, progress=progress)
    print(file=sys.stderr)
    data = report.to_json() | {"tuned": {t.name: t.params for t in tuned.values()}}
    data["predictor"] = _predictor_report(settings, held_out=args.traces is None)
    data["interference"] = _forest_report()
    out = Path(args.out)
    write_json(out / "eval.json", data)
    plot = plot_report(report, out / "eval.png")
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    print(f"{'controller':<18}{'family':<17}{'traces':>6}{'mean':>7}{'std':>7}{'min':>7}"
          f"{'max':>7}{'moves':>7}")  # fmt: skip
    for row in sorted(report.table(), key=lambda r: (r["family"], -r["mean"])):
        print(
            f"{row['controller']:<18}{row['family']:<17}{row['traces']:>6}{row['mean']:>7.3f}"
            f"{row['std']:>7.3f}{row['min']:>7.3f}{row['max']:>7.3f}{row['switches']:>7.1f}"
        )
    _print_models(data)
    print(f"wrote {out / 'eval.json'} and {plot}")
    return 0


def _learned(settings: EpisodeSettings) -> dict[str, Callable[[], Controller]]:
    """The shipped learned controllers that fit ``settings`` (a note for each that does not)."""
    import sys

    from adaptipe.controllers.switch_policy import LearnedSwitch, load_switch

    try:
        policy = load_switch(stages=settings.stages)
    except PlanError as exc:
        print(f"  ppo left out: {exc}", file=sys.stderr)
        return {}
    return {"ppo": lambda: LearnedSwitch(policy)}


def _predictor_report(settings: EpisodeSettings, *, held_out: bool) -> dict[str, Any]:
    """The shipped predictor's MAPE per held-out family against the analytical model."""
    from adaptipe.controllers.predictor import load_predictor
    from adaptipe.envs.predictor_train import heldout_report

    if not held_out:
        return {"skipped": "the predictor is reported on the held-out traces only"}
    try:
        return heldout_report(load_predictor(), settings=settings)
    except PlanError as exc:
        return {"skipped": str(exc)}


def _forest_report() -> dict[str, Any]:
    """The shipped forest's scenario-grouped cross-validation against linear, MLP, stale."""
    from adaptipe.controllers.artifacts import load_artifact, shipped
    from adaptipe.controllers.interference import FORMAT

    try:
        art = load_artifact(shipped("interference"), model="interference", format=FORMAT)
    except PlanError as exc:
        return {"skipped": str(exc)}
    models = art.metrics.get("models", {})
    return {
        "grouped_cv": {
            name: {k: m[k] for k in ("mae", "mape") if k in m} for name, m in models.items()
        }
    }


def _print_models(data: dict[str, Any]) -> None:
    families = data["predictor"].get("families")
    if families:
        print(
            f"\npredictor MAPE, next 10 iterations (noise floor {data['predictor']['noise_floor']:.2%}):"
        )
        for family, row in families.items():
            print(
                f"  {family:<17} predictor {row['predictor']:.2%}  analytical {row['analytical']:.2%}"
            )
    cv = data["interference"].get("grouped_cv")
    if cv:
        print("\ninterference model, scenario-grouped CV (from its training):")
        for name, row in cv.items():
            print(
                f"  {name:<8} MAE {row.get('mae', float('nan')):.4f}  MAPE {row.get('mape', float('nan')):.2%}"
            )


def _add_train(actions: Actions) -> None:
    p = actions.add_parser(
        "train", help="retrain a learned controller and write its artifact (docs/envs.md)"
    )
    p.add_argument("model", choices=("predictor", "switch", "interference"))
    p.add_argument("--seed", type=int, default=0, help="the same seed, the same artifact")
    p.add_argument("--out", help="the artifact folder (default: the shipped one)")
    p.add_argument(
        "--timesteps", type=int, help="switch: PPO timesteps (default: the shipped run's)"
    )
    p.add_argument(
        "--stages",
        type=int,
        default=4,
        help="switch: the pipeline's stages (default 4; 2 and 4 are shipped)",
    )
    p.add_argument(
        "--models",
        default="gpt",
        help="switch: comma-separated zoo models the episodes train (default gpt)",
    )
    p.add_argument(
        "--data",
        action="append",
        default=[],
        help="interference: a collect-interference CSV to train on besides synthetic data (repeat)",
    )
    p.set_defaults(action_func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    import time

    out = Path(args.out) if args.out else None
    t0 = time.monotonic()
    if args.model == "predictor":
        from adaptipe.envs.predictor_train import train_predictor

        path = train_predictor(seed=args.seed, out=out, progress=print)
    elif args.model == "switch":
        from adaptipe.envs.switch_training import train_switch

        extra = {"timesteps": args.timesteps} if args.timesteps else {}
        models = tuple(m for m in args.models.split(",") if m)
        path = train_switch(
            seed=args.seed, out=out, progress=True, stages=args.stages, models=models, **extra
        )
    else:
        from adaptipe.envs.interference_train import train_interference

        path = train_interference(
            seed=args.seed, out=out, data=[Path(d) for d in args.data], progress=print
        )
    print(f"wrote {path} in {time.monotonic() - t0:.0f} s")
    return 0


def _report(path: Path, trace: Trace) -> None:
    events = sum(len(row.events) for row in trace.rows)
    print(
        f"wrote {path}: {trace.family}, {trace.stages} stages, {trace.iterations} iterations, "
        f"seed {trace.seed}, {events} events, sha256 {trace.digest()[:16]}"
    )
