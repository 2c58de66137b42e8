"""`Profile`: what each layer of a model costs at one micro-batch size on one device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.serial import check_kind, get_float, get_int, get_list, get_str

__all__ = ["PROFILE_VERSION", "LayerProfile", "Profile", "mean_profile"]

PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerProfile:
    """Measured costs of one layer for one micro-batch.

    Attributes:
        name: the layer's name in the model declaration.
        kind: the layer type (``Linear``, ``Block``, ``Conv``...), used as a stage feature.
        forward_s: median forward time in seconds.
        backward_s: median backward time in seconds (input and weight gradients).
        activation_bytes: bytes of the layer's output, sent forward when a stage ends here.
        gradient_bytes: bytes of the gradient w.r.t. the layer's input, sent backward when
            a stage starts here.
        saved_bytes: bytes autograd keeps from forward until backward (activation stash).
        param_bytes: bytes of the layer's parameters.
        optimizer_bytes: bytes of optimizer state for those parameters.
        num_params: number of parameters.
        update_s: median time of the optimizer step for those parameters.
        backward_input_s: median backward time with the weight gradients of the layer's
            ``nn.Linear`` modules deferred (batched weight gradients); ``None`` if not
            measured. Other parameters' gradients are still included.
        wgrad_s: median time to compute those deferred weight gradients for
            `Profile.wgrad_microbatches` micro-batches at once (one GEMM per Linear);
            ``None`` if not measured.
        wgrad_bytes: bytes one micro-batch keeps from its backward until the step for
            those weight gradients (each deferred Linear's input and output gradient);
            ``None`` if not measured.
    """

    name: str
    kind: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    gradient_bytes: int
    saved_bytes: int
    param_bytes: int
    optimizer_bytes: int
    num_params: int
    update_s: float = 0.0
    backward_input_s: float | None = None
    wgrad_s: float | None = None
    wgrad_bytes: int | None = None

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Per-layer profile of one model at one micro-batch size (PipeDream §2.4.1).

    ``wgrad_microbatches`` is the number of micro-batches whose deferred weight gradients
    each layer's ``wgrad_s`` covers (0: batched weight gradients were not profiled).
    """

    model: str
    microbatch: int
    device: str
    layers: tuple[LayerProfile, ...]
    input_bytes: int = 0
    dtype: str = "float32"
    optimizer: str = "sgd"
    threads: int = 1
    repeats: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    wgrad_microbatches: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            raise PlanError(f"profile of {self.model!r}: has no layers")
        if self.microbatch < 1:
            raise PlanError(
                f"profile of {self.model!r}: microbatch must be >= 1 (got {self.microbatch})"
            )
        if self.wgrad_microbatches < 0:
            raise PlanError(
                f"profile of {self.model!r}: wgrad_microbatches must be >= 0 "
                f"(got {self.wgrad_microbatches})"
            )

    @property
    def has_batched_wgrad(self) -> bool:
        """Whether every layer has its batched weight-gradient timings."""
        return self.wgrad_microbatches > 0 and all(
            x.backward_input_s is not None and x.wgrad_s is not None for x in self.layers
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward_times(self) -> list[float]:
        return [layer.forward_s for layer in self.layers]

    def backward_times(self) -> list[float]:
        return [layer.backward_s for layer in self.layers]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "profile",
            "version": PROFILE_VERSION,
            "model": self.model,
            "microbatch": self.microbatch,
            "device": self.device,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "threads": self.threads,
            "repeats": self.repeats,
            "input_bytes": self.input_bytes,
            "wgrad_microbatches": self.wgrad_microbatches,
            "meta": dict(self.meta),
            # Unmeasured optional timings are left out, as in profiles written before them.
            "layers": [
                {k: v for k, v in asdict(layer).items() if v is not None} for layer in self.layers
            ],
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "profile") -> Profile:
        check_kind(data, kind="profile", version=PROFILE_VERSION, source=source)
        raw_layers = get_list(data, "layers", source=source)
        if not raw_layers:
            raise PlanError(f"{source}: layers must not be empty")
        layers = []
        for i, raw in enumerate(raw_layers):
            p = f"layers[{i}]."
            kw: dict[str, Any] = dict(source=source, prefix=p)
            layers.append(
                LayerProfile(
                    name=get_str(raw, "name", **kw),
                    kind=get_str(raw, "kind", **kw),
                    forward_s=get_float(raw, "forward_s", minimum=0.0, **kw),
                    backward_s=get_float(raw, "backward_s", minimum=0.0, **kw),
                    activation_bytes=get_int(raw, "activation_bytes", minimum=0, **kw),
                    gradient_bytes=get_int(raw, "gradient_bytes", minimum=0, **kw),
                    saved_bytes=get_int(raw, "saved_bytes", minimum=0, default=0, **kw),
                    param_bytes=get_int(raw, "param_bytes", minimum=0, **kw),
                    optimizer_bytes=get_int(raw, "optimizer_bytes", minimum=0, default=0, **kw),
                    num_params=get_int(raw, "num_params", minimum=0, default=0, **kw),
                    update_s=get_float(raw, "update_s", minimum=0.0, default=0.0, **kw),
                    backward_input_s=_optional_seconds(raw, "backward_input_s", **kw),
                    wgrad_s=_optional_seconds(raw, "wgrad_s", **kw),
                    wgrad_bytes=(
                        get_int(raw, "wgrad_bytes", minimum=0, **kw)
                        if raw.get("wgrad_bytes") is not None
                        else None
                    ),
                )
            )
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise PlanError(f"{source}: meta must be an object")
        return cls(
            model=get_str(data, "model", source=source),
            microbatch=get_int(data, "microbatch", source=source, minimum=1),
            device=get_str(data, "device", source=source),
            dtype=get_str(data, "dtype", source=source, default="float32"),
            optimizer=get_str(data, "optimizer", source=source, default="sgd"),
            threads=get_int(data, "threads", source=source, minimum=0, default=1),
            repeats=get_int(data, "repeats", source=source, minimum=0, default=0),
            input_bytes=get_int(data, "input_bytes", source=source, minimum=0, default=0),
            wgrad_microbatches=get_int(
                data, "wgrad_microbatches", source=source, minimum=0, default=0
            ),
            meta=meta,
            layers=tuple(layers),
        )

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        *,
        forward_s: float = 1.0,
        backward_s: float = 2.0,
        activation_bytes: int = 0,
        param_bytes: int = 0,
        model: str = "uniform",
    ) -> Profile:
        """A synthetic profile with identical layers (tests, examples, the default simulator)."""
        layer = dict(
            kind="Uniform",
            forward_s=forward_s,
            backward_s=backward_s,
            activation_bytes=activation_bytes,
            gradient_bytes=activation_bytes,
            saved_bytes=activation_bytes,
            param_bytes=param_bytes,
            optimizer_bytes=0,
            num_params=param_bytes // 4,
        )
        return cls(
            model=model,
            microbatch=1,
            device="synthetic",
            input_bytes=activation_bytes,
            layers=tuple(LayerProfile(name=f"layer{i}", **layer) for i in range(num_layers)),  # type: ignore[arg-type]
        )


