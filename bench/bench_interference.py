"""The interference model against its rivals, and what one prediction costs.

Runs scenario-grouped cross-validation (`adaptipe.envs.interference_cv`) of the
forest, linear regression, the MLP and stale information on the synthetic traces
(`TraceSpec`, by default the shipped artifact's) plus any collect-interference CSVs, and
times a single-row prediction of the shipped forest: the packed descent
(`InterferenceModel.predict`) against scikit-learn's ``predict`` with ``n_jobs=1`` and
with its default ``n_jobs=None`` after a ``joblib`` parallel backend of all cores.
Prints one JSON object. Target: the forest ahead of linear, MLP and stale; a decision's
whole budget is 10 ms.

    python bench/bench_interference.py [--seeds 8] [--folds 5] [--data x.csv ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from adaptipe.controllers.interference import load_interference
from adaptipe.envs.interference_cv import grouped_cv
from adaptipe.envs.interference_data import TraceSpec, build_dataset


def _latency(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {
        "median_ms": statistics.median(times) * 1e3,
        "p90_ms": float(np.percentile(times, 90)) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=TraceSpec().seeds, help="traces per family")
    ap.add_argument("--iterations", type=int, default=TraceSpec().iterations)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--data", type=Path, nargs="*", default=[], help="collect-interference CSVs")
    args = ap.parse_args()
    spec = TraceSpec(seeds=args.seeds, iterations=args.iterations)
    t0 = time.perf_counter()
    ds = build_dataset(spec=spec, data=args.data)
    out: dict[str, object] = {"traces": spec.to_json(), "data": [str(p) for p in args.data]}
    out["dataset_s"] = round(time.perf_counter() - t0, 2)
    out["cv"] = grouped_cv(ds, seed=args.seed, folds=args.folds)
    model = load_interference()
    row = ds.x[len(ds) // 2]
    forest = model.forest
    out["predict_one_row"] = {
        "packed": _latency(lambda: model.predict(row), args.repeats),
        "sklearn_n_jobs_1": _latency(lambda: forest.predict(row[None]), args.repeats),
    }
    forest.set_params(n_jobs=-1)
    out["predict_one_row"]["sklearn_n_jobs_all"] = _latency(  # type: ignore[index]
        lambda: forest.predict(row[None]), max(10, args.repeats // 10)
    )
    forest.set_params(n_jobs=1)
    batch = ds.x[:1000]
    out["predict_1000_rows_ms"] = {
        "packed": _latency(lambda: model.predict(batch), 10)["median_ms"],
        "sklearn_n_jobs_1": _latency(lambda: forest.predict(batch), 10)["median_ms"],
    }
    out["target"] = "forest MAE below linear, mlp and stale; one decision under 10 ms"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
