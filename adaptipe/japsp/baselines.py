"""Constructive orders for a job-array: the baselines ArrayPipe is compared with (§V-A)
and the shifting-bottleneck heuristic the GA starts from.

The baselines treat the jobs as the micro-batches of one pipeline: GPipe (all forwards,
then all backwards, in job order), 1F1B (PipeDream-Flush's per-stage warm-up / steady /
cool-down order) and a round-robin dispatcher (whenever a stage can start a block, it
serves the job after the one it served last, cyclically, among the blocks ready first).

`shifting_bottleneck` (Adams, Balas and Zawack) sequences stage by stage: the stage
whose ``1|r_j|L_max`` sub-problem (Alg. 1 line 14, heads and tails from the disjunctive
graph of Fig. 6) is worst goes first, sequenced by Schrage's rule, and the stages
already sequenced are re-optimised after each one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from adaptipe.japsp.bounds import schrage
from adaptipe.japsp.evaluate import Block, OpTable, Timeline, evaluate, longest_paths
from adaptipe.japsp.instance import JapspInstance
from adaptipe.schedule.onefoneb import one_f_one_b_order

__all__ = [
    "BASELINES",
    "gpipe_orders",
    "one_f_one_b_orders",
    "round_robin_orders",
    "shifting_bottleneck",
]


def gpipe_orders(inst: JapspInstance) -> Timeline:
    """GPipe over jobs: every stage runs ``F0 .. F(J-1)`` then ``B0 .. B(J-1)``."""
    jobs = range(inst.num_jobs)
    order: tuple[Block, ...] = (*(("F", j) for j in jobs), *(("B", j) for j in jobs))
    return evaluate(inst, [order] * inst.num_stages)


def one_f_one_b_orders(inst: JapspInstance) -> Timeline:
    """1F1B over jobs: stage ``s`` runs ``min(S-s-1, J)`` forwards, then F/B pairs."""
    s_count, jobs = inst.num_stages, inst.num_jobs
    orders = [list(one_f_one_b_order(s_count, jobs, s)) for s in range(s_count)]
    return evaluate(inst, orders)


def round_robin_orders(inst: JapspInstance) -> Timeline:
    """Non-delay dispatch: the block that can start first goes next; among the blocks
    of that stage ready by then, the stage takes the job cyclically after its last one."""
    tab = OpTable.of(inst)
    k2, jobs = 2 * tab.stages, tab.jobs
    nxt = [j * k2 for j in range(jobs)]
    ready = [0.0] * jobs
    free = [0.0] * tab.stages
    last = [-1] * tab.stages
    seqs: list[list[int]] = [[] for _ in range(tab.stages)]
    for _ in range(tab.n):
        best: tuple[float, int] | None = None
        es: dict[int, float] = {}
        for j in range(jobs):
            o = nxt[j]
            if o >= (j + 1) * k2:
                continue
            m = tab.machine[o]
            lm = last[m]
            t = max(ready[j], free[m] + (tab.sw[lm] if lm >= 0 and lm // k2 != j else 0.0))
            es[j] = t
            if best is None or t < best[0]:
                best = (t, m)
        assert best is not None
        t0, m = best
        prev_job = last[m] // k2 if last[m] >= 0 else -1
        pick = min(
            (j for j, t in es.items() if tab.machine[nxt[j]] == m and t <= t0),
            key=lambda j: (j - prev_job - 1) % jobs,
        )
        o = nxt[pick]
        start = es[pick]
        seqs[m].append(o)
        free[m] = start + tab.dur[o]
        last[m] = o
        ready[pick] = start + tab.lag[o]
        nxt[pick] = o + 1
    return evaluate(tab, tab.orders(seqs))


def shifting_bottleneck(
    tab: OpTable,
    *,
    noise: float = 0.0,
    rng: random.Random | None = None,
    spend: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Sequence the stages bottleneck first (Schrage per stage), re-optimising as it goes.

    ``noise > 0`` perturbs the tails the rule compares (for randomised restarts).
    ``spend`` is told the work done (`adaptipe.japsp.budget` units): a longest-path
    pass 3 per block, a stage's Schrage run a sixth of the square of its block count
    (measured: its quadratic scan is that much cheaper per step than a schedule pass).
    """
    s_count = tab.stages
    seqs: list[list[int]] = [[] for _ in range(s_count)]
    done: list[int] = []
    charge = spend if spend is not None else (lambda units: None)

    def solve_stage(m: int, head: list[float], tail: list[float]) -> tuple[list[int], float]:
        if noise and rng is not None:
            tail = [t * (1.0 + noise * rng.random()) for t in tail]
        charge(len(tab.machine_ops[m]) ** 2 // 6)
        return schrage(tab, tab.machine_ops[m], head, tail)

    def paths(cand: list[list[int]]) -> tuple[list[float], list[float]] | None:
        charge(3 * tab.n)
        return longest_paths(tab, cand)

    def makespan(cand: list[list[int]]) -> float:
        lp = paths(cand)
        return math.inf if lp is None else max(h + t for h, t in zip(*lp, strict=True))

    while len(done) < s_count:
        lp = paths(seqs)
        assert lp is not None
        head, tail = lp
        worst: tuple[float, int, list[int]] | None = None
        for m in range(s_count):
            if m not in done:
                seq, value = solve_stage(m, head, tail)
                if worst is None or value > worst[0]:
                    worst = (value, m, seq)
        assert worst is not None
        _, m, seq = worst
        seqs[m] = seq
        if paths(seqs) is None:  # Schrage broke a path through other stages
            seqs[m] = sorted(tab.machine_ops[m], key=lambda o: (head[o], o))
        done.append(m)
        current = makespan(seqs)
        for m2 in done[:-1]:
            saved, seqs[m2] = seqs[m2], []
            lp2 = paths(seqs)
            assert lp2 is not None
            seqs[m2], _ = solve_stage(m2, *lp2)
            value = makespan(seqs)
            if value <= current:
                current = value
            else:
                seqs[m2] = saved
    return seqs


BASELINES = {"gpipe": gpipe_orders, "1f1b": one_f_one_b_orders, "rr": round_robin_orders}
