"""Exhaustive JAPSP optimum for tiny instances: the yardstick of the solver tests."""

from __future__ import annotations

import itertools

from adaptipe.japsp import JapspInstance
from adaptipe.japsp.evaluate import OpTable, semi_active


def brute_force_optimum(inst: JapspInstance) -> tuple[float, list[list[int]]]:
    """Best makespan and orders over every combination of per-stage orders."""
    tab = OpTable.of(inst)
    k2 = 2 * tab.stages
    per_stage = []
    for ops in tab.machine_ops:
        ok = []
        for perm in itertools.permutations(ops):
            pos = {o: i for i, o in enumerate(perm)}
            if all(pos[o] < pos[p] for o in perm for p in perm if o // k2 == p // k2 and o < p):
                ok.append(list(perm))
        per_stage.append(ok)
    best: tuple[float, list[list[int]]] = (float("inf"), [])
    for combo in itertools.product(*per_stage):
        res = semi_active(tab, combo)
        if res is not None and res[1] < best[0]:
            best = (res[1], [list(s) for s in combo])
    return best
