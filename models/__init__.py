"""The partitionable model zoo: each model is an ordered list of layers plus a loss.

>>> from adaptipe.models import get_model
>>> spec = get_model("gpt", n_layer=2)
>>> stage = spec.build(1, 3, seed=0)  # layers [1, 3) of the model, as a stage builds them

The models load on first use: ``MODEL_NAMES`` alone (the CLI's choices) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from adaptipe.errors import PlanError

if TYPE_CHECKING:
    from adaptipe.models.data import Dataset
    from adaptipe.models.spec import ModelSpec

__all__ = ["MODEL_NAMES", "Dataset", "ModelSpec", "get_model"]

# name -> (module, config class, spec builder)
_FACTORIES: dict[str, tuple[str, str, str]] = {
    "mlp": ("adaptipe.models.mlp", "MLPConfig", "mlp_spec"),
    "gpt": ("adaptipe.models.gpt", "GPTConfig", "gpt_spec"),
    "cnn": ("adaptipe.models.cnn", "CNNConfig", "cnn_spec"),
}
MODEL_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def get_model(name: str, **overrides: Any) -> ModelSpec:
    """The model `name` with config fields replaced by `overrides`.

    ``get_model(spec.name, **spec.config)`` rebuilds an equal spec.
    """
    from adaptipe.models.spec import make_config

    entry = _FACTORIES.get(name)
    if entry is None:
        raise PlanError(f"unknown model {name!r} (allowed: {', '.join(MODEL_NAMES)})")
    module = importlib.import_module(entry[0])
    config = make_config(name, getattr(module, entry[1]), overrides)
    spec: ModelSpec = getattr(module, entry[2])(config)
    return spec


def __getattr__(name: str) -> object:
    if name == "Dataset":
        return importlib.import_module("adaptipe.models.data").Dataset
    if name == "ModelSpec":
        return importlib.import_module("adaptipe.models.spec").ModelSpec
    raise AttributeError(f"module 'adaptipe.models' has no attribute {name!r}")
