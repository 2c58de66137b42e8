"""``adaptipe controllers ACTION``: the controllers' proving ground (docs/traces.md).

Each action is a sub-parser built by one small ``_add_*`` function and run by one
``_run_*`` function (``args.action_func``), so an action is added by writing two more.
Building the parser imports no torch; each ``_run_*`` imports what it calls.

- ``generate FAMILY``: a seeded trace (`adaptipe.envs.generators`);
- ``record RUN_DIR``: a real run's trace (`adaptipe.envs.record`);
- ``scenario TRACE``: a trace as an injection scenario (`adaptipe.envs.replay`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from adaptipe.errors import PlanError

if TYPE_CHECKING:
    from adaptipe.envs.trace import Trace

    Actions = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Actions) -> argparse.ArgumentParser:
    """Add ``adaptipe controllers ACTION`` to the ``adaptipe`` command."""
    p = subparsers.add_parser(
        "controllers",
        help="traces for the re-partitioning controllers: generate, record, replay as a scenario",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for add in (_add_generate, _add_record, _add_scenario):
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


def _report(path: Path, trace: Trace) -> None:
    events = sum(len(row.events) for row in trace.rows)
    print(
        f"wrote {path}: {trace.family}, {trace.stages} stages, {trace.iterations} iterations, "
        f"seed {trace.seed}, {events} events, sha256 {trace.digest()[:16]}"
    )
