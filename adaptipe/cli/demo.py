"""``make demo`` (``python -m adaptipe.demo``): the adaptive job-array demo
(`adaptipe.adaptive_demo`), or with ``--simulate`` the profile, plan and simulation of
every schedule followed by one real training run (`adaptipe.demo`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    from adaptipe import demo
    from adaptipe.adaptive_demo import DEMO_CONTROLLER, adaptive_demo

    parser = argparse.ArgumentParser(
        prog="python -m adaptipe.demo", description=sys.modules[adaptive_demo.__module__].__doc__
    )
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument(
        "--controller",
        default=DEMO_CONTROLLER,
        help="[adapt].controller of the adaptive run (default %(default)s)",
    )
    parser.add_argument("--factor", type=float, default=3.0, help="stage 1's slowdown")
    parser.add_argument(
        "--iterations", type=int, default=None, help="iterations of each run (90; --simulate 100)"
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="instead: profile the GPT, plan, simulate every schedule, train once",
    )
    parser.add_argument("--microbatch", type=int, default=8, help="--simulate only")
    parser.add_argument("--microbatches", type=int, default=8, help="--simulate only")
    parser.add_argument("--repeats", type=int, default=5, help="--simulate only")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)
    if not args.simulate:
        result = adaptive_demo(
            args.out,
            controller=args.controller,
            iterations=args.iterations or 90,
            factor=args.factor,
        )
        if args.json:
            print(json.dumps(result.to_json()))
        return 0
    rows = demo.run_demo(
        args.out, microbatch=args.microbatch, microbatches=args.microbatches, repeats=args.repeats
    )
    trained = demo.train_demo(args.out, iterations=args.iterations or 100)
    if args.json:
        print(json.dumps({"simulated": rows, "trained": trained}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
