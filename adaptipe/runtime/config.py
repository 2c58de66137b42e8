"""Run configs: ``adaptipe train CONFIG.toml`` reads one TOML file into frozen dataclasses.

Everything is checked at load time, before any process starts, and errors name the
file, the section and field, the value and what is allowed. Parsing (`parse_config`,
`RunConfig.parse`) never asks the host; `adaptipe.runtime.host.fit_to_host` checks a
config against a host and fills in what depends on it (`load_config` does both). A
complete example::

    [model]
    name = "gpt"                # mlp | gpt | cnn
    [model.config]              # architecture overrides passed to get_model
    n_layer = 4

    [data]
    batch_size = 32             # samples per iteration
    microbatches = 4            # must divide batch_size
    split = "train"             # train | val
    seed = 0                    # data-order seed; defaults to [train].seed

    [optimizer]
    name = "adam"               # sgd | adam | adamw
    lr = 3e-4
    betas = [0.9, 0.999]
    eps = 1e-8
    weight_decay = 0.0          # sgd also takes momentum and nesterov

    [pipeline]
    stages = 2
    schedule = "1f1b"           # gpipe | 1f1b | interleaved | pipedream | 2bw
    virtual = 1                 # chunks per worker (interleaved only)
    recompute = false
    batch_weight_grads = false  # weight gradients once per batch (synchronous schedules)
    partition = "even"          # a planner, a Partition JSON path, or bounds [0, 3, 6]
    replicas = [1, 1]           # workers per stage, e.g. [1, 2] (gpipe, 1f1b); default: the partition's
    bandwidth = "inf"           # for the planners, e.g. "1GB/s"

    [train]
    iterations = 200            # or epochs = N
    seed = 0
    device = "cpu"              # cpu | cuda (stage r on GPU r mod count) | cuda:N
    checkpoint_every = 50       # 0: only the final checkpoint
    keep_checkpoints = 3        # 0: keep every checkpoint
    log_every = 10
    backend = "auto"            # auto (nccl with a GPU per stage, else gloo) | gloo | nccl
    timeout_s = 60.0            # collective and p2p timeout
    telemetry = true            # stream stage stats and device samples to the manager
    telemetry_interval_s = 0.5  # device-status sample period, 0.1-0.5 s
    link_telemetry = false      # also time every send per link (a watcher thread per peer)
    link_probe_every = 10       # with link_telemetry: probe a remembered throttle (0: never)
    threads_per_stage = 4       # defaults to cores // stages
    run_dir = "runs/gpt"        # defaults to runs/<config file stem>
    stage_memory_mb = 8000      # memory early warning per stage (MB), or a list per stage
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from adaptipe.errors import PlanError
from adaptipe.models import MODEL_NAMES, ModelSpec, get_model
from adaptipe.plan.api import PLANNERS
from adaptipe.runtime.adapt_config import AdaptSection, parse_adapt
from adaptipe.runtime.config_checks import check_cross
from adaptipe.runtime.config_sections import (
    DataSection,
    ModelSection,
    OptimizerSection,
    PipelineSection,
    TrainSection,
    replica_counts,
    stage_memory,
)
from adaptipe.runtime.host import fit_to_host, resolve_backend, this_host
from adaptipe.runtime.sweep import JobSpec, SweepSection, parse_sweep
from adaptipe.serial import get_bool, get_float, get_int, get_list, get_str, read_text
from adaptipe.units import parse_bandwidth

__all__ = [
    "DataSection",
    "ModelSection",
    "OptimizerSection",
    "PipelineSection",
    "RunConfig",
    "TrainSection",
    "load_config",
    "parse_config",
    "resolve_backend",
]

T = TypeVar("T")
_SECTIONS = ("model", "data", "optimizer", "pipeline", "train")
_OPTIONAL_SECTIONS = ("sweep", "adapt")
_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    model: ModelSection
    data: DataSection
    optimizer: OptimizerSection
    pipeline: PipelineSection
    train: TrainSection
    sweep: SweepSection | None = None
    adapt: AdaptSection = field(default_factory=AdaptSection)
    source: str = "config"

    def to_dict(self) -> dict[str, Any]:
        """Fully resolved and JSON-serialisable; `from_dict` reads it back to an equal config."""
        out: dict[str, Any] = {}
        for name in _SECTIONS:
            section = getattr(self, name)
            out[name] = {f.name: _plain(getattr(section, f.name)) for f in fields(section)}
        if self.sweep is not None:
            out["sweep"] = self.sweep.to_dict()
        if self.adapt != AdaptSection():
            out["adapt"] = self.adapt.to_dict()
        return out

    @property
    def jobs(self) -> tuple[JobSpec, ...]:
        """The job-array: the sweep's jobs, or one job made of the main sections."""
        if self.sweep is not None:
            return self.sweep.jobs
        return (
            JobSpec(
                index=0,
                name="job0",
                optimizer=self.optimizer,
                batch_size=self.data.batch_size,
                seed=self.train.seed,
                data_seed=self.data.seed,
            ),
        )

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, source: str = "config", strict: bool = True
    ) -> RunConfig:
        """`parse`, then fitted to this host (`fit_to_host`): how a worker reads its run
        directory's config (`RunDir.read_config`), checked against its own host."""
        return fit_to_host(cls.parse(data, source=source, strict=strict), this_host())

    @classmethod
    def parse(
        cls, data: Mapping[str, Any], *, source: str = "config", strict: bool = True
    ) -> RunConfig:
        """Read `to_dict`'s output (or a TOML file's tables) without asking the host;
        relative paths are taken from the folder of `source`. ``strict=False`` reads a
        run directory's saved config: checks added after it may have been written are
        skipped (`parse_sweep`)."""
        return _parse(
            data, source=source, base=Path(source).parent, stem=Path(source).stem, strict=strict
        )

    def iterations_total(self, num_samples: int) -> int:
        """Iterations to run; an epoch is ``num_samples // batch_size`` (drop_last)."""
        if self.train.iterations is not None:
            return self.train.iterations
        per_epoch = num_samples // self.data.batch_size
        if per_epoch == 0:
            raise PlanError(
                f"{self.source}: [data].batch_size must be <= the dataset's {num_samples} "
                f"samples to train by epochs (got {self.data.batch_size})"
            )
        return per_epoch * (self.train.epochs or 0)


