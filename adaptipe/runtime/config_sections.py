"""The sections of a run config (`RunConfig`): one frozen dataclass per TOML table.

Each field's metadata (`_rule`) says how `adaptipe.runtime.config` checks it when a file
is read; defaults that depend on the host (``threads_per_stage``, ``backend = "auto"``)
are filled in by `adaptipe.runtime.host.fit_to_host`, not here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from adaptipe.errors import PlanError
from adaptipe.models import ModelSpec, get_model
from adaptipe.models.spec import SPLITS, Split
from adaptipe.runtime.recipe import SCHEDULES, LrSchedule, attach_schedule
from adaptipe.runtime.sweep import OPTIMIZER_FIELDS
from adaptipe.schedule.build import SCHEDULE_NAMES, build_schedule
from adaptipe.schedule.types import Schedule
from adaptipe.units import parse_bandwidth

__all__ = [
    "DataSection",
    "ModelSection",
    "OptimizerSection",
    "PipelineSection",
    "TrainSection",
    "stage_memory",
]


def _rule(
    *, minimum: float | None = None, positive: bool = False, choices: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Field metadata: the checks `_read` applies (``positive``: strictly > 0)."""
    return {"minimum": minimum, "positive": positive, "choices": choices or None}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    """The zoo model, or a user's (``factory``, an absolute "file.py:function" or
    "package.module:function"); `config` holds its full architecture (defaults filled
    in) or the factory's keyword arguments."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    factory: str | None = None

    def spec(self) -> ModelSpec:
        if self.factory is not None:
            from adaptipe.models.user import user_model

            return user_model(self.factory, **self.config)
        return get_model(self.name, **self.config)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSection:
    batch_size: int = field(metadata=_rule(minimum=1))
    microbatches: int = field(metadata=_rule(minimum=1))
    split: Split = field(default="train", metadata=_rule(choices=SPLITS))
    seed: int = 0
    # A user's dataset (`[model] factory`) read through a DataLoader with this many
    # worker processes, in adaptipe's order (`adaptipe.models.mapdata.MapDataset`).
    loader_workers: int = field(default=0, metadata=_rule(minimum=0))

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSection:
    name: str = field(metadata=_rule(choices=tuple(OPTIMIZER_FIELDS)))
    lr: float = field(metadata=_rule(positive=True))
    momentum: float = field(default=0.0, metadata=_rule(minimum=0.0))
    weight_decay: float = field(default=0.0, metadata=_rule(minimum=0.0))
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = field(default=1e-8, metadata=_rule(positive=True))
    # The learning-rate schedule (`adaptipe.runtime.recipe.LrSchedule`), in optimizer
    # steps: one per iteration on synchronous schedules.
    schedule: str = field(default="constant", metadata=_rule(choices=SCHEDULES))
    warmup: int = field(default=0, metadata=_rule(minimum=0))
    decay_iterations: int = field(default=0, metadata=_rule(minimum=0))  # cosine; 0: the run's
    min_lr_ratio: float = field(default=0.0, metadata=_rule(minimum=0.0))
    step_every: int = field(default=0, metadata=_rule(minimum=0))
    gamma: float = field(default=0.1, metadata=_rule(positive=True))
    # Clip gradients by the whole model's norm (torch's clip_grad_norm_); 0: off.
    clip_grad_norm: float = field(default=0.0, metadata=_rule(minimum=0.0))

    def lr_schedule(self) -> LrSchedule | None:
        """The schedule, None for a constant rate without warm-up."""
        if self.schedule == "constant" and self.warmup == 0:
            return None
        return LrSchedule(
            kind=self.schedule,  # type: ignore[arg-type]  # checked against SCHEDULES
            warmup=self.warmup,
            total=self.decay_iterations,
            min_lr_ratio=self.min_lr_ratio,
            step_every=self.step_every,
            gamma=self.gamma,
        )

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer; ``foreach=False`` so that one optimizer over many parameters and
        one per parameter (a pipeline split any way) give bitwise identical updates. A
        schedule sets the rate before each step from the optimizer's own step count
        (`adaptipe.runtime.recipe.attach_schedule`), which travels with its state."""
        common: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.name == "sgd":
            extra: dict[str, Any] = {"momentum": self.momentum, "nesterov": self.nesterov}
            opt: torch.optim.Optimizer = torch.optim.SGD(params, foreach=False, **common, **extra)
        else:
            kind = torch.optim.Adam if self.name == "adam" else torch.optim.AdamW
            opt = kind(params, betas=self.betas, eps=self.eps, foreach=False, **common)
        schedule = self.lr_schedule()
        if schedule is not None:
            attach_schedule(opt, schedule, base_lr=self.lr)
        return opt

    @property
    def profile_kind(self) -> str:
        """The optimizer the profiler times the step of (`profile_model(optimizer=...)`)."""
        if self.name == "sgd":
            return "momentum" if self.momentum > 0 else "sgd"
        return self.name

    def state_bytes_factor(self) -> int:
        """Optimizer state per parameter byte: memory planning needs it before building."""
        if self.name == "sgd":
            return 1 if self.momentum > 0 else 0
        return 2


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSection:
    """`partition` is a planner name, an absolute Partition JSON path, or explicit bounds."""

    stages: int = field(metadata=_rule(minimum=1))
    schedule: str = field(default="1f1b", metadata=_rule(choices=SCHEDULE_NAMES))
    virtual: int = field(default=1, metadata=_rule(minimum=1))
    recompute: bool = False
    batch_weight_grads: bool = False
    partition: str | tuple[int, ...] = "even"
    # Data-parallel replicas per stage (PipeDream 1F1B-RR); empty: the partition's own.
    replicas: tuple[int, ...] = field(default=(), metadata={"custom": True})
    vertical_sync: bool = False
    update_every: int | None = field(default=None, metadata=_rule(minimum=1))
    bandwidth: str = "inf"

    @property
    def bandwidth_Bps(self) -> float:
        return parse_bandwidth(self.bandwidth)

    @property
    def processes(self) -> int:
        """Worker processes: one per stage, one more per extra replica."""
        return self.stages + sum(r - 1 for r in self.replicas)

    def schedule_for(self, microbatches: int) -> Schedule:
        """This pipeline's schedule for `microbatches` (one job's; a sweep's comes from
        its JAPSP plan). Built once per process: loading a config checks that it builds,
        and `resolve_plans` runs the same build."""
        return _schedule(
            self.schedule,
            stages=self.stages,
            microbatches=microbatches,
            chunks=self.virtual,
            recompute=self.recompute,
            vertical_sync=self.vertical_sync,
            update_every=self.update_every,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSection:
    """Exactly one of `iterations` and `epochs` is set; the rest is resolved at load,
    except what the host decides (`fit_to_host`): an unset `threads_per_stage` (None)
    and ``backend = "auto"``."""

    iterations: int | None = field(default=None, metadata=_rule(minimum=1))
    epochs: int | None = field(default=None, metadata=_rule(minimum=1))
    seed: int = 0
    device: str = "cpu"
    threads_per_stage: int | None = field(default=None, metadata=_rule(minimum=1))  # host's
    checkpoint_every: int = field(default=0, metadata=_rule(minimum=0))
    keep_checkpoints: int = field(default=0, metadata=_rule(minimum=0))
    log_every: int = field(default=1, metadata=_rule(minimum=1))
    backend: str = field(default="gloo", metadata=_rule(choices=("auto", "gloo", "nccl")))
    timeout_s: float = field(default=60.0, metadata=_rule(positive=True))
    telemetry: bool = True
    tensorboard: bool = True  # RUN_DIR/tensorboard/: one run per job and the pipeline
    # 0.5 s since session 15 (was 0.2): the samplers' cost and the manager's device
    # frames fall by 60%; decisions read each stage's newest sample, and the features
    # are rates over the period (docs/benchmarks.md, "overhead, session 15").
    telemetry_interval_s: float = field(default=0.5, metadata=_rule(positive=True))
    # Off by default: the per-peer watcher threads cost CPU that a small machine's stages
    # need (on 2 cores, stage compute rose ~10-25% and a pinned CPU hog no longer showed).
    link_telemetry: bool = False
    # With link_telemetry: every this many iterations, probe a link that a remembered
    # throttle bounds and light traffic cannot show recovered (`runtime.link_probe`); 0: never.
    link_probe_every: int = field(default=10, metadata=_rule(minimum=0))
    # Record a per-instruction timeline of iterations trace_start .. +trace_iterations-1
    # into RUN_DIR/trace/ (`adaptipe trace RUN_DIR` draws it); 0 records nothing.
    trace_iterations: int = field(default=0, metadata=_rule(minimum=0))
    trace_start: int = field(default=0, metadata=_rule(minimum=0))
    run_dir: str = "runs/run"
    # The memory early warning (`adaptipe.runtime.memory_guard`): each stage's memory
    # limit in MB (one for all, or one per stage); None: no guard.
    stage_memory_mb: int | tuple[int, ...] | None = field(default=None, metadata={"custom": True})

    def memory_limit_mb(self, stage: int) -> int | None:
        """Stage ``stage``'s memory limit in MB (None: the guard is off)."""
        limit = self.stage_memory_mb
        return limit[stage] if isinstance(limit, tuple) else limit


def replica_counts(value: Any, where: str) -> tuple[int, ...]:
    """``[pipeline].replicas`` read: a list of integers >= 1, one per stage (empty: unset);
    ``where`` names the file and field in the error (`check_replicas` checks the rest)."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
    ):
        raise PlanError(
            f"{where} must be a list of integers >= 1, one per stage, e.g. [1, 2] (got {value!r})"
        )
    return tuple(value)


def stage_memory(value: Any, where: str, stages: int) -> int | tuple[int, ...] | None:
    """``[train].stage_memory_mb`` checked: an integer > 0 (MB) for every stage, or a
    list of one per stage; ``where`` names the file and field in the error."""
    if value is None:
        return None
    many = isinstance(value, list | tuple)
    values = list(value) if many else [value]
    if (many and len(values) != stages) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values
    ):
        raise PlanError(
            f"{where} must be an integer > 0 (MB, every stage) or a list of {stages} such "
            f"integers, one per stage (got {value!r})"
        )
    return tuple(values) if many else int(value)


# A `Schedule` is frozen (its `meta` dict is read, never written), so one built object
# can serve every caller; the config check and `resolve_plans` both ask for it.
@functools.lru_cache(maxsize=16)
def _schedule(
    name: str,
    *,
    stages: int,
    microbatches: int,
    chunks: int,
    recompute: bool,
    vertical_sync: bool,
    update_every: int | None,
) -> Schedule:
    return build_schedule(
        name,
        stages=stages,
        microbatches=microbatches,
        chunks=chunks,
        recompute=recompute,
        vertical_sync=vertical_sync,
        update_every=update_every,
    )
