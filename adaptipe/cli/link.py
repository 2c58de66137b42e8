"""``adaptipe link``: measure the link between two pinned stage processes on this host."""

from __future__ import annotations

import argparse
import json

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
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from adaptipe.profile.link import probe_link

    result = probe_link(backend=args.backend, repeats=args.repeats)
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
    print(
        f"{args.backend} link: latency {result.latency_s * 1e6:.0f} us, bandwidth "
        f"{result.bandwidth_Bps / 1e9:.2f} GB/s; simulate with --latency "
        f"{result.latency_s:.6f} --bandwidth {result.bandwidth_Bps / 1e9:.2f}GB/s"
    )
    return 0
