"""The partitionable model zoo: each model is an ordered list of layers plus a loss.

>>> from adaptipe.models import get_model
>>> spec = get_model("gpt", n_layer=2)
>>> stage = spec.build(1, 3, seed=0)  # layers [1, 3) of the model, as a stage builds them
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.models.cnn import CNNConfig, cnn_spec
from adaptipe.models.data import Dataset
from adaptipe.models.gpt import GPTConfig, gpt_spec
from adaptipe.models.mlp import MLPConfig, mlp_spec
from adaptipe.models.spec import ModelSpec, make_config

__all__ = ["MODEL_NAMES", "Dataset", "ModelSpec", "get_model"]


def _mlp(overrides: dict[str, Any]) -> ModelSpec:
    return mlp_spec(make_config("mlp", MLPConfig, overrides))


def _gpt(overrides: dict[str, Any]) -> ModelSpec:
    return gpt_spec(make_config("gpt", GPTConfig, overrides))


def _cnn(overrides: dict[str, Any]) -> ModelSpec:
    return cnn_spec(make_config("cnn", CNNConfig, overrides))


_FACTORIES: dict[str, Callable[[dict[str, Any]], ModelSpec]] = {
    "mlp": _mlp,
    "gpt": _gpt,
    "cnn": _cnn,
}
MODEL_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def get_model(name: str, **overrides: Any) -> ModelSpec:
    """The model `name` with config fields replaced by `overrides`.

    ``get_model(spec.name, **spec.config)`` rebuilds an equal spec.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise PlanError(f"unknown model {name!r} (allowed: {', '.join(MODEL_NAMES)})")
    return factory(overrides)