def load_config(path: str | os.PathLike[str]) -> RunConfig:
    """Read and check a run config for this host: `parse_config`, then `fit_to_host`."""
    return fit_to_host(parse_config(path), this_host())


def parse_config(path: str | os.PathLike[str]) -> RunConfig:
    """Read and check a run config without asking the host (a GPU config on a laptop);
    a relative partition path is taken from its folder. What depends on the host is left
    for `fit_to_host`: ``threads_per_stage`` unset (None), ``backend`` maybe ``"auto"``."""
    p = Path(path)
    text = read_text(p)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.match(r"^(.*) \(at line (\d+), column (\d+)\)$", str(exc))
        where = f"line {m.group(2)}, column {m.group(3)}: {m.group(1)}" if m else str(exc)
        raise PlanError(f"{p}: not valid TOML ({where})") from None
    return _parse(data, source=str(p), base=p.resolve().parent, stem=p.stem)


# ---- parsing --------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    return list(value) if isinstance(value, tuple) else value


def _fail(source: str, where: str, message: str) -> PlanError:
    return PlanError(f"{source}: {where} {message}")


def _table(data: Mapping[str, Any], name: str, cls: type, source: str) -> Mapping[str, Any]:
    """Section `name` of `data`, with every key a field of `cls`."""
    if name not in data:
        raise _fail(source, f"[{name}]", "is missing")
    table = data[name]
    if not isinstance(table, Mapping):
        raise _fail(source, f"[{name}]", f"must be a table (got {type(table).__name__})")
    allowed = [f.name for f in fields(cls)]
    for key in table:
        if key not in allowed:
            raise _fail(
                source, f"[{name}].{key}", f"is not a field (allowed: {', '.join(allowed)})"
            )
    return table


def _read(cls: type[T], raw: Mapping[str, Any], source: str, name: str, **given: Any) -> T:
    """Build section `cls` from table `raw`, checking each field as its `_field` says."""
    values = dict(given)
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in values or f.metadata.get("custom"):
            continue
        kw: dict[str, Any] = {"source": source, "prefix": f"[{name}]."}
        if f.default is not MISSING:
            kw["default"] = f.default
        minimum, choices = f.metadata.get("minimum"), f.metadata.get("choices")
        if f.type == "int | None" and raw.get(f.name) is None:
            values[f.name] = None
        elif f.type in ("int", "int | None"):
            values[f.name] = get_int(raw, f.name, minimum=minimum, **kw)
        elif f.type == "float":
            values[f.name] = get_float(raw, f.name, minimum=minimum, **kw)
            if f.metadata.get("positive") and values[f.name] <= 0:
                raise _fail(source, f"[{name}].{f.name}", f"must be > 0 (got {values[f.name]})")
        elif f.type == "str" or choices is not None:
            values[f.name] = get_str(raw, f.name, choices=choices, **kw)
        elif f.type == "bool":
            values[f.name] = get_bool(raw, f.name, **kw)
        else:
            raise AssertionError(f"{cls.__name__}.{f.name}: no reader for {f.type}")
    return cls(**values)


