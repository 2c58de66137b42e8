"""The one schedule form: per-stage ordered instruction lists.

Every schedule generator (GPipe, 1F1B, interleaved 1F1B, PipeDream, 2BW, job-array
orders) compiles to a `Schedule`; the simulator and the stage workers each execute it
with one loop that matches on the instruction type (DeepSpeed's pipe `schedule.py`
shape, but as data rather than generators, so it can be saved, diffed and validated).

Virtual stages: with ``num_chunks = V`` each of the ``S`` workers holds ``V`` model
chunks. Virtual stage ``g`` (``0 <= g < S*V``, in model order) lives on worker
``g % S`` as its local chunk ``g // S`` (the Megatron / PTD-P placement). Compute
instructions carry the *local* chunk; send/recv instructions carry the local chunk
whose output (activation) or input gradient they move, and the ``peer`` worker.
Micro-batch input is read by virtual stage 0; the loss is computed by the last one.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, get_args

from adaptipe.errors import PlanError
from adaptipe.serial import check_kind, get_bool, get_int, get_list, get_str

__all__ = [
    "OPS",
    "SCHEDULE_VERSION",
    "Backward",
    "Compute",
    "Forward",
    "Instruction",
    "OptimizerStep",
    "Recompute",
    "RecvActivation",
    "RecvGradient",
    "Schedule",
    "SendActivation",
    "SendGradient",
    "Transfer",
    "WeightMode",
]

SCHEDULE_VERSION = 1

WeightMode = Literal["sync", "stash", "vertical", "2bw"]
"""How weights are versioned: ``sync`` (one version, flush before the update),
``stash`` (PipeDream weight stashing), ``vertical`` (stashing with vertical sync),
``2bw`` (PipeDream-2BW double buffering)."""


@dataclass(frozen=True, slots=True)
class Forward:
    """Run the forward pass of ``chunk`` for one micro-batch with weight ``version``."""

    job: int
    microbatch: int
    chunk: int = 0
    version: int = 0


@dataclass(frozen=True, slots=True)
class Backward:
    """Run the backward pass; ``version`` must equal the one its forward used."""

    job: int
    microbatch: int
    chunk: int = 0
    version: int = 0


@dataclass(frozen=True, slots=True)
class Recompute:
    """Re-run a forward from its stashed input to rebuild activations before backward."""

    job: int
    microbatch: int
    chunk: int = 0
    version: int = 0


@dataclass(frozen=True, slots=True)
class SendActivation:
    """Send the output of local ``chunk`` to worker ``peer`` (non-blocking)."""

    job: int
    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True, slots=True)
class RecvActivation:
    """Receive the input of local ``chunk`` from worker ``peer`` (blocks until it arrives)."""

    job: int
    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True, slots=True)
class SendGradient:
    """Send the gradient w.r.t. the input of local ``chunk`` to worker ``peer``."""

    job: int
    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True, slots=True)
class RecvGradient:
    """Receive the gradient w.r.t. the output of local ``chunk`` from worker ``peer``."""

    job: int
    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """Apply the accumulated gradients of ``job`` on every chunk of this stage."""

    job: int


Compute = Forward | Backward | Recompute
Transfer = SendActivation | RecvActivation | SendGradient | RecvGradient
Instruction = Forward | Backward | Recompute | Transfer | OptimizerStep

OPS: dict[str, type[Any]] = {
    "forward": Forward,
    "backward": Backward,
    "recompute": Recompute,
    "send_act": SendActivation,
    "recv_act": RecvActivation,
    "send_grad": SendGradient,
    "recv_grad": RecvGradient,
    "step": OptimizerStep,
}
_OP_NAME: dict[type[Any], str] = {cls: name for name, cls in OPS.items()}
# JSON keys are short so schedules of thousands of instructions stay readable.
_FIELD_KEY = {"microbatch": "mb"}


def instruction_to_json(ins: Instruction) -> dict[str, Any]:
    out: dict[str, Any] = {"op": _OP_NAME[type(ins)]}
    for f in fields(ins):
        out[_FIELD_KEY.get(f.name, f.name)] = getattr(ins, f.name)
    return out


def instruction_from_json(raw: Any, *, source: str, prefix: str) -> Instruction:
    op = get_str(raw, "op", source=source, prefix=prefix, choices=tuple(OPS))
    cls = OPS[op]
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        key = _FIELD_KEY.get(f.name, f.name)
        if f.default is MISSING:
            kwargs[f.name] = get_int(raw, key, source=source, prefix=prefix, minimum=0)
        else:
            kwargs[f.name] = get_int(
                raw, key, source=source, prefix=prefix, minimum=0, default=f.default
            )
    extra = set(raw) - {"op"} - {_FIELD_KEY.get(f.name, f.name) for f in fields(cls)}
    if extra:
        raise PlanError(
            f"{source}: {prefix}{sorted(extra)[0]} is not a field of {op!r} instructions"
        )
    ins: Instruction = cls(**kwargs)
    return ins


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """Per-stage ordered instruction lists for one iteration (or one async window).

    Attributes:
        name: the generator that made it (``gpipe``, ``1f1b``, ``interleaved``...).
        num_stages: number of workers ``S``.
        num_microbatches: micro-batches per job covered by the instruction lists.
        num_chunks: virtual stages per worker ``V`` (1 unless interleaved).
        num_jobs: jobs in the array (1 for a single job).
        weights: the weight-versioning rule the ``version`` fields follow.
        update_every: micro-batches whose gradients form one optimizer step
            (``num_microbatches`` for flushing schedules, 1 for PipeDream, m for 2BW).
        recompute: forwards keep only their input; a `Recompute` precedes each backward.
        stages: ``stages[s]`` is worker ``s``'s instruction list, in execution order.
        meta: generator parameters (in-flight limit, warm-up counts...).
    """

    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Instruction, ...], ...]
    num_chunks: int = 1
    num_jobs: int = 1
    weights: WeightMode = "sync"
    update_every: int = 0
    recompute: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.update_every == 0:
            object.__setattr__(self, "update_every", self.num_microbatches)

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def vstage(self, stage: int, chunk: int) -> int:
        """Global (model-order) index of local ``chunk`` on worker ``stage``."""
        return chunk * self.num_stages + stage

    def place(self, vstage: int) -> tuple[int, int]:
        """``(worker, local chunk)`` holding virtual stage ``vstage``."""
        return vstage % self.num_stages, vstage // self.num_stages

    def num_instructions(self) -> int:
        return sum(len(s) for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "schedule",
            "version": SCHEDULE_VERSION,
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "num_chunks": self.num_chunks,
            "num_jobs": self.num_jobs,
            "weights": self.weights,
            "update_every": self.update_every,
            "recompute": self.recompute,
            "meta": dict(self.meta),
            "stages": [[instruction_to_json(i) for i in stage] for stage in self.stages],
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "schedule", validate: bool = True) -> Schedule:
        """Parse and (by default) validate a schedule; errors name the field or instruction."""
        check_kind(data, kind="schedule", version=SCHEDULE_VERSION, source=source)
        raw_stages = get_list(data, "stages", source=source)
        stages = tuple(
            tuple(
                instruction_from_json(raw, source=source, prefix=f"stages[{s}][{i}].")
                for i, raw in enumerate(
                    get_list({"s": stage}, "s", source=source, prefix=f"stages[{s}]")
                )
            )
            for s, stage in enumerate(raw_stages)
        )
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise PlanError(f"{source}: meta must be an object")
        schedule = cls(
            name=get_str(data, "name", source=source),
            num_stages=get_int(data, "num_stages", source=source, minimum=1),
            num_microbatches=get_int(data, "num_microbatches", source=source, minimum=1),
            num_chunks=get_int(data, "num_chunks", source=source, minimum=1, default=1),
            num_jobs=get_int(data, "num_jobs", source=source, minimum=1, default=1),
            weights=get_str(
                data, "weights", source=source, choices=get_args(WeightMode), default="sync"
            ),  # type: ignore[arg-type]
            update_every=get_int(data, "update_every", source=source, minimum=0, default=0),
            recompute=get_bool(data, "recompute", source=source, default=False),
            meta=meta,
            stages=stages,
        )
        if len(stages) != schedule.num_stages:
            raise PlanError(
                f"{source}: stages must hold num_stages={schedule.num_stages} lists (got {len(stages)})"
            )
        if validate:
            from adaptipe.schedule.validate import validate as _validate

            _validate(schedule)
        return schedule
