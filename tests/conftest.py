"""Shared fixtures: small run configs for multi-process runtime tests."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from adaptipe.runtime.config import RunConfig

# A model small enough that a 4-stage run on 2 cores takes seconds: 6 Linear layers.
TINY_MLP: dict[str, Any] = {
    "model": {
        "name": "mlp",
        "config": {
            "in_features": 8,
            "hidden": 16,
            "depth": 6,
            "out_features": 4,
            "num_samples": 256,
        },
    },
    "data": {"batch_size": 16, "microbatches": 4, "seed": 3},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "pipeline": {"stages": 2, "schedule": "1f1b"},
    "train": {"iterations": 3, "seed": 7, "threads_per_stage": 1, "timeout_s": 60},
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., RunConfig]:
    """``make_config(pipeline={"stages": 4})`` -> a RunConfig writing into tmp_path."""

    from adaptipe.runtime.config import RunConfig

    def make(**sections: dict[str, Any]) -> RunConfig:
        data = _merge(TINY_MLP, sections)
        data["train"].setdefault("run_dir", str(tmp_path / "run"))
        return RunConfig.from_dict(data, source="test.toml")

    return make


def final_state(
    run_dir: str | Path, job: int | None = None, *, layers: bool = False
) -> dict[str, Any]:
    """The tensors of a run's latest checkpoint: job ``job``'s (its ``jobs.J.`` prefix
    taken off) or all; with ``layers``, only the layers' parameters."""
    import adaptipe.runtime.checkpoint as ckpt

    found = ckpt.latest(Path(run_dir) / "checkpoints")
    assert found is not None, f"no checkpoint in {run_dir}"
    prefix = "" if job is None else f"jobs.{job}."
    keep = prefix + ("layers." if layers else "")
    return {k[len(prefix) :]: v for k, v in ckpt.load(found)[0].items() if k.startswith(keep)}