def _parse(
    data: Mapping[str, Any], *, source: str, base: Path, stem: str, strict: bool = True
) -> RunConfig:
    if not isinstance(data, Mapping):
        raise PlanError(f"{source}: must be a table of sections (got {type(data).__name__})")
    for name in data:
        if name not in _SECTIONS + _OPTIONAL_SECTIONS:
            allowed = ", ".join(_SECTIONS + _OPTIONAL_SECTIONS)
            raise PlanError(f"{source}: unknown section [{name}] (allowed: {allowed})")
    model, spec = _model(_table(data, "model", ModelSection, source), source, base)
    raw = _table(data, "pipeline", PipelineSection, source)
    replicas = replica_counts(raw.get("replicas"), f"{source}: [pipeline].replicas")
    partition = _partition(raw, source, base)
    pipeline = _read(
        PipelineSection, raw, source, "pipeline", partition=partition, replicas=replicas
    )
    try:
        parse_bandwidth(pipeline.bandwidth, what="[pipeline].bandwidth")
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from None
    train = _train(_table(data, "train", TrainSection, source), source, stem, pipeline.stages)
    raw = _table(data, "data", DataSection, source)
    # The data order follows the run's seed unless [data].seed says otherwise.
    seed = {} if "seed" in raw else {"seed": train.seed}
    data_section = _read(DataSection, raw, source, "data", **seed)
    read_optimizer = functools.partial(_optimizer, strict=strict, iterations=train.iterations)
    optimizer = read_optimizer(_table(data, "optimizer", OptimizerSection, source), source)
    sweep = None
    if "sweep" in data:
        sweep = parse_sweep(
            data["sweep"],
            source=source,
            optimizer=optimizer,
            batch_size=data_section.batch_size,
            seed=train.seed,
            parse_optimizer=read_optimizer,
            data_seed=data_section.seed if "seed" in raw else None,
            iterations=train.iterations,
            strict=strict,
        )
    adapt = (
        parse_adapt(
            data["adapt"],
            source=source,
            num_layers=spec.num_layers,
            stages=pipeline.stages * pipeline.virtual,
            iterations=train.iterations,
        )
        if "adapt" in data
        else AdaptSection()
    )
    moving = "[[adapt.repartition]]" if adapt.repartition else None
    if adapt.controller != "none":
        moving = f"[adapt].controller = {adapt.controller!r}"
        if not train.telemetry:  # what it decides from; turned off on purpose: say so
            raise PlanError(
                f"{source}: {moving} decides from telemetry, and [train].telemetry = false "
                "turns it off; set [train].telemetry = true or [adapt].controller = 'none'"
            )
    if moving is not None and pipeline.schedule in ("pipedream", "2bw"):
        raise PlanError(
            f"{source}: {moving} needs a synchronous schedule (gpipe, 1f1b, "
            f"interleaved); [pipeline].schedule = {pipeline.schedule!r} keeps weight "
            "versions in flight that a partition change would break"
        )
    config = RunConfig(
        model=model,
        data=data_section,
        optimizer=optimizer,
        pipeline=pipeline,
        train=train,
        sweep=sweep,
        adapt=adapt,
        source=source,
    )
    check_cross(config, spec)
    return config


def _model(raw: Mapping[str, Any], source: str, base: Path) -> tuple[ModelSection, ModelSpec]:
    overrides = raw.get("config", {})
    if not isinstance(overrides, Mapping):
        raise _fail(source, "[model.config]", f"must be a table (got {overrides!r})")
    if raw.get("factory") is not None:
        return _user_model(raw, source, base, overrides)
    name = get_str(raw, "name", source=source, prefix="[model].", choices=MODEL_NAMES)
    try:
        spec = get_model(name, **overrides)
    except PlanError as exc:
        # get_model says "model 'gpt': [unknown ]config field 'x' ..."; name the file's field.
        m = re.search(r"(unknown )?config field '([^']*)' (.*)$", str(exc))
        if m is None:
            raise PlanError(f"{source}: [model.config]: {exc}") from None
        message = f"is not a field {m.group(3)}" if m.group(1) else m.group(3)
        raise _fail(source, f"[model.config].{m.group(2)}", message) from None
    return ModelSection(name=name, config=dict(spec.config)), spec


