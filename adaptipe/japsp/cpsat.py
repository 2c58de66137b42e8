"""Optional exact model of JAPSP (Eq. 4-9) for OR-Tools CP-SAT (``pip install adaptipe[cpsat]``).

One interval per block (length: its stage occupancy, Eq. 9), chain precedences with
lags (Eq. 5-7), and per stage either a no-overlap constraint or, when the stage has
switch costs, a circuit over its blocks whose chosen arcs ``a -> b`` impose
``start(b) >= end(a) + w_a`` for blocks of different jobs (Eq. 8-9; exact, no
approximation), with the no-overlap kept as a redundant constraint. CP-SAT needs
integers: times are scaled by the smallest power of ten (up to 10^6) that makes them
integral, else rounded at the finest scale that keeps the horizon under 10^9; the
returned orders are re-timed exactly with
`adaptipe.japsp.evaluate.evaluate`, and the solver's bound is only reported (and
optimality only claimed) when the scaling was exact.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.japsp.bounds import lower_bound
from adaptipe.japsp.evaluate import OpTable, Orders, semi_active, to_seqs
from adaptipe.japsp.instance import JapspInstance
from adaptipe.japsp.solve import Result

__all__ = ["available", "missing_ortools", "solve_cpsat"]


def _cp_model() -> Any:
    try:
        return importlib.import_module("ortools.sat.python.cp_model")
    except ImportError:
        raise PlanError("install adaptipe[cpsat] (ortools) to use --solver cpsat") from None


def missing_ortools(prefix: str, also: str = "") -> PlanError:
    """The error for a ``[sweep].solver = "cpsat"`` where OR-Tools is not installed;
    ``prefix`` names where (ending in the subject), ``also`` adds to the install hint."""
    return PlanError(
        f"{prefix} [sweep].solver 'cpsat' needs OR-Tools, which is not installed "
        f"(pip install 'adaptipe[cpsat]'{also})"
    )


def available() -> bool:
    """Whether OR-Tools is importable."""
    try:
        importlib.import_module("ortools.sat.python.cp_model")
    except ImportError:
        return False
    return True


def _scale(values: list[float]) -> tuple[float, bool]:
    """The smallest power of ten making every value integral (exact), else the largest
    one that keeps the total of all times below 10^9 (times in seconds: sub-microsecond)."""
    for k in range(7):
        scale = 10.0**k
        if all(abs(v * scale - round(v * scale)) < 1e-6 for v in values):
            return scale, True
    total = max(sum(values), 1e-12)
    return 10.0 ** math.floor(math.log10(1e9 / total)), False


def solve_cpsat(
    inst: JapspInstance,
    *,
    time_limit_s: float = 10.0,
    seed: int = 0,
    initial: Orders | None = None,
    workers: int | None = None,
) -> Result:
    """Best schedule CP-SAT finds within ``time_limit_s`` (hinted with ``initial``)."""
    cp = _cp_model()
    t0 = time.perf_counter()
    tab = OpTable.of(inst)
    scale, exact = _scale([*tab.dur, *tab.lag, *tab.sw])

    def q(v: float) -> int:
        return round(v * scale)

    k2 = 2 * tab.stages
    horizon = sum(q(tab.dur[o]) + q(tab.sw[o]) + q(tab.lag[o]) for o in range(tab.n)) + 1
    model = cp.CpModel()
    start = [model.NewIntVar(q(tab.head[o]), horizon, f"s{o}") for o in range(tab.n)]
    ivs = [model.NewFixedSizeIntervalVar(start[o], q(tab.dur[o]), f"i{o}") for o in range(tab.n)]
    makespan = model.NewIntVar(0, horizon + max(q(d) for d in tab.dur), "T")
    for o in range(tab.n):
        model.Add(makespan >= start[o] + q(tab.dur[o]))
        if (o + 1) % k2:
            model.Add(start[o + 1] >= start[o] + q(tab.lag[o]))
    for ops in tab.machine_ops:
        model.AddNoOverlap([ivs[o] for o in ops])
        if not any(tab.sw[o] for o in ops):
            continue
        arcs: list[tuple[int, int, Any]] = []
        for a, oa in enumerate(ops, start=1):
            arcs.append((0, a, model.NewBoolVar("")))
            arcs.append((a, 0, model.NewBoolVar("")))
            for b, ob in enumerate(ops, start=1):
                # a job's backward never precedes its own forward on a stage
                if a == b or (ob // k2 == oa // k2 and ob < oa):
                    continue
                lit = model.NewBoolVar("")
                gap = q(tab.sw[oa]) if ob // k2 != oa // k2 else 0
                model.Add(start[ob] >= start[oa] + q(tab.dur[oa]) + gap).OnlyEnforceIf(lit)
                arcs.append((a, b, lit))
        model.AddCircuit(arcs)
    model.Minimize(makespan)
    if initial is not None:
        res = semi_active(tab, to_seqs(tab, initial))
        if res is not None:
            for o in range(tab.n):
                model.AddHint(start[o], q(res[0][o]))
    solver = cp.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers or max(1, min(8, os.cpu_count() or 1))
    status = solver.Solve(model)
    if status not in (cp.OPTIMAL, cp.FEASIBLE):
        raise PlanError(
            f"CP-SAT found no schedule in {time_limit_s} s (status {solver.StatusName(status)})"
        )
    value = [solver.Value(v) for v in start]
    seqs = [sorted(ops, key=lambda o: (value[o], o % k2)) for ops in tab.machine_ops]
    timed = semi_active(tab, seqs)
    if timed is None:  # only possible when rounding reordered zero-length blocks
        raise PlanError("CP-SAT returned cyclic stage orders (time scaling too coarse)")
    lb = simple = lower_bound(tab)
    if exact:
        lb = max(lb, math.ceil(solver.BestObjectiveBound() - 1e-9) / scale)
    mk = timed[1]
    return Result(
        solver="cpsat",
        orders=tab.orders(seqs),
        makespan=mk,
        lower_bound=min(lb, mk),
        optimal=(exact and status == cp.OPTIMAL) or mk <= lb + 1e-9,
        seconds=time.perf_counter() - t0,
        nodes=int(solver.NumBranches()),
        stopped_by="bound"
        if mk <= simple + 1e-9
        else "search"
        if status == cp.OPTIMAL
        else "clock",
    )
