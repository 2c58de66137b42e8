"""`ModelSpec`: a model as an ordered list of independently built layers plus a loss.

A pipeline may cut the list anywhere and a stage may build layers it does not own yet
(layer migration), so layer i's initial weights must depend only on (seed, i, config):
each layer is built on the CPU in float32 under its own seed, with the caller's RNG
state saved and restored, and then moved to the requested device and dtype. Building on
the CPU first (one layer at a time) makes the weights identical on every device; CUDA's
RNG would draw different numbers. ``device="meta"`` builds shapes only, with no memory.
"""

from __future__ import annotations

import threading
import typing
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn

from adaptipe.errors import PlanError
from adaptipe.models.data import Dataset, mix_seed

__all__ = [
    "RNG_LOCK",
    "SPLITS",
    "LayerSpec",
    "ModelSpec",
    "Split",
    "check_choice",
    "check_min",
    "check_types",
    "make_config",
]

Split = Literal["train", "val"]
SPLITS: tuple[Split, ...] = ("train", "val")

ConfigT = TypeVar("ConfigT")

# fork_rng saves and restores the process-wide CPU generator; serialise builds so two
# threads building layers at once cannot see each other's seeds.
RNG_LOCK = threading.Lock()
"""Held while this process's default generator is re-seeded: a layer's initialisation
here, a layer's dropout draws in the runtime (`adaptipe.runtime.slots`), which may run
on different threads (a streamed migration builds the layers it receives on its own)."""


@contextmanager
def _isolated_init(seed: int) -> Iterator[None]:
    """Seed the CPU RNG for one layer's initialisation, restoring the caller's state after."""
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        default_dtype = torch.get_default_dtype()
        if default_dtype != torch.float32:  # draw the same numbers whatever the caller set
            torch.set_default_dtype(torch.float32)
        try:
            with torch.device("cpu"):
                yield
        finally:
            if default_dtype != torch.float32:
                torch.set_default_dtype(default_dtype)


# In-place initialisers that only write values: nothing to do on the meta device.
_INITIALISERS = frozenset(
    {"normal_", "uniform_", "trunc_normal_", "random_", "bernoulli_", "exponential_",
     "fill_", "zero_", "copy_", "orthogonal_", "kaiming_uniform_", "kaiming_normal_",
     "xavier_uniform_", "xavier_normal_", "ones_", "zeros_", "constant_", "eye_", "dirac_",
     "sparse_"}
)  # fmt: skip


class _NoInitOnMeta(torch.overrides.TorchFunctionMode):
    """Skip value initialisation of meta tensors. On meta, ``normal_`` runs through
    ``torch._refs``, whose wrapper imports ``torch._dynamo`` (about 1.2 s of CPU, once a
    process): what the manager's job-array check (`adaptipe.runtime.jobarray`) paid at
    start-up for a layer with an embedding. A forward on meta may still import it
    (``torch.arange`` goes the same way)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        first = args[0] if args else (kwargs or {}).get("tensor")  # torch.nn.init's name
        if name in _INITIALISERS and isinstance(first, Tensor) and first.is_meta:
            return first
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One layer: its unique name, its kind (a profiling feature) and how to construct it.

    `make` must be picklable (a module-level function or `functools.partial` of one) so
    specs can be sent to pipeline worker processes.
    """

    name: str
    kind: str
    make: Callable[[], nn.Module] = field(compare=False, repr=False)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A partitionable model: layers [0, num_layers), each mapping one tensor to one tensor.

    The first layer takes the dataset's input, the last layer's output goes to `loss`.
    Get one with `adaptipe.models.get_model`.
    """

    name: str
    config: dict[str, Any]
    layers: tuple[LayerSpec, ...]
    loss_fn: Callable[[Tensor, Tensor], Tensor] = field(compare=False, repr=False)
    dataset_fn: Callable[[Split], Dataset] = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise PlanError(f"model {self.name!r}: has no layers")
        names = self.layer_names()
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise PlanError(f"model {self.name!r}: duplicate layer names {duplicates}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def layer_kinds(self) -> list[str]:
        return [layer.kind for layer in self.layers]

    def build_layer(
        self,
        index: int,
        *,
        seed: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> nn.Module:
        """Layer `index`, initialised from (seed, index, config) only."""
        self._check_range(index, 0, self.num_layers - 1, "layer index")
        target = torch.device(device)
        if target.type == "meta":  # shapes only: no values to draw
            with _NoInitOnMeta(), torch.device("meta"):
                module = self.layers[index].make()
        else:
            with _isolated_init(mix_seed(seed, index)):
                module = self.layers[index].make()
        return module.to(device=target, dtype=dtype)

    def build(
        self,
        start: int,
        stop: int,
        *,
        seed: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> nn.Sequential:
        """Layers [start, stop) as a Sequential whose children carry the layer names.

        Parameter names therefore match `build_all`'s (``block2.attn.qkv.weight``), so a
        stage's state dict can be merged into or sliced from the whole model's.
        """
        self._check_range(start, 0, self.num_layers, "start")
        self._check_range(stop, start, self.num_layers, "stop")
        return nn.Sequential(
            OrderedDict(
                (self.layers[i].name, self.build_layer(i, seed=seed, device=device, dtype=dtype))
                for i in range(start, stop)
            )
        )

    def build_all(
        self,
        *,
        seed: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> nn.Sequential:
        return self.build(0, self.num_layers, seed=seed, device=device, dtype=dtype)

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean loss of the last layer's output against the dataset's target."""
        return self.loss_fn(output, target)

    def dataset(self, *, split: Split = "train") -> Dataset:
        if split not in SPLITS:
            raise PlanError(
                f"model {self.name!r}: unknown split {split!r} (allowed: {', '.join(SPLITS)})"
            )
        return self.dataset_fn(split)

    def _check_range(self, value: int, low: int, high: int, what: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise PlanError(
                f"model {self.name!r}: {what} must be an int in [{low}, {high}] (got {value!r})"
            )


# ---- config helpers shared by the model modules ------------------------------------------


def make_config(model: str, config_type: type[ConfigT], overrides: Mapping[str, Any]) -> ConfigT:
    """Build `config_type(**overrides)`, rejecting names the config does not have."""
    allowed = [item.name for item in fields(config_type)]  # type: ignore[arg-type]
    for key in overrides:
        if key not in allowed:
            raise PlanError(
                f"model {model!r}: unknown config field {key!r} (allowed: {', '.join(allowed)})"
            )
    return config_type(**overrides)


_TYPE_NAMES = {int: "an int", float: "a number", str: "a string", bool: "a bool"}


def check_types(model: str, config: Any) -> None:
    """Check every field of a dataclass config against its annotation (int, float, str, bool)."""
    hints = typing.get_type_hints(type(config))
    for item in fields(config):
        expected, value = hints[item.name], getattr(config, item.name)
        if expected is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif expected is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, expected)
        if not ok:
            raise PlanError(
                f"model {model!r}: config field {item.name!r} must be "
                f"{_TYPE_NAMES.get(expected, str(expected))} (got {value!r})"
            )


def check_min(model: str, name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise PlanError(
            f"model {model!r}: config field {name!r} must be >= {minimum} (got {value!r})"
        )


def check_choice(model: str, name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise PlanError(
            f"model {model!r}: config field {name!r} must be one of "
            f"{', '.join(map(str, allowed))} (got {value!r})"
        )
