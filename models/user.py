"""A user's model: ``[model] factory = "my_package.my_module:build"`` (or a file,
``"my_model.py:build"``, relative to the config) as a `ModelSpec`.

The factory returns ``(layers, loss, dataset)``, or a mapping with those keys and an
optional ``val_dataset``:

- ``layers``: an ``nn.Sequential`` (children in order, named by their keys) or a list of
  ``(name, factory)`` pairs, each factory building one layer;
- ``loss``: ``loss(output, target) -> scalar``, the mean over the micro-batch;
- ``dataset``: a map-style ``torch.utils.data.Dataset`` whose items are
  ``(input, target)`` (`adaptipe.models.mapdata.MapDataset` reads it).

The stage contract holds for user models as for the zoo (`adaptipe.models.spec`): layer
i is built from the declaration and the run seed alone, under its own generator. A
``(name, factory)`` layer is built by its factory under that generator. A layer of a
``Sequential`` is copied from one template (the factory's model, built once per process
under a fixed seed, so buffers agree everywhere) and its parameters drawn again under
the layer's generator by the ``reset_parameters`` of the modules that own them: a
parameter owned by a module without one is refused, with the layer and what to do.

A model the pipeline cannot run is refused by `check_contract`, naming the layer: layers
that share a parameter, a layer that returns anything but one tensor.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from adaptipe.errors import PlanError
from adaptipe.models.mapdata import MapDataset
from adaptipe.models.spec import LayerSpec, ModelSpec, Split

__all__ = ["check_contract", "load_factory", "resolve_factory", "user_model"]

_TEMPLATE_SEED = 0x05E7  # the factory runs under this seed: every process gets one model


def resolve_factory(ref: str, *, base: Path | None = None) -> str:
    """``ref`` with a file part made absolute (against ``base``, the config's folder), so
    the worker processes find the same file; a module path stays as it is."""
    module, _, attr = _parse(ref)
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_absolute():
            path = (base or Path.cwd()) / path
        if not path.is_file():
            raise PlanError(f"[model].factory: no file {str(path)!r} (from {ref!r})")
        return f"{path.resolve()}:{attr}"
    return ref


def _parse(ref: str) -> tuple[str, str, str]:
    module, sep, attr = ref.rpartition(":")
    if not sep or not module or not attr.isidentifier():
        raise PlanError(
            f"[model].factory must be 'package.module:function' or 'file.py:function' (got {ref!r})"
        )
    return module, sep, attr


def load_factory(ref: str) -> Callable[..., Any]:
    """The function ``ref`` names (see `resolve_factory`), imported."""
    module_name, _, attr = _parse(ref)
    try:
        if module_name.endswith(".py"):
            digest = hashlib.sha256(module_name.encode()).hexdigest()[:12]
            name = f"adaptipe_user_{Path(module_name).stem}_{digest}"
            module = sys.modules.get(name)
            if module is None:
                found = importlib.util.spec_from_file_location(name, module_name)
                if found is None or found.loader is None:
                    raise ImportError(f"cannot load {module_name}")
                module = importlib.util.module_from_spec(found)
                sys.modules[name] = module
                found.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise PlanError(f"[model].factory {ref!r}: importing failed: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PlanError(f"[model].factory {ref!r}: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=8)
def _built(ref: str, options: tuple[tuple[str, Any], ...]) -> ModelSpec:
    fn = load_factory(ref)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TEMPLATE_SEED)
        made = fn(**dict(options))
    layers, loss, datasets = _unpack(ref, made)
    spec = ModelSpec(
        name=_label(ref),
        config=dict(options),
        layers=tuple(layers),
        loss_fn=loss,
        dataset_fn=functools.partial(_dataset, ref, datasets),
    )
    check_contract(spec)
    return spec


def _label(ref: str) -> str:
    """A short name for the model: ``file:function`` or the module path as given."""
    module, _, attr = _parse(ref)
    return f"{Path(module).stem}:{attr}" if module.endswith(".py") else ref


def user_model(ref: str, **options: Any) -> ModelSpec:
    """The `ModelSpec` of the factory ``ref`` (resolved) called with ``options``; built
    once per process and options."""
    return _built(ref, tuple(sorted(options.items())))


def _unpack(ref: str, made: Any) -> tuple[list[LayerSpec], Any, dict[str, Any]]:
    if isinstance(made, Mapping):
        missing = [key for key in ("layers", "loss", "dataset") if key not in made]
        if missing:
            raise PlanError(f"[model].factory {ref!r}: the mapping it returned lacks {missing}")
        layers, loss = made["layers"], made["loss"]
        datasets = {"train": made["dataset"], "val": made.get("val_dataset")}
    elif isinstance(made, tuple | list) and len(made) == 3:
        layers, loss, train = made
        datasets = {"train": train, "val": None}
    else:
        raise PlanError(
            f"[model].factory {ref!r} must return (layers, loss, dataset) or a mapping "
            f"with those keys (got {type(made).__name__})"
        )
    if not callable(loss):
        raise PlanError(f"[model].factory {ref!r}: loss is not callable")
    return _layer_specs(ref, layers), loss, datasets


def _layer_specs(ref: str, layers: Any) -> list[LayerSpec]:
    if isinstance(layers, nn.Sequential):
        _refuse_shared(ref, layers)
        return [
            LayerSpec(name=name, kind=type(module).__name__, make=_copier(ref, name, module))
            for name, module in layers.named_children()
        ]
    if isinstance(layers, Sequence) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and callable(p[1])
        for p in layers
    ):
        return [LayerSpec(name=name, kind=name.rstrip("0123456789_"), make=f) for name, f in layers]
    raise PlanError(
        f"[model].factory {ref!r}: layers must be an nn.Sequential or a list of "
        f"(name, factory) pairs (got {type(layers).__name__})"
    )


def _refuse_shared(ref: str, layers: nn.Sequential) -> None:
    owner: dict[int, str] = {}
    for name, layer in layers.named_children():
        for p in layer.parameters():
            if id(p) in owner and owner[id(p)] != name:
                raise PlanError(
                    f"[model].factory {ref!r}: layers {owner[id(p)]!r} and {name!r} share a "
                    "parameter; each layer must own its parameters (a stage may hold one "
                    "without the other): untie them, or merge the two into one layer"
                )
            owner[id(p)] = name


def _copier(ref: str, name: str, template: nn.Module) -> Callable[[], nn.Module]:
    uncovered = _uncovered(template)
    if uncovered:
        raise PlanError(
            f"[model].factory {ref!r}: layer {name!r}: parameter {uncovered[0]!r} belongs to "
            "a module without reset_parameters(), so it cannot be drawn under the layer's "
            "own seed; give that module a reset_parameters() that initialises it, or "
            "declare the layers as a list of (name, factory) pairs"
        )
    return functools.partial(_fresh_copy, template)


def _resets(module: nn.Module) -> Callable[[], None] | None:
    fn = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return fn if callable(fn) else None


def _uncovered(layer: nn.Module) -> list[str]:
    """Parameters of ``layer`` whose owning module has no reset method."""
    return [
        f"{prefix}.{pname}" if prefix else pname
        for prefix, module in layer.named_modules()
        for pname, p in module.named_parameters(recurse=False)
        if p is not None and _resets(module) is None
    ]


def _fresh_copy(template: nn.Module) -> nn.Module:
    """A copy of ``template`` with its parameters drawn again (under the caller's seed)."""
    layer = copy.deepcopy(template)
    with torch.no_grad():
        for module in layer.modules():
            if any(True for _ in module.parameters(recurse=False)):
                reset = _resets(module)
                assert reset is not None  # `_copier` refused it otherwise
                reset()
    return layer


def _dataset(ref: str, datasets: dict[str, Any], split: Split) -> MapDataset:
    data = datasets.get(split)
    if data is None:
        raise PlanError(
            f"[model].factory {ref!r} gave no {split!r} dataset (return a mapping with "
            "'val_dataset' for validation)"
        )
    return data if isinstance(data, MapDataset) else MapDataset(data, name=f"{ref} ({split})")


def check_contract(spec: ModelSpec) -> None:
    """Refuse what the pipeline cannot run, naming the layer: a layer that fails on one
    tensor or returns anything else (run on two samples). Shared parameters are refused
    when the layers are read (`user_model`)."""
    layers = [spec.build_layer(i, seed=0) for i in range(spec.num_layers)]
    x: Any = spec.dataset(split="train").sample_input(2)
    with torch.no_grad():
        for name, layer in zip(spec.layer_names(), layers, strict=True):
            try:
                x = layer(x)
            except Exception as exc:
                raise PlanError(
                    f"model {spec.name!r}: layer {name!r} failed on the previous layer's "
                    f"output ({_shape(x)}): {type(exc).__name__}: {exc}. Each layer takes "
                    "exactly one tensor, the previous layer's output"
                ) from exc
            if not isinstance(x, Tensor):
                raise PlanError(
                    f"model {spec.name!r}: layer {name!r} returns a {type(x).__name__}; "
                    "adaptipe passes one tensor between layers: make it return one tensor "
                    "(for example wrap it and return the part the next layer reads)"
                )


def _shape(x: Any) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
