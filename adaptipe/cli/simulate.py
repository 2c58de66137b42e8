"""``adaptipe simulate``: run a schedule in the discrete-event simulator."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from adaptipe.cli.options import parse_floats
from adaptipe.errors import PlanError
from adaptipe.schedule.build import SCHEDULE_NAMES
from adaptipe.units import format_bytes, parse_bandwidth

if TYPE_CHECKING:
    from adaptipe.schedule.types import Schedule
    from adaptipe.sim.costs import CostModel

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="run a schedule in the discrete-event simulator")
    p.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--virtual", type=int, default=1, help="virtual stages per worker (interleaved)")
    p.add_argument("--recompute", action="store_true", help="activation recomputation")
    p.add_argument(
        "--vertical-sync", action="store_true", help="pipedream: vertical sync of weight versions"
    )
    p.add_argument(
        "--update-every", type=int, default=None, help="2bw: micro-batches per weight update"
    )
    p.add_argument(
        "--profile", help="Profile JSON (with --partition; default: uniform costs F=1, B=2)"
    )
    p.add_argument("--partition", help="Partition JSON with stages x virtual stages")
    p.add_argument(
        "--bandwidth", default="inf", help="link bandwidth, e.g. 10GB/s (with --profile)"
    )
    p.add_argument(
        "--latency", type=float, default=0.0, help="link latency in seconds (with --profile)"
    )
    p.add_argument("--slowdown", help="per-stage compute slowdown factors, e.g. 1,2.5")
    p.add_argument(
        "--replicas",
        help="also time the stages replicated, e.g. 1,2 (gpipe, 1f1b; one worker each)",
    )
    p.add_argument(
        "--batch-weight-grads",
        action="store_true",
        help="Linear weight gradients once per batch at the step ([pipeline] batch_weight_grads)",
    )
    p.add_argument(
        "--iterations", type=int, default=1, help="also simulate this many iterations back to back"
    )
    p.add_argument("--gantt", help="write a Gantt chart PNG here")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from adaptipe.plan import Partition
    from adaptipe.profile import Profile
    from adaptipe.schedule.build import build_schedule
    from adaptipe.serial import load_json_file, write_json
    from adaptipe.sim import CostModel, plot_gantt, simulate, simulate_iterations

    schedule = build_schedule(
        args.schedule,
        stages=args.stages,
        microbatches=args.microbatches,
        chunks=args.virtual,
        recompute=args.recompute,
        vertical_sync=args.vertical_sync,
        update_every=args.update_every,
    )
    slowdown = None
    if args.slowdown:
        slowdown = parse_floats(args.slowdown, what="--slowdown")
        if len(slowdown) != args.stages or any(f <= 0 for f in slowdown):
            raise PlanError(
                f"--slowdown needs {args.stages} positive factors, one per stage (got {args.slowdown!r})"
            )
    if (args.profile is None) != (args.partition is None):
        raise PlanError(
            "--profile and --partition go together (give both, or neither for uniform costs)"
        )
    if args.profile:
        prof = load_json_file(args.profile, Profile.from_json)
        part = load_json_file(args.partition, Partition.from_json)
        if part.num_stages != schedule.num_virtual_stages:
            raise PlanError(
                f"{args.partition}: has {part.num_stages} stages but the {args.schedule} schedule needs "
                f"{schedule.num_virtual_stages} (stages x virtual = {args.stages} x {args.virtual})"
            )
        costs = CostModel.from_profile(
            prof,
            part,
            bandwidth_Bps=parse_bandwidth(args.bandwidth),
            latency_s=args.latency,
            slowdown=slowdown,
            batch_weight_grads=args.batch_weight_grads,
            microbatches=args.microbatches,
        )
    elif args.batch_weight_grads:
        raise PlanError(
            "--batch-weight-grads needs --profile and --partition (a profile measured with "
            "--wgrad-microbatches)"
        )
    else:
        costs = CostModel.uniform_for(schedule)
        if slowdown is not None:
            costs = costs.with_slowdown(slowdown)
    result = simulate(schedule, costs, record=args.gantt is not None)
    out: dict[str, Any] = result.to_json()
    out.pop("timeline", None)
    out.update(
        schedule=args.schedule,
        stages=args.stages,
        microbatches=args.microbatches,
        virtual=args.virtual,
    )
    if args.replicas:
        out["replicated"] = _replicated(args.replicas, schedule, costs)
    if args.iterations > 1:
        many = simulate_iterations(schedule, costs, args.iterations)
        out["iterations"] = args.iterations
        out["mean_iteration_s"] = float(np.mean(many.iteration_s))
    if args.gantt:
        plot_gantt(
            result, args.gantt, title=f"{args.schedule}, S={args.stages}, M={args.microbatches}"
        )
    if args.out:
        write_json(args.out, out)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{args.schedule}: {args.stages} stage(s), {args.microbatches} micro-batches, virtual {args.virtual}"
    )
    print(f"  makespan      {result.makespan:.6g}")
    print(f"  bubble ratio  {result.bubble_ratio:.4f}")
    print(f"  throughput    {result.throughput:.6g} micro-batches per time unit")
    for s in range(args.stages):
        print(
            f"  stage {s}: busy {result.busy_s[s]:.6g}, peak activations "
            f"{format_bytes(result.peak_activation_bytes[s])}, weights {format_bytes(result.peak_weight_bytes[s])}"
        )
    if args.replicas:
        rep = out["replicated"]
        print(f"  replicated {rep['replicas']}: {rep['workers']} workers, makespan "
              f"{rep['makespan']:.6g}, {rep['speedup']:.3f}x the unreplicated stages")  # fmt: skip
    if args.gantt:
        print(f"wrote {args.gantt}")
    return 0


def _replicated(text: str, schedule: Schedule, costs: CostModel) -> dict[str, Any]:
    """``--replicas``: the stages replicated against the same stages unreplicated."""
    from adaptipe.schedule.replicate import ReplicaLayout, check_replicable
    from adaptipe.sim.replicas import compare_replicas

    try:
        layout = ReplicaLayout(tuple(int(r) for r in text.split(",")))
    except (ValueError, PlanError):
        raise PlanError(
            f"--replicas {text!r} must be integers >= 1, one per stage (e.g. 1,2)"
        ) from None
    check_replicable(schedule, layout, source="--replicas")
    return compare_replicas(schedule, layout.replicas, costs)
