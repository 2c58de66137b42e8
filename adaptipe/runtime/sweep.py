"""The ``[sweep]`` section: sibling jobs of one model, trained as one job-array.

```toml
[sweep]
solver = "auto"          # JAPSP solver for the block order: auto, bb, ga, gpipe, 1f1b, rr
                         # (or cpsat, with OR-Tools: pip install 'adaptipe[cpsat]')
memory_budget = 0        # job states resident per stage (0 = all of them)
window = "auto"          # iterations scheduled as one (their blocks overlap; 1 = off)
halving_every = 0        # successive halving every N iterations (0 = off; < [train].iterations)
halving_keep = 0.5       # fraction of jobs kept at each halving

[sweep.grid]             # the cartesian product of these lists ...
lr = [1e-3, 3e-3]
batch_size = [16, 32]

[[sweep.jobs]]           # ... or explicit jobs (not both)
name = "wide-lr"
lr = 1e-2
optimizer = "adam"
```

A grid's jobs are named by the axes that vary (``lr=0.001,batch_size=32`` with the grid
above); ``adaptipe stop`` takes a name or a job's index.

Fields a job may set: name, lr, batch_size, weight_decay, momentum, optimizer, seed,
data_seed, the learning-rate schedule's (schedule, warmup, decay_iterations,
min_lr_ratio, step_every, gamma) and, in ``[[sweep.jobs]]``, nesterov, betas, eps; the rest comes from
``[optimizer]``, ``[data]`` and ``[train].seed``. A job sets only the fields its own
optimizer uses (`OPTIMIZER_FIELDS`: momentum and nesterov are sgd's, betas and eps
adam's and adamw's); another optimizer's field is an error unless it holds the value the
job has anyway. A job trains as its config would alone with ``[train].seed`` set to the
job's seed: ``seed`` initialises the weights, and the data order follows ``data_seed``,
which defaults to ``[data].seed`` where the config sets one and to the job's seed
otherwise. Each job's mini-batch is one block of the pipeline (ArrayPipe), so
``[data].microbatches`` must be 1 with a sweep.

``window``: one JAPSP iteration fills and drains the pipeline. A window of W
iterations is scheduled as one (`adaptipe.japsp.window`): a job's next forward may
start on a stage as soon as its own previous backward and update there are done, so
the fill and drain are paid once per window instead of once per iteration, and every
job still trains exactly as alone. Each window boundary costs about one block on S - 1
of the S stages, a share (S - 1) / (W x J) of a window of J jobs; ``"auto"`` (the
default, `adaptipe.japsp.window.auto_window`) takes the fewest iterations that keep it at 2% or less, at most
32, from the jobs still running. Checkpoints, halving rungs and the traced iterations
end a window early; a stop request (any newly committed plan version) cuts the window
that runs at the next iteration (`adaptipe.runtime.windowcut`); injected interference
takes effect at the next window boundary (at most W iterations later). Metrics and telemetry keep one
record per iteration; a window's iterations share its time evenly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.runtime.jobs import JobSpec
from adaptipe.serial import get_float, get_int, get_list, get_str

# The JAPSP solvers (adaptipe.japsp.window, .cpsat) are imported where a window is sized
# or cpsat is checked, not with this module: what imports `JobSpec` through here (the
# stage executor did) should not load them.

__all__ = [
    "JOB_FIELDS",
    "OPTIMIZER_FIELDS",
    "SOLVER_NAMES",
    "JobSpec",
    "SweepSection",
    "parse_sweep",
]

JOB_FIELDS = (
    "name",
    "lr",
    "batch_size",
    "weight_decay",
    "momentum",
    "optimizer",
    "seed",
    "data_seed",
    "schedule",
    "warmup",
    "decay_iterations",
    "min_lr_ratio",
    "step_every",
    "gamma",
    "clip_grad_norm",
)
_SCHEDULE = ("schedule", "warmup", "decay_iterations", "min_lr_ratio", "step_every", "gamma")
_JOB_ONLY_FIELDS = (
    "nesterov",
    "betas",
    "eps",
)  # [[sweep.jobs]] only, not grid axes
# The optimizers and the fields each reads besides lr and weight_decay
# (`OptimizerSection.build`); [optimizer].name takes these names.
OPTIMIZER_FIELDS: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum", "nesterov"),
    "adam": ("betas", "eps"),
    "adamw": ("betas", "eps"),
}
SOLVER_NAMES = ("auto", "bb", "ga", "gpipe", "1f1b", "rr", "cpsat")
_SWEEP_FIELDS = (
    "grid",
    "jobs",
    "solver",
    "memory_budget",
    "window",
    "halving_every",
    "halving_keep",
    "time_limit_s",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepSection:
    jobs: tuple[JobSpec, ...]
    solver: str = "auto"
    memory_budget: int = 0
    window: int | str = "auto"  # iterations per window, or "auto" (`rounds`)
    halving_every: int = 0
    halving_keep: float = 0.5
    time_limit_s: float = 1.0

    def rounds(self, jobs: int, stages: int) -> int:
        """Iterations per window for ``jobs`` running jobs over ``stages`` stages."""
        if isinstance(self.window, int):
            return self.window
        from adaptipe.japsp.window import auto_window

        return auto_window(jobs, stages)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "jobs"}
        out["jobs"] = [job.to_dict() for job in self.jobs]
        return out


ParseOptimizer = Callable[[Mapping[str, Any], str], Any]


def parse_sweep(
    raw: Mapping[str, Any],
    *,
    source: str,
    optimizer: Any,
    batch_size: int,
    seed: int,
    parse_optimizer: ParseOptimizer,
    data_seed: int | None = None,
    iterations: int | None = None,
    strict: bool = True,
) -> SweepSection:
    """Expand ``[sweep]`` into jobs; every error names the field and what is allowed.

    ``seed`` is ``[train].seed``; ``data_seed`` is ``[data].seed`` where the config sets
    it (None otherwise: each job's data order then follows its own seed). ``iterations``
    is ``[train].iterations`` (None when the run is counted in epochs). ``strict=False``
    (a run directory's saved config) skips the checks that older versions did not make
    (fields the job's optimizer ignores, halving rungs past the end, OR-Tools installed),
    so run directories they wrote keep loading.
    """
    if not isinstance(raw, Mapping):
        raise PlanError(f"{source}: [sweep] must be a table")
    for key in raw:
        if key not in _SWEEP_FIELDS:
            raise PlanError(
                f"{source}: [sweep].{key} is not a field (allowed: {', '.join(_SWEEP_FIELDS)})"
            )
    if ("grid" in raw) == ("jobs" in raw):
        raise PlanError(f"{source}: [sweep] needs exactly one of [sweep.grid] or [[sweep.jobs]]")
    entries = _grid(raw["grid"], source) if "grid" in raw else _jobs(raw, source)
    base = {f.name: getattr(optimizer, f.name) for f in fields(optimizer)}
    jobs: list[JobSpec] = []
    for index, (entry, where) in enumerate(entries):
        jobs.append(
            _job(
                index,
                entry,
                where,
                source,
                base,
                batch_size,
                seed,
                data_seed,
                parse_optimizer,
                strict=strict,
            )
        )
    names = [job.name for job in jobs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        what = "a [sweep.grid] list repeats a value" if "grid" in raw else "job names repeat"
        raise PlanError(
            f"{source}: [sweep] jobs must differ: {what} (repeated: {', '.join(dupes)})"
        )
    kw: dict[str, Any] = {"source": source, "prefix": "[sweep]."}
    keep = get_float(raw, "halving_keep", default=0.5, **kw)
    if not 0 < keep < 1:
        raise PlanError(f"{source}: [sweep].halving_keep must be in (0, 1) (got {keep})")
    limit = get_float(raw, "time_limit_s", default=1.0, **kw)
    if limit <= 0:
        raise PlanError(f"{source}: [sweep].time_limit_s must be > 0 (got {limit})")
    every = get_int(raw, "halving_every", minimum=0, default=0, **kw)
    if strict and every and iterations is not None and every >= iterations:
        # A rung is the boundary before iteration k * every, inside the run (`is_rung`).
        raise PlanError(
            f"{source}: [sweep].halving_every must be 0 (off) or less than [train].iterations "
            f"= {iterations}, or no halving rung is ever reached (got {every})"
        )
    solver = get_str(raw, "solver", choices=SOLVER_NAMES, default="auto", **kw)
    if strict and solver == "cpsat" and not cpsat_available():
        from adaptipe.japsp.cpsat import missing_ortools

        others = ", ".join(s for s in SOLVER_NAMES if s != "cpsat")
        raise missing_ortools(f"{source}:", f"; or use another solver: {others}")
    return SweepSection(
        jobs=tuple(jobs),
        solver=solver,
        memory_budget=get_int(raw, "memory_budget", minimum=0, default=0, **kw),
        window=_window(raw, source),
        halving_every=every,
        halving_keep=keep,
        time_limit_s=limit,
    )


def cpsat_available() -> bool:
    """Whether OR-Tools is importable (`adaptipe.japsp.cpsat.available`)."""
    from adaptipe.japsp.cpsat import available

    return available()


def _window(raw: Mapping[str, Any], source: str) -> int | str:
    value = raw.get("window", "auto")
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(
            f'{source}: [sweep].window must be "auto" or an integer >= 1 (got {value!r})'
        )
    return value


def _grid(grid: Any, source: str) -> list[tuple[dict[str, Any], str]]:
    if not isinstance(grid, Mapping):
        raise PlanError(f"{source}: [sweep.grid] must be a table of lists (e.g. lr = [1e-3, 3e-3])")
    if not grid:
        raise PlanError(f"{source}: [sweep.grid] is empty (give lists, e.g. lr = [1e-3, 3e-3])")
    axes: list[tuple[str, list[Any]]] = []
    for key, values in grid.items():
        if key not in JOB_FIELDS or key == "name":
            allowed = ", ".join(f for f in JOB_FIELDS if f != "name")
            raise PlanError(f"{source}: [sweep.grid].{key} is not a field (allowed: {allowed})")
        if not isinstance(values, list) or not values:
            raise PlanError(
                f"{source}: [sweep.grid].{key} must be a non-empty list (got {values!r})"
            )
        axes.append((key, values))
    # A job is named by the axes that vary (all of them when none does): a value every
    # job shares says nothing about which job it is.
    varying = {key for key, values in axes if len(values) > 1} or {key for key, _ in axes}
    out: list[tuple[dict[str, Any], str]] = []
    for combo in itertools.product(*(values for _, values in axes)):
        entry = dict(zip((key for key, _ in axes), combo, strict=True))
        where = ",".join(f"{k}={v}" for k, v in entry.items())
        entry["name"] = ",".join(f"{k}={v}" for k, v in entry.items() if k in varying)
        out.append((entry, f"[sweep.grid] ({where})"))
    return out


def _jobs(raw: Mapping[str, Any], source: str) -> list[tuple[dict[str, Any], str]]:
    jobs = get_list(raw, "jobs", source=source, prefix="[sweep].")
    if not jobs:
        raise PlanError(f"{source}: [[sweep.jobs]] must list at least one job")
    out: list[tuple[dict[str, Any], str]] = []
    for i, job in enumerate(jobs):
        if not isinstance(job, Mapping):
            raise PlanError(f"{source}: [[sweep.jobs]][{i}] must be a table")
        extra = sorted(set(job) - set(JOB_FIELDS) - set(_JOB_ONLY_FIELDS))
        if extra:
            allowed = ", ".join((*JOB_FIELDS, *_JOB_ONLY_FIELDS))
            raise PlanError(
                f"{source}: [[sweep.jobs]][{i}].{extra[0]} is not a field (allowed: {allowed})"
            )
        entry = dict(job)
        entry.setdefault("name", f"job{i}")
        out.append((entry, f"[[sweep.jobs]][{i}]"))
    return out


def _job(
    index: int,
    entry: Mapping[str, Any],
    where: str,
    source: str,
    base: dict[str, Any],
    batch_size: int,
    seed: int,
    data_seed: int | None,
    parse_optimizer: ParseOptimizer,
    *,
    strict: bool,
) -> JobSpec:
    opt = dict(base)
    opt["betas"] = list(opt["betas"])
    if "optimizer" in entry and entry["optimizer"] != base["name"]:
        opt["name"] = entry["optimizer"]
        if opt["name"] != "sgd":  # momentum belongs to sgd; a job switching away drops it
            opt["momentum"], opt["nesterov"] = 0.0, False
    if strict:
        _check_used(entry, where, source, opt)
    for key in ("lr", "weight_decay", "momentum", "nesterov", "betas", "eps", "clip_grad_norm",
                *_SCHEDULE):  # fmt: skip
        if key in entry:
            opt[key] = entry[key]
    try:
        optimizer = parse_optimizer(opt, source)
    except PlanError as exc:
        raise PlanError(
            str(exc).replace("[optimizer].", f"{where}.").replace("[optimizer]", where)
        ) from None
    kw: dict[str, Any] = {"source": source, "prefix": f"{where}."}
    name = get_str(entry, "name", **kw)
    job_seed = get_int(entry, "seed", minimum=0, default=seed, **kw)
    return JobSpec(
        index=index,
        name=name,
        optimizer=optimizer,
        batch_size=get_int(entry, "batch_size", minimum=1, default=batch_size, **kw),
        seed=job_seed,
        # As alone: [data].seed where the config sets one, else the job's own seed.
        data_seed=get_int(
            entry,
            "data_seed",
            minimum=0,
            default=job_seed if data_seed is None else data_seed,
            **kw,
        ),
    )


def _check_used(
    entry: Mapping[str, Any], where: str, source: str, inherited: dict[str, Any]
) -> None:
    """A job's optimizer field that its optimizer ignores is an error, unless it is the
    value the job gets anyway (`JobSpec.to_dict` writes every field, so a run's
    config.json lists betas and eps for sgd jobs too)."""
    name = inherited["name"]
    if not isinstance(name, str) or name not in OPTIMIZER_FIELDS:
        return  # parse_optimizer names the bad name
    for key in sorted(
        {f for fs in OPTIMIZER_FIELDS.values() for f in fs} - set(OPTIMIZER_FIELDS[name])
    ):
        if key in entry and entry[key] != inherited[key]:
            users = ", ".join(n for n, fs in OPTIMIZER_FIELDS.items() if key in fs)
            hint = (
                "; a grid crosses every optimizer with every value: list such jobs in "
                "[[sweep.jobs]] instead"
                if where.startswith("[sweep.grid]")
                else ""
            )
            raise PlanError(
                f"{source}: {where}.{key} is only for {users} "
                f"(got {entry[key]!r} with optimizer = {name!r}){hint}"
            )
