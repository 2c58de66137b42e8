"""A job-array's plan inputs kept for re-planning: per-layer costs and solver settings.

The JAPSP instance of a job-array depends on the partition: a job's block on a stage
costs what that stage's layers cost at the job's batch size. A run keeps every job's
*per-layer* costs (`ArrayCosts`, measured once before the workers start) and the solver
settings (`SolveSettings`), so a new partition (a live re-partition) gets its own
instance and block order without profiling again, and without torch: the request
``adaptipe repartition`` sends is planned where it is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.japsp.instance import JapspInstance
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.schedule.types import Schedule
from adaptipe.serial import check_kind, get_float, get_int, get_str

__all__ = ["ArrayCosts", "SolveSettings", "solve_array"]

COSTS_KIND = "japsp_array_costs"
COSTS_VERSION = 1

Rows = tuple[tuple[float, ...], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SolveSettings:
    """How a job-array's block order is solved and unrolled (from ``[sweep]``)."""

    solver: str = "auto"
    time_limit_s: float = 1.0
    seed: int = 0
    window: int | str = "auto"  # iterations per window, or "auto" (`rounds`)
    memory_budget: int = 0

    def rounds(self, jobs: int, stages: int) -> int:
        """Iterations per window for ``jobs`` running jobs over ``stages`` stages."""
        if isinstance(self.window, int):
            return self.window
        from adaptipe.japsp.window import auto_window

        return auto_window(jobs, stages)

    def to_json(self) -> dict[str, Any]:
        return {
            "solver": self.solver,
            "time_limit_s": self.time_limit_s,
            "seed": self.seed,
            "window": self.window,
            "memory_budget": self.memory_budget,
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str) -> SolveSettings:
        if not isinstance(data, dict):
            raise PlanError(f"{source}: solve settings must be an object")
        window = data.get("window", "auto")
        if window != "auto" and not (isinstance(window, int) and window >= 1):
            raise PlanError(f"{source}: window must be 'auto' or an integer >= 1 (got {window!r})")
        return cls(
            solver=get_str(data, "solver", default="auto", source=source),
            time_limit_s=get_float(data, "time_limit_s", default=1.0, source=source),
            seed=get_int(data, "seed", default=0, source=source),
            window=window,
            memory_budget=get_int(data, "memory_budget", default=0, source=source),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ArrayCosts:
    """Every job's per-layer costs at its batch size (seconds; rows: jobs, columns:
    the model's layers), with the solver settings; `instance` sums them per stage."""

    names: tuple[str, ...]
    forward: Rows
    backward: Rows
    update: Rows
    recompute: bool = False  # a block's forward runs again right before its backward
    settings: SolveSettings = SolveSettings()

    def __post_init__(self) -> None:
        jobs = len(self.names)
        tables = {"forward": self.forward, "backward": self.backward, "update": self.update}
        layers = {len(row) for table in tables.values() for row in table}
        if any(len(t) != jobs for t in tables.values()) or len(layers) > 1:
            raise PlanError(f"array costs: every table needs {jobs} rows of equal length")

    @property
    def num_layers(self) -> int:
        return len(self.forward[0]) if self.forward else 0

    @classmethod
    def from_profiles(
        cls,
        profiles: Sequence[Profile],
        *,
        names: Sequence[str],
        recompute: bool = False,
        settings: SolveSettings = SolveSettings(),
    ) -> ArrayCosts:
        """The costs of jobs whose layers were measured in ``profiles`` (one per job)."""

        def rows(attr: str) -> Rows:
            return tuple(tuple(float(getattr(layer, attr)) for layer in p.layers) for p in profiles)

        return cls(
            names=tuple(names),
            forward=rows("forward_s"),
            backward=rows("backward_s"),
            update=rows("update_s"),
            recompute=recompute,
            settings=settings,
        )

    def instance(self, partition: Partition, jobs: Sequence[int] | None = None) -> JapspInstance:
        """The JAPSP instance of ``jobs`` (default: all, in order) under ``partition``:
        each block costs the sum of its stage's layers, summed in layer order."""
        if partition.num_layers != self.num_layers:
            raise PlanError(
                f"array costs: the partition covers {partition.num_layers} layers, the costs "
                f"{self.num_layers}"
            )
        chosen = list(range(len(self.names))) if jobs is None else list(jobs)
        stages = [list(partition.layers(s)) for s in range(partition.num_stages)]

        def table(rows: Rows) -> list[list[float]]:
            return [[sum(rows[j][i] for i in st) for st in stages] for j in chosen]

        forward = table(self.forward)
        return JapspInstance.build(
            forward,
            table(self.backward),
            names=[self.names[j] for j in chosen],
            update=table(self.update),
            recompute=[list(row) for row in forward] if self.recompute else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": COSTS_KIND,
            "version": COSTS_VERSION,
            "names": list(self.names),
            "forward": [list(r) for r in self.forward],
            "backward": [list(r) for r in self.backward],
            "update": [list(r) for r in self.update],
            "recompute": self.recompute,
            "settings": self.settings.to_json(),
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "array costs") -> ArrayCosts:
        if not isinstance(data, dict):
            raise PlanError(f"{source}: not an array-costs file")
        check_kind(data, kind=COSTS_KIND, version=COSTS_VERSION, source=source)
        try:
            names = tuple(str(n) for n in data["names"])

            def rows(key: str) -> Rows:
                return tuple(tuple(float(v) for v in row) for row in data[key])

            return cls(
                names=names,
                forward=rows("forward"),
                backward=rows("backward"),
                update=rows("update"),
                recompute=bool(data.get("recompute", False)),
                settings=SolveSettings.from_json(
                    data.get("settings", {}), source=f"{source}: settings"
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{source}: malformed array costs ({exc})") from None


def solve_array(
    instance: JapspInstance, settings: SolveSettings
) -> tuple[Schedule, dict[str, Any]]:
    """Solve one round of ``instance``; (the one-round schedule, the solution record).

    Workers unroll the schedule into windows (`adaptipe.japsp.window.best_window` picks
    the round order per window length); the record and the schedule's meta hold what it
    picks for full windows.
    """
    from adaptipe.japsp.compile import to_schedule
    from adaptipe.japsp.evaluate import evaluate
    from adaptipe.japsp.solve import solve
    from adaptipe.japsp.window import JITTER, best_window, expected_makespan

    result = solve(
        instance,
        solver=settings.solver,
        time_limit_s=settings.time_limit_s,
        seed=settings.seed,
    )
    solution = result.to_json()
    schedule = to_schedule(instance, result.orders)
    meta: dict[str, Any] = {"makespan": result.makespan, "solver": result.solver}
    rounds = settings.rounds(instance.num_jobs, instance.num_stages)
    budget = settings.memory_budget
    orders, window = best_window(instance, result.orders, rounds, budget=budget)
    if rounds > 1 or orders != result.orders:
        meta.update(window=rounds, window_makespan=window.makespan, round_order=window.order)
        solution["window"] = {
            "rounds": rounds,
            "makespan": window.makespan,
            "per_iteration": window.makespan / rounds,
            "jittered_makespan": expected_makespan(instance, window, jitter=JITTER),
            "rule": window.rule,
            "round_order": window.order,
            "round_orders": [[f"{k}{j}" for k, j in stage] for stage in orders],
            "round_makespan": evaluate(instance, orders).makespan,
        }
    return replace(schedule, meta={**schedule.meta, **meta}), solution
