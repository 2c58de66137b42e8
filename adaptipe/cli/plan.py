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
    p.add_argument("--planner", default="dynpipe", choices=(*PLANNERS, "2bw"))
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
    p.add_argument("--devices", type=int, help="2bw: devices to spread over (depth x width)")
    p.add_argument("--batch-size", type=int, help="2bw: the largest safe global batch")
    p.add_argument(
        "--max-width", type=int, default=None, help="2bw: cap the data-parallel width (1: none)"
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
    if args.planner == "2bw":
        return _twobw(args, prof)
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
    if max(partition.replicas) > 1:
        print(f"its replicated stages run as {sum(partition.replicas)} processes with "
              f"[pipeline] stages = {partition.num_stages}, "
              f"partition = \"{args.out or 'PLAN.json'}\" and schedule = \"gpipe\" "
              f"or \"1f1b\" ([data] microbatches >= {max(partition.replicas)})")  # fmt: skip
    return 0


def _twobw(args: argparse.Namespace, prof: object) -> int:
    """``--planner 2bw``: depth, width, micro-batch size and recomputation
    (`adaptipe.plan.twobw`), and the run config sections that train it."""
    from adaptipe.plan.twobw import plan_2bw
    from adaptipe.profile import Profile
    from adaptipe.serial import write_json

    assert isinstance(prof, Profile)
    if args.devices is None or args.batch_size is None or args.memory_limit is None:
        raise PlanError("--planner 2bw needs --devices, --batch-size and --memory-limit")
    chosen = plan_2bw(
        prof,
        devices=args.devices,
        memory_limit_bytes=parse_bytes(args.memory_limit, what="--memory-limit"),
        batch_size=args.batch_size,
        bandwidth_Bps=parse_bandwidth(args.bandwidth.split(",")[0]),
        max_width=args.max_width,
    )
    if args.out:
        write_json(args.out, chosen.partition.to_json())
    if args.json:
        print(json.dumps(chosen.to_json()))
        return 0
    print(
        f"2bw plan for {prof.model} on {args.devices} device(s): depth {chosen.depth} x width "
        f"{chosen.width}, micro-batch {chosen.microbatch}, {chosen.accumulation} per step, "
        f"recompute {'on' if chosen.recompute else 'off'}; {chosen.samples_per_s:.1f} samples/s "
        f"predicted ({chosen.considered} configurations considered)"
    )
    for s, (sec, used) in enumerate(zip(chosen.stage_s, chosen.stage_bytes, strict=True)):
        layers = chosen.partition.layers(s)
        print(f"  stage {s}: layers {layers.start}-{layers.stop - 1}  {sec * 1e3:.3f} ms  "
              f"{used / 2**20:.1f} MiB")  # fmt: skip
    if chosen.width == 1:
        print("train it with:")
        print(f"  [data] batch_size = {chosen.microbatch * chosen.accumulation}, "
              f"microbatches = {chosen.accumulation}")  # fmt: skip
        print(f"  [pipeline] stages = {chosen.depth}, schedule = \"2bw\", "
              f"update_every = {chosen.accumulation}, "
              f"recompute = {str(chosen.recompute).lower()}, "
              f"partition = {list(chosen.partition.bounds)}")  # fmt: skip
    else:  # every stage replicated `width` ways: 1F1B-RR, with a flush (not 2BW's rule)
        w, m = chosen.width, chosen.accumulation
        print("train its shape with replicated stages (adaptipe replicates stages under the")
        print("flushing schedules gpipe and 1f1b only, so this steps as PipeDream-Flush does):")
        print(f"  [data] batch_size = {chosen.microbatch * m * w}, microbatches = {m * w}")
        print(f"  [pipeline] stages = {chosen.depth}, schedule = \"1f1b\", "
              f"replicas = {[w] * chosen.depth}, recompute = {str(chosen.recompute).lower()}, "
              f"partition = {list(chosen.partition.bounds)}")  # fmt: skip
    return 0
