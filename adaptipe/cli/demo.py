"""``make demo`` (``python -m adaptipe.demo``): the options of `adaptipe.demo`'s run."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    from adaptipe import demo

    parser = argparse.ArgumentParser(prog="python -m adaptipe.demo", description=demo.__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--iterations", type=int, default=100, help="iterations of the real training run"
    )
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)
    rows = demo.run_demo(
        args.out, microbatch=args.microbatch, microbatches=args.microbatches, repeats=args.repeats
    )
    trained = demo.train_demo(args.out, iterations=args.iterations)
    if args.json:
        print(json.dumps({"simulated": rows, "trained": trained}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
