"""``adaptipe link``: measure the link between two pinned stage processes, on this host
or between two hosts of a namespace test bed (``--bed``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from adaptipe.units import format_bytes

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "link",
        help="measure the link between two pinned stage processes on this host (p2p round trips)",
    )
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--repeats", type=int, default=20, help="round trips per size")
    p.add_argument(
        "--bed", metavar="PREFIX", help="between two hosts of this test bed (adaptipe hosts up)"
    )
    p.add_argument(
        "--hosts", default="0,1", metavar="A,B", help="the two hosts of --bed (default 0,1)"
    )
    p.add_argument("--state-dir", help="where the bed's state file is (adaptipe hosts --state-dir)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.profile.link import probe_link

    hosts = _hosts(args) if args.bed is not None else None
    result = probe_link(backend=args.backend, repeats=args.repeats, hosts=hosts)
    if args.json:
        print(
            json.dumps(
                {
                    "backend": args.backend,
                    "sizes": list(result.sizes),
                    "rtt_s": list(result.rtt_s),
                    "latency_s": result.latency_s,
                    "bandwidth_Bps": result.bandwidth_Bps,
                }
            )
        )
        return 0
    for size, rtt in zip(result.sizes, result.rtt_s, strict=True):
        print(f"  {format_bytes(size):>10}: round trip {rtt * 1e3:.3f} ms (median)")
    where = f" between {hosts[0].address} and {hosts[1].address}" if hosts else ""
    bw = result.bandwidth_Bps
    rate = (
        f"{bw / 1e9:.2f} GB/s" if bw >= 1e9 else f"{bw / 1e6:.2f} MB/s ({bw * 8 / 1e6:.1f} Mbit/s)"
    )
    hint = f"{bw / 1e9:.2f}GB/s" if bw >= 1e9 else f"{bw / 1e6:.2f}MB/s"
    print(
        f"{args.backend} link{where}: latency {result.latency_s * 1e6:.0f} us, bandwidth "
        f"{rate}; simulate with --latency {result.latency_s:.6f} --bandwidth {hint}"
    )
    return 0


def _hosts(args: argparse.Namespace) -> tuple[Any, Any]:
    from adaptipe import netbed
    from adaptipe.errors import PlanError

    try:
        a, b = (int(i) for i in args.hosts.split(","))
    except ValueError:
        raise PlanError(f"--hosts must be two host indices like 0,1 (got {args.hosts!r})") from None
    if a == b:
        raise PlanError(f"--hosts must name two different hosts (got {args.hosts!r})")
    bed = netbed.load(args.bed, state_dir=args.state_dir)
    return bed.host(a), bed.host(b)
