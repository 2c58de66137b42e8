"""``adaptipe hosts up|down|shape|show``: a test bed of namespace hosts on this machine.

Each host is a network namespace pinned to its own cores, on a bridge in a namespace of
its own, with a shaped link (``adaptipe.netbed``; needs root, ``ip`` and ``tc``). The
bed is described in a state file, so each action may run in another process.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adaptipe.netbed import Bed, LinkShape

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "hosts", help="a test bed of namespace hosts with shaped links on this machine (root)"
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="build a bed (removing a stale one with the prefix first)")
    up.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    up.add_argument("--cpus-per-host", type=int, default=1, help="cores per host (default 1)")
    shape = actions.add_parser(
        "shape",
        help="change the link shape of hosts of a running bed",
        description="The shape given replaces the host's shape: an option left out is unshaped.",
    )
    shape.add_argument(
        "--host",
        type=int,
        action="append",
        help="the host to shape (repeat for several; default: every host)",
    )
    down = actions.add_parser("down", help="remove a bed and every process still on it")
    show = actions.add_parser("show", help="print a bed's description (JSON)")
    for action in (up, shape, down, show):
        action.add_argument("--prefix", required=True, help="the bed's name: 1-8 of a-z, 0-9")
        action.add_argument(
            "--state-dir",
            help="folder of bed descriptions (default: $ADAPTIPE_NETBED_DIR, else "
            "/run/adaptipe-netbed)",
        )
    for action in (up, shape):
        # Given as typed; parsed in `run` so a bad value reads like any adaptipe error.
        action.add_argument("--rate", help="link rate, e.g. 20mbit, 1gbit, 2.5MB/s (default: none)")
        action.add_argument("--delay", help="one-way delay per direction, e.g. 1ms, 500us")
        action.add_argument("--jitter", help="delay variation, e.g. 0.5ms (needs --delay)")
        action.add_argument("--loss", help="random loss per direction, e.g. 0.1%%")
    p.set_defaults(func=run)
    return p


def _shape(args: argparse.Namespace) -> LinkShape:
    from adaptipe.netbed import parse_shape

    return parse_shape(
        rate=args.rate, delay=args.delay, jitter=args.jitter, loss=args.loss, where="--"
    )


def _print_hosts(bed: Bed, indices: list[int]) -> None:
    for i in indices:
        h = bed.hosts[i]
        cpus = ",".join(str(c) for c in h.cpus)
        print(f"  host {i}  {h.namespace:<14} {h.address:<12} cpus {cpus:<5} {h.shape.describe()}")


def run(args: argparse.Namespace) -> int:
    from adaptipe import netbed

    where = {"state_dir": args.state_dir}
    if args.action == "up":
        bed = netbed.up(
            prefix=args.prefix,
            hosts=args.hosts,
            shape=_shape(args),
            cpus_per_host=args.cpus_per_host,
            **where,
        )
        path = netbed.state_path(bed.prefix, args.state_dir)
        print(f"bed {bed.prefix}: {len(bed.hosts)} hosts on {bed.bridge} in {bed.switch} ({path})")
        _print_hosts(bed, list(range(len(bed.hosts))))
        first = " ".join(bed.hosts[0].command(["COMMAND"]))
        print(f"run a command on host 0: {first}")
    elif args.action == "shape":
        bed = netbed.load(args.prefix, **where)
        indices = args.host if args.host is not None else list(range(len(bed.hosts)))
        link = _shape(args)
        for i in indices:
            bed.host(i)  # every index checked before any link changes
        for i in indices:
            bed = netbed.shape(bed, i, link, **where)
        print(f"bed {bed.prefix}: reshaped")
        _print_hosts(bed, indices)
    elif args.action == "down":
        removed = netbed.down(prefix=args.prefix, **where)
        print(f"removed {', '.join(removed)}" if removed else f"no bed {args.prefix} here")
    else:
        print(json.dumps(netbed.load(args.prefix, **where).to_json(), indent=2))
    return 0
