"""``adaptipe profile``: measure per-layer times and bytes of a zoo model -> Profile JSON."""

from __future__ import annotations

import argparse
import json

from adaptipe.cli.options import parse_overrides
from adaptipe.models import MODEL_NAMES
from adaptipe.units import format_bytes

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile", help="measure per-layer times and bytes of a zoo model -> Profile JSON"
    )
    p.add_argument("--model", required=True, choices=MODEL_NAMES)
    p.add_argument("--microbatch", type=int, required=True, help="samples per micro-batch")
    p.add_argument("--out", help="write the Profile JSON here")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument(
        "--optimizer", default="sgd", help="sgd, momentum, adam or adamw (optimizer-state bytes)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="model config override"
    )
    p.add_argument(
        "--wgrad-microbatches",
        type=int,
        default=0,
        metavar="M",
        help="also time batched weight gradients for M micro-batches per batch (for "
        "batch_weight_grads runs and simulate --batch-weight-grads)",
    )
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from adaptipe.models import get_model
    from adaptipe.profile import profile_model
    from adaptipe.serial import write_json

    spec = get_model(args.model, **parse_overrides(args.set))
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=args.json) as bar:
        task = bar.add_task(f"profiling {spec.name}", total=spec.num_layers)

        def step(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, description=f"profiling {spec.name}: {name}")

        prof = profile_model(
            spec,
            microbatch=args.microbatch,
            device=args.device,
            warmup=args.warmup,
            repeats=args.repeats,
            optimizer=args.optimizer,
            threads=args.threads,
            progress=step,
            wgrad_microbatches=args.wgrad_microbatches,
        )
    if args.out:
        write_json(args.out, prof.to_json())
    if args.json:
        print(json.dumps(prof.to_json()))
        return 0
    from rich.table import Table

    table = Table(
        title=f"{prof.model}, micro-batch {prof.microbatch}, {prof.device}, {prof.threads} thread(s)"
    )
    for col in ("layer", "kind", "fwd ms", "bwd ms", "activation", "stash", "params"):
        table.add_column(col, justify="left" if col in ("layer", "kind") else "right")
    for lp in prof.layers:
        table.add_row(
            lp.name,
            lp.kind,
            f"{lp.forward_s * 1e3:.3f}",
            f"{lp.backward_s * 1e3:.3f}",
            format_bytes(lp.activation_bytes),
            format_bytes(lp.saved_bytes),
            format_bytes(lp.param_bytes),
        )
    Console().print(table)
    if args.out:
        print(f"wrote {args.out}")
    return 0