def _optional_seconds(raw: Any, key: str, *, source: str, prefix: str) -> float | None:
    if raw.get(key) is None:
        return None
    return get_float(raw, key, minimum=0.0, source=source, prefix=prefix)


def mean_profile(profiles: Sequence[Profile]) -> Profile:
    """Per layer, the mean of several profiles' times (one model, one micro-batch size);
    bytes and the rest are the first profile's."""
    if not profiles:
        raise PlanError("mean_profile: no profiles")
    first = profiles[0]
    for other in profiles[1:]:
        if (other.model, other.microbatch, other.num_layers) != (
            first.model,
            first.microbatch,
            first.num_layers,
        ):
            raise PlanError(
                "mean_profile: profiles of different models or micro-batch sizes "
                f"({first.model}/{first.microbatch} and {other.model}/{other.microbatch})"
            )
    n = len(profiles)

    def mean(values: Sequence[float | None]) -> float | None:
        return None if any(v is None for v in values) else sum(v or 0.0 for v in values) / n

    layers = []
    for i, layer in enumerate(first.layers):
        column = [p.layers[i] for p in profiles]
        layers.append(
            replace(
                layer,
                forward_s=sum(x.forward_s for x in column) / n,
                backward_s=sum(x.backward_s for x in column) / n,
                update_s=sum(x.update_s for x in column) / n,
                backward_input_s=mean([x.backward_input_s for x in column]),
                wgrad_s=mean([x.wgrad_s for x in column]),
            )
        )
    return replace(first, layers=tuple(layers))
