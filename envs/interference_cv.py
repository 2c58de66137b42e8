"""Scenario-grouped cross-validation of the interference model against its rivals.

Every row of one scenario (a synthetic trace, or one measured stage) lands in the same
fold (`sklearn.model_selection.GroupKFold`), so a model is always scored on scenarios it
never saw; DynPipe's public code split rows 70/30 at random instead, which lets a
configuration's rows sit on both sides. Rivals, each fitted on the same training folds:

- ``forest``: `InterferenceModel` (128 trees, `FOREST_PARAMS`);
- ``linear``: ordinary least squares on standardised inputs;
- ``mlp``: a small seeded MLP (64-32, ReLU, Adam, early stopping) on standardised inputs;
- ``stale``: no model, the last slowdown measured before the row (`Dataset.stale`).

The task is the one a re-partitioning planner has: the slowdown of a stage *now*, from
the device readings *now* and the stage's static features. Stale answers with the last
measurement, which is exact while nothing changes, so on slowly varying traces it is hard
to beat on average; the metrics are therefore also given on the rows where the slowdown
changed since the last measurement (``*_changed``), where a decision matters.
MAPE is ``mean(|prediction - slowdown| / slowdown)``.

``held_out="collect"`` asks a narrower question: how well measured rows are predicted.
Only the scenarios of that kind are split into folds; every other row (the synthetic
traces) trains in every fold, and the metrics are over the held-out measured rows alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptipe.controllers.interference import InterferenceModel
from adaptipe.envs.interference_data import Dataset
from adaptipe.errors import PlanError

__all__ = ["MODELS", "grouped_cv"]

Array = npt.NDArray[np.float64]
MODELS = ("forest", "linear", "mlp", "stale")


def _fit_predict(name: str, x: Array, y: Array, test: Array, *, seed: int) -> Array:
    from sklearn.linear_model import LinearRegression
    from sklearn.neural_network import MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if name == "forest":
        return InterferenceModel.fit(x, y, seed=seed).predict(test)
    if name == "linear":
        est: Any = make_pipeline(StandardScaler(), LinearRegression())
    else:
        mlp = MLPRegressor(hidden_layer_sizes=(64, 32), max_iter=200, early_stopping=True,
                           random_state=seed)  # fmt: skip
        est = make_pipeline(StandardScaler(), mlp)
    return np.asarray(est.fit(x, y).predict(test), dtype=np.float64)


def _scores(pred: Array, y: Array) -> dict[str, float]:
    err = np.abs(pred - y)
    return {"mae": float(err.mean()), "mape": float((err / y).mean())} if len(y) else {}


def _kind(group: str) -> str:
    """``trace:FAMILY:SEED`` -> ``trace:FAMILY``; every measured stage -> ``collect``."""
    return ":".join(group.split(":")[:2]) if group.startswith("trace:") else "collect"


def grouped_cv(
    ds: Dataset,
    *,
    seed: int = 0,
    folds: int = 5,
    models: tuple[str, ...] = MODELS,
    held_out: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Out-of-fold MAE and MAPE per model (see the module doc), overall, on changed rows
    and per scenario kind, with each model's fit-and-predict seconds. ``held_out``: the
    scenario kind (``collect``, ``trace:FAMILY``) whose scenarios alone are split into
    folds and scored, every other row training in each fold; None: all of them."""
    from sklearn.model_selection import GroupKFold

    for name in models:
        if name not in MODELS:
            raise PlanError(f"grouped_cv: unknown model {name!r} (allowed: {', '.join(MODELS)})")
    kinds = np.array([_kind(g) for g in ds.groups])
    scored = np.ones(len(ds), dtype=bool) if held_out is None else kinds == held_out
    groups = np.array(ds.groups)
    count = len(set(groups[scored].tolist()))
    if not 2 <= folds <= count:
        what = "" if held_out is None else f" of kind {held_out!r}"
        raise PlanError(
            f"grouped_cv: folds must be in 2..{count}, the scenarios{what} (got {folds})"
        )
    say = progress or (lambda _: None)
    pred = {name: np.empty(len(ds)) for name in models}
    seconds = dict.fromkeys(models, 0.0)
    always = np.flatnonzero(~scored)  # rows that train in every fold
    inner = np.flatnonzero(scored)
    splits = GroupKFold(n_splits=folds).split(ds.x[inner], ds.y[inner], groups[inner])
    for k, (fit_rows, test_rows) in enumerate(splits):
        train, test = np.concatenate([always, inner[fit_rows]]), inner[test_rows]
        for name in models:
            began = time.perf_counter()
            if name == "stale":
                pred[name][test] = ds.stale[test]
            else:
                pred[name][test] = _fit_predict(
                    name, ds.x[train], ds.y[train], ds.x[test], seed=seed
                )
            seconds[name] += time.perf_counter() - began
        say(f"fold {k + 1}/{folds}: " + ", ".join(
            f"{n} MAE {np.abs(pred[n][test] - ds.y[test]).mean():.4f}" for n in models))  # fmt: skip
    ds = Dataset(x=ds.x[scored], y=ds.y[scored], stale=ds.stale[scored],
                 groups=tuple(groups[scored].tolist()))  # fmt: skip
    pred = {name: p[scored] for name, p in pred.items()}
    kinds = kinds[scored]
    changed = ds.y != ds.stale
    out: dict[str, Any] = {
        "folds": folds,
        "rows": len(ds),
        "groups": ds.num_groups,
        "changed_rows": int(changed.sum()),
        "trained_always": len(always),
        "models": {},
        "by_kind": {},
    }
    for name in models:
        scores = _scores(pred[name], ds.y)
        scores |= {
            f"{k}_changed": v for k, v in _scores(pred[name][changed], ds.y[changed]).items()
        }
        out["models"][name] = scores | {"seconds": round(seconds[name], 2)}
    for kind in sorted(set(kinds)):
        rows = kinds == kind
        out["by_kind"][kind] = {"rows": int(rows.sum())} | {
            name: round(_scores(pred[name][rows], ds.y[rows])["mae"], 5) for name in models
        }
    return out
