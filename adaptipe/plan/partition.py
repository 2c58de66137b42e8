"""`Partition`: which contiguous layers each (virtual) pipeline stage owns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.serial import check_kind, get_int, get_list, get_str

__all__ = ["PARTITION_VERSION", "Partition"]

PARTITION_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Partition:
    """Contiguous split of a model's layers into pipeline stages.

    Stage ``s`` owns layers ``bounds[s]`` up to (not including) ``bounds[s + 1]``.
    With interleaved schedules the stages here are *virtual* stages, placed on workers
    by the schedule (virtual stage ``g`` lives on worker ``g % S`` as chunk ``g // S``).

    Attributes:
        model: name of the model the partition is for.
        num_layers: number of layers in the model.
        bounds: ``S + 1`` increasing layer indices, ``0`` first and ``num_layers`` last.
        replicas: data-parallel replicas per stage (PipeDream); all 1 when not replicated.
        planner: who made it (``uniform``, ``pipedream``, ``dynpipe``, ``manual``...).
        predicted_s: the planner's predicted time per micro-batch (its own cost model).
        meta: planner-specific details (bandwidths used, stage times, NOAM...).
    """

    model: str
    num_layers: int
    bounds: tuple[int, ...]
    replicas: tuple[int, ...] = ()
    planner: str = "manual"
    predicted_s: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"partition of {self.model!r}"
        b = self.bounds
        if len(b) < 2:
            raise PlanError(f"{where}: bounds must hold at least 2 entries (got {list(b)})")
        if b[0] != 0 or b[-1] != self.num_layers:
            raise PlanError(
                f"{where}: bounds must start at 0 and end at num_layers={self.num_layers} "
                f"so every layer is covered (got {list(b)})"
            )
        for s in range(len(b) - 1):
            if b[s + 1] <= b[s]:
                raise PlanError(
                    f"{where}: stage {s} is empty or reversed (bounds[{s}]={b[s]}, bounds[{s + 1}]={b[s + 1]}); "
                    "bounds must be strictly increasing"
                )
        if not self.replicas:
            object.__setattr__(self, "replicas", (1,) * (len(b) - 1))
        if len(self.replicas) != len(b) - 1 or any(r < 1 for r in self.replicas):
            raise PlanError(
                f"{where}: replicas must hold one integer >= 1 per stage ({len(b) - 1}) (got {list(self.replicas)})"
            )

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def layers(self, stage: int) -> range:
        """The layer indices stage ``stage`` owns."""
        if not 0 <= stage < self.num_stages:
            raise IndexError(f"stage {stage} out of range 0..{self.num_stages - 1}")
        return range(self.bounds[stage], self.bounds[stage + 1])

    def stage_of(self, layer: int) -> int:
        for s in range(self.num_stages):
            if self.bounds[s] <= layer < self.bounds[s + 1]:
                return s
        raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")

    def check_model(self, *, model: str, num_layers: int, source: str = "partition") -> None:
        """Raise `PlanError` unless this partition fits a model with ``num_layers`` layers."""
        if num_layers != self.num_layers:
            raise PlanError(
                f"{source}: partition covers {self.num_layers} layers but model {model!r} has {num_layers}"
            )

    @classmethod
    def even(cls, *, model: str, num_layers: int, num_stages: int) -> Partition:
        """Split layers as evenly as possible, earlier stages taking the remainder."""
        if not 1 <= num_stages <= num_layers:
            raise PlanError(
                f"cannot split {num_layers} layers of {model!r} into {num_stages} stages "
                f"(allowed: 1..{num_layers})"
            )
        base, extra = divmod(num_layers, num_stages)
        bounds = [0]
        for s in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
        return cls(model=model, num_layers=num_layers, bounds=tuple(bounds), planner="even")

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "partition",
            "version": PARTITION_VERSION,
            "model": self.model,
            "num_layers": self.num_layers,
            "bounds": list(self.bounds),
            "replicas": list(self.replicas),
            "planner": self.planner,
            "predicted_s": self.predicted_s,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "partition") -> Partition:
        check_kind(data, kind="partition", version=PARTITION_VERSION, source=source)
        bounds = get_list(data, "bounds", source=source)
        replicas = get_list(data, "replicas", source=source, default=[])
        for name, values in (("bounds", bounds), ("replicas", replicas)):
            for i, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise PlanError(f"{source}: {name}[{i}] must be an integer (got {v!r})")
        predicted = data.get("predicted_s")
        if predicted is not None and (
            isinstance(predicted, bool) or not isinstance(predicted, int | float)
        ):
            raise PlanError(f"{source}: predicted_s must be a number or null (got {predicted!r})")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise PlanError(f"{source}: meta must be an object")
        try:
            return cls(
                model=get_str(data, "model", source=source),
                num_layers=get_int(data, "num_layers", source=source, minimum=1),
                bounds=tuple(bounds),
                replicas=tuple(replicas),
                planner=get_str(data, "planner", source=source, default="manual"),
                predicted_s=None if predicted is None else float(predicted),
                meta=meta,
            )
        except PlanError as exc:
            # Re-word the constructor's message so it names the file.
            msg = str(exc).split(": ", 1)[-1]
            raise PlanError(f"{source}: {msg}") from None
