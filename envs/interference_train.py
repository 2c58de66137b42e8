"""Training the random-forest interference model (`adaptipe.controllers.interference`):
``adaptipe controllers train interference``.

The model is used by the runtime's controllers; its training data comes from the
environments' trace generators (`adaptipe.envs.interference_data`), so training sits
here, above both.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from adaptipe.controllers.artifacts import save_artifact, shipped
from adaptipe.controllers.interference import (
    FOREST_FILE,
    FOREST_PARAMS,
    FORMAT,
    INPUTS,
    MODEL,
    InterferenceModel,
)

__all__ = ["train_interference"]


def train_interference(
    *,
    seed: int = 0,
    out: Path | None = None,
    data: Sequence[Path] = (),
    measured: bool = True,
    progress: Callable[[str], None] | None = None,
    spec: Any = None,
    folds: int = 5,
) -> Path:
    """Build the dataset (synthetic traces, ``spec``: default `TraceSpec()`; the shipped
    measured rows, `MEASURED`, unless ``measured`` is False; and the collect CSVs in
    ``data``), compare the forest with linear, MLP and stale on scenario-grouped
    ``folds``-fold CV, over every row and over the measured rows held out (metrics
    ``measured_held_out``, when there are measured rows), fit on every row and save the
    artifact in ``out`` (default: the shipped folder). Returns ``out``."""
    import sklearn

    from adaptipe.envs.interference_cv import grouped_cv
    from adaptipe.envs.interference_data import MEASURED, TraceSpec, build_dataset

    say = progress or (lambda _: None)
    began = time.perf_counter()
    spec = TraceSpec() if spec is None else spec
    ds = build_dataset(spec=spec, data=[*(MEASURED if measured else ()), *data])
    say(f"dataset: {len(ds)} rows, {ds.num_groups} scenarios ({time.perf_counter() - began:.1f} s)")
    metrics = grouped_cv(ds, seed=seed, folds=folds, progress=say)
    if any(g.startswith("collect:") for g in ds.groups):
        say("measured rows held out, the synthetic ones training in every fold:")
        metrics["measured_held_out"] = grouped_cv(
            ds, seed=seed, folds=folds, held_out="collect", progress=say
        )
    model = InterferenceModel.fit(ds.x, ds.y, seed=seed)
    say(f"fitted the forest on every row ({time.perf_counter() - began:.1f} s)")
    blob = model.to_bytes()
    training = {
        "seed": seed,
        "rows": len(ds),
        "groups": ds.num_groups,
        "dataset_sha256": ds.digest(),
        "traces": spec.to_json(),
        "data": [str(s) for s in ds.sources],
        "inputs": list(INPUTS),
        "params": dict(FOREST_PARAMS, n_jobs=1, random_state=seed),
        "folds": folds,
        "seconds": round(time.perf_counter() - began, 1),
        "sklearn": sklearn.__version__,
        "python": platform.python_version(),
    }
    root = Path(out) if out is not None else shipped(MODEL)
    return save_artifact(root, model=MODEL, format=FORMAT, files={FOREST_FILE: blob},
                         training=training, metrics=metrics)  # fmt: skip
