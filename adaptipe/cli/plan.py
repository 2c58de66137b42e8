"""``adaptipe plan``: partition a profiled model into stages -> Partition JSON."""

from __future__ import annotations

import argparse
import json

from adaptipe.cli.options import parse_overrides
from adaptipe.errors import PlanError
from adaptipe.plan.api import PLANNERS
from adaptipe.units import parse_bandwidth, parse_bytes

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="partition a profiled model into stages -> Partition JSON"
    )
    p.add_argument("--profile", required=True)
    p.add_argument(
        "--stages", type=int, default=None, help="stage count (dynpipe chooses it when omitted)"
    )
    p.add_argument("--planner", default="dynpipe", choices=PLANNERS)
    p.add_argument(
        "--bandwidth", default="inf", help="link bandwidth, e.g. 10GB/s; comma list = per boundary"
    )
    p.add_argument(
        "--levels", help="pipedream topology, e.g. 4:100GB/s,2:10GB/s (workers:bandwidth per level)"
    )
    p.add_argument("--memory-limit", help="per-device memory, e.g. 16GiB")
    p.add_argument(
        "--max-stages", type=int, default=None, help="dynpipe: largest stage count to consider"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="dynpipe: condense the model to top-k blocks first"
    )
    p.add_argument(
        "--staleness",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="dynpipe Eq. 3 constants: f0, lr, epsilon, smoothness, grad_second_moment",
    )
    p.add_argument("--out", help="write the Partition JSON here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.plan.api import plan, stage_times
    from adaptipe.plan.pipedream import Level
    from adaptipe.plan.staleness import StalenessModel
    from adaptipe.profile import Profile
    from adaptipe.serial import load_json_file, write_json

    prof = load_json_file(args.profile, Profile.from_json)
    bandwidth: float | list[float]
    bws = [parse_bandwidth(b) for b in args.bandwidth.split(",")]
    bandwidth = bws[0] if len(bws) == 1 else bws
    levels = None
    if args.levels:
        levels = []
        for item in args.levels.split(","):
            workers, sep, bw = item.partition(":")
            if not sep or not workers.isdigit():
                raise PlanError(
                    f"--levels item {item!r} must look like WORKERS:BANDWIDTH (e.g. 4:10GB/s)"
                )
            levels.append(Level(workers=int(workers), bandwidth_Bps=parse_bandwidth(bw)))
    staleness = None
    if args.staleness:
        staleness = StalenessModel(**parse_overrides(args.staleness))
    partition = plan(
        prof,
        planner=args.planner,
        num_stages=args.stages,
        bandwidth_Bps=bandwidth,
        levels=levels,
        memory_limit_bytes=parse_bytes(args.memory_limit, what="--memory-limit")
        if args.memory_limit
        else None,
        staleness=staleness,
        top_k=args.top_k,
        max_stages=args.max_stages,
    )
    if args.out:
        write_json(args.out, partition.to_json())
    if args.json:
        print(json.dumps(partition.to_json()))
        return 0
    times = stage_times(prof, partition, bandwidth_Bps=bandwidth)
    print(f"{partition.planner} partition of {prof.model} into {partition.num_stages} stage(s):")
    for s in range(partition.num_stages):
        layers = partition.layers(s)
        names = f"{prof.layers[layers[0]].name}..{prof.layers[layers[-1]].name}"
        rep = f" x{partition.replicas[s]}" if partition.replicas[s] > 1 else ""
        print(
            f"  stage {s}: layers {layers.start}-{layers.stop - 1} ({names}){rep}  {times[s] * 1e3:.3f} ms"
        )
    if partition.predicted_s is not None:
        print(f"predicted time per micro-batch: {partition.predicted_s * 1e3:.3f} ms")
    if args.out:
        print(f"wrote {args.out}")
    return 0