def _user_model(
    raw: Mapping[str, Any], source: str, base: Path, options: Mapping[str, Any]
) -> tuple[ModelSection, ModelSpec]:
    """``[model] factory``: a user's model (`adaptipe.models.user`), its file made
    absolute so that every worker imports the same one."""
    from adaptipe.models.user import resolve_factory, user_model

    ref = get_str(raw, "factory", source=source, prefix="[model].")
    try:
        resolved = resolve_factory(ref, base=base)
        spec = user_model(resolved, **options)
    except PlanError as exc:
        message = str(exc)
        if "[model].factory" not in message:  # the model's own words: say where from
            message = f"[model].factory {ref!r}: {message}"
        raise PlanError(f"{source}: {message}") from None
    except TypeError as exc:  # the factory refused [model.config]'s keywords
        raise _fail(source, "[model.config]", f"does not fit the factory {ref!r}: {exc}") from None
    name = raw.get("name", spec.name)
    if not isinstance(name, str) or not name:
        raise _fail(source, "[model].name", f"must be a non-empty string (got {name!r})")
    return ModelSection(name=name, config=dict(options), factory=resolved), spec


def _optimizer(
    raw: Mapping[str, Any], source: str, *, strict: bool = True, iterations: int | None = None
) -> OptimizerSection:
    betas = get_list(raw, "betas", source=source, prefix="[optimizer].", default=[0.9, 0.999])
    if len(betas) != 2 or not all(
        isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
    ):
        raise _fail(source, "[optimizer].betas", f"must be two numbers in [0, 1) (got {betas!r})")
    opt = _read(
        OptimizerSection, raw, source, "optimizer", betas=(float(betas[0]), float(betas[1]))
    )
    if opt.name != "sgd" and (opt.momentum != 0.0 or opt.nesterov):
        what = "momentum" if opt.momentum != 0.0 else "nesterov"
        raise _fail(
            source,
            f"[optimizer].{what}",
            f"is only for sgd (got {getattr(opt, what)!r} with name = {opt.name!r})",
        )
    if strict and opt.momentum >= 1:  # older versions took it: their run directories load
        raise _fail(source, "[optimizer].momentum", f"must be in [0, 1) (got {opt.momentum})")
    if opt.nesterov and opt.momentum == 0.0:
        raise _fail(source, "[optimizer].nesterov", "needs momentum > 0 (got momentum = 0.0)")
    return _schedule_checked(opt, source, iterations)


def _schedule_checked(
    opt: OptimizerSection, source: str, iterations: int | None
) -> OptimizerSection:
    """A cosine decay without ``decay_iterations`` lasts the run; the schedule's own
    checks (`LrSchedule`) name the file."""
    if opt.schedule == "cosine" and opt.decay_iterations == 0:
        if iterations is None:
            raise _fail(
                source, "[optimizer].decay_iterations",
                "must be set for a cosine schedule when [train] counts epochs",
            )  # fmt: skip
        opt = replace(opt, decay_iterations=iterations)
    try:
        opt.lr_schedule()
    except PlanError as exc:
        raise _fail(source, "[optimizer]", str(exc)) from None
    return opt


def _partition(raw: Mapping[str, Any], source: str, base: Path) -> str | tuple[int, ...]:
    value = raw.get("partition", "even")
    if isinstance(value, list) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in value
    ):
        return tuple(value)
    if isinstance(value, str) and value in PLANNERS:
        return value
    if isinstance(value, str) and value:
        return str((base / value).resolve())
    raise _fail(
        source,
        "[pipeline].partition",
        f"must be a planner ({', '.join(PLANNERS)}), a Partition JSON path "
        f"or a list of layer bounds (got {value!r})",
    )


def _train(raw: Mapping[str, Any], source: str, stem: str, stages: int) -> TrainSection:
    length = [key for key in ("iterations", "epochs") if raw.get(key) is not None]
    if len(length) != 1:
        got = "both" if length else "neither"
        raise _fail(source, "[train]", f"needs exactly one of iterations or epochs (got {got})")
    # threads_per_stage stays unset (None) and backend "auto": the host decides them.
    given: dict[str, Any] = {"backend": "auto", "run_dir": f"runs/{stem}"}
    given = {k: v for k, v in given.items() if raw.get(k) is None}
    memory = stage_memory(raw.get("stage_memory_mb"), f"{source}: [train].stage_memory_mb", stages)
    train = _read(TrainSection, raw, source, "train", stage_memory_mb=memory, **given)
    device, backend = train.device, train.backend
    if not 0.1 <= train.telemetry_interval_s <= 0.5:
        raise _fail(
            source,
            "[train].telemetry_interval_s",
            f"must be between 0.1 and 0.5 seconds (got {train.telemetry_interval_s})",
        )
    if not _DEVICE.match(device):
        raise _fail(source, "[train].device", f"must be cpu, cuda or cuda:N (got {device!r})")
    if backend == "nccl" and device == "cpu":
        raise _fail(source, "[train].backend", "'nccl' needs a cuda device (got device 'cpu')")
    return train
