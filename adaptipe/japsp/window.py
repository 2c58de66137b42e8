"""Windows: a job-array's block order unrolled over several iterations (rounds).

One JAPSP iteration fills and drains the pipeline: the last stage waits for the first
job's forward at the start, the first stage for the last job's gradient at the end.
A *window* of ``R`` rounds (``R`` mini-batches per job) is one schedule in which round
``r + 1``'s blocks may run in the gaps round ``r`` leaves, as long as a job's forward
in round ``r + 1`` comes after its own backward (and just-in-time update) of round
``r`` on that stage. Every job therefore computes with exactly the weights it would
have alone; only the idle time at the iteration boundaries goes away.

Within a round every stage keeps the solver's order. A list scheduler merges the
rounds: in global start order, each stage takes its next block from the earliest
round that can go, or hoists a later round's block into the gap (rules below); the
best of the rules is kept, so a window is never slower (by the block costs) than its
rounds one after another. With a memory budget (job states resident per stage), a
stage starts a forward only while fewer jobs than the budget are in flight there
(forward run, backward not), unless one round's order alone needs more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from adaptipe.errors import PlanError
from adaptipe.japsp.evaluate import OpTable, Orders, checked_seqs, parse_block, to_seqs
from adaptipe.japsp.instance import JapspInstance
from adaptipe.japsp.jitter import JITTER, Replay, expected_makespan
from adaptipe.schedule.onefoneb import ComputeOrder, add_transfers, one_f_one_b_order
from adaptipe.schedule.types import Backward, Forward, OptimizerStep, Schedule

__all__ = [
    "AUTO_WINDOW_MAX",
    "JITTER",
    "NEAR",
    "ROUND_ORDERS",
    "RULES",
    "RoundBlock",
    "Window",
    "auto_window",
    "best_window",
    "expected_makespan",
    "unroll",
    "window_schedule",
]

RoundBlock = tuple[Literal["F", "B"], int, int]
"""A block of a window: ``(kind, job, round)``."""

RULES = ("serial", "fit", "eager")
"""How a stage fills a gap with a later round's block.

``serial``: never (the rounds run one after another on every stage); ``fit``: only
when the block ends before the earliest round's next block could start; ``eager``:
whenever it can start first (non-delay list scheduling).
"""


NEAR = 0.01
"""Windows within this share of the shortest, by the block costs, are ranked by their
mean makespan with block times spread by `JITTER`."""

ROUND_ORDERS = {
    "given": "the solver's own",
    "1f1b": "1F1B",
    "1f1b-ahead": "1F1B-one-step-ahead",
    "round-robin": "round-robin",
    "gpipe": "GPipe",
    "1f1b-capped": "1F1B-within-the-budget",
    "gpipe-grouped": "GPipe-in-groups-of-the-budget",
}
"""The round orders `best_window` chooses among, and how to say them."""

AUTO_WINDOW_MAX = 32
"""The longest window ``window = "auto"`` picks (a stop waits at most this long)."""


def auto_window(jobs: int, stages: int) -> int:
    """Iterations per window for ``window = "auto"``: the fewest for which a boundary's
    fill and drain, about (S - 1) / (W x J) of the window, is at most 2%; 1 to 32.
    One job gets 1: its next round waits for its own last backward, so rounds cannot
    overlap and a longer window would only delay stop requests.

    The JAPSP window model agrees on 4 equal jobs over 2 stages, with block times
    measured in a run: 6% over the busiest stage's load at W = 4, 1.5% at 16.
    """
    if jobs < 1 or stages < 1:
        raise ValueError(f"auto_window: needs jobs >= 1 and stages >= 1 (got {jobs}, {stages})")
    if jobs == 1:
        return 1
    return max(1, min(AUTO_WINDOW_MAX, -(-50 * (stages - 1) // jobs)))


@dataclass(frozen=True, slots=True)
class Window:
    """Per-stage block orders of ``rounds`` rounds and their makespan by the block costs;
    ``order`` names the round order they unroll (a key of `ROUND_ORDERS`)."""

    rounds: int
    orders: tuple[tuple[RoundBlock, ...], ...]
    makespan: float
    rule: str
    order: str = field(default="given", compare=False)

    def to_json(self) -> list[list[str]]:
        """Per stage, ``"F3.1"``: job 3's forward of round 1."""
        return [[f"{k}{j}.{r}" for k, j, r in stage] for stage in self.orders]


_Op = tuple[int, int]  # (operation id of the OpTable, round)


def unroll(
    inst: JapspInstance | OpTable,
    orders: Sequence[Sequence[object]],
    rounds: int,
    *,
    rules: Sequence[str] = RULES,
    budget: int = 0,
) -> Window:
    """The best window of ``rounds`` rounds of per-stage ``orders`` under ``rules``.

    ``budget > 0`` caps the jobs in flight per stage (see the module docstring).
    Raises `PlanError` for a round count below 1, an unknown rule, or orders that are
    incomplete or cyclic.
    """
    best: Window | None = None
    for window in _unrolled(inst, orders, rounds, rules=rules, budget=budget):
        if best is None or window.makespan < best.makespan - 1e-12:
            best = window
    assert best is not None
    return best


def _unrolled(
    inst: JapspInstance | OpTable,
    orders: Sequence[Sequence[object]],
    rounds: int,
    *,
    rules: Sequence[str] = RULES,
    budget: int = 0,
) -> list[Window]:
    """The windows of ``orders`` under each of ``rules`` that does not stall under the
    budget (serial, which never does, when all of them do)."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise PlanError(f"unroll: rounds must be an integer >= 1 (got {rounds!r})")
    unknown = [r for r in rules if r not in RULES]
    if unknown or not rules:
        raise PlanError(f"unroll: rules must be among {', '.join(RULES)} (got {list(rules)})")
    tab = inst if isinstance(inst, OpTable) else OpTable.of(inst)
    seqs = checked_seqs(tab, orders, where="unroll")
    limits = [max(budget, _in_flight(tab, seq)) if budget > 0 else tab.jobs for seq in seqs]
    windows = [
        window
        for rule in dict.fromkeys(rules)
        if (window := _Merge(tab, seqs, rounds, rule, limits).run()) is not None
    ]
    if not windows:  # every rule asked for stalled under the budget; serial never does
        serial = _Merge(tab, seqs, rounds, "serial", limits).run()
        assert serial is not None
        windows.append(serial)
    return windows


def _in_flight(tab: OpTable, seq: Sequence[int]) -> int:
    """The most jobs in flight on a stage (the starting one included) running ``seq``."""
    open_: set[int] = set()
    most = 0
    for o in seq:
        j = tab.job[o]
        if o % (2 * tab.stages) < tab.stages:
            open_.add(j)
            most = max(most, len(open_))
        else:
            open_.discard(j)
    return most


def best_window(
    inst: JapspInstance, orders: Sequence[Sequence[object]], rounds: int, *, budget: int = 0
) -> tuple[Orders, Window]:
    """The round order whose window of ``rounds`` should run shortest, and that window:
    the least mean makespan with jittered block times among the windows within `NEAR`
    of the shortest by the block costs.

    Candidates: ``orders`` (the solver's, optimal for one round) and the 1F1B,
    1F1B-one-step-ahead, round-robin and GPipe orders. Orders that tie for one round
    can differ a lot once rounds overlap: a 1F1B-like order frees each job's first
    stage early, so its next round can start while the pipeline drains. With a memory
    ``budget`` (job states resident per stage, 0 = all), orders that keep no more jobs
    in flight than the budget come first, whatever their makespan (the solver does not
    see the budget), then the fewest jobs over it. When every candidate is over the
    budget (few jobs left after early stops, say), 1F1B with its warm-up cut to
    ``budget - 1`` forwards and GPipe in groups of ``budget`` jobs join: both keep
    within any budget.

    Block times jitter in a real run, and windows that tie by the block costs do not
    tie then: with 1F1B, a stage sends its next forward just in time, and every late
    block stalls the stage after it; one step ahead, it does not. So the windows within
    `NEAR` of the shortest are ranked by their mean makespan over seeded samples of
    block times spread by `JITTER` (`expected_makespan`); ties keep the earlier
    candidate. The draws are plain arithmetic on Python's seeded generator, so every
    worker picks the same window. One step ahead holds one more job's activations on
    every stage but the last; a memory ``budget`` counts it like any order.
    """
    from adaptipe.japsp.baselines import gpipe_orders, one_f_one_b_orders, round_robin_orders

    tab = OpTable.of(inst)

    def over(cand: Sequence[Sequence[object]]) -> int:
        need = max(_in_flight(tab, seq) for seq in to_seqs(tab, cand))
        return max(0, need - budget) if budget > 0 else 0

    candidates: list[tuple[str, Sequence[Sequence[object]]]] = [("given", orders)]
    if rounds > 1 or over(orders):
        candidates += [
            ("1f1b", one_f_one_b_orders(inst).orders),
            ("1f1b-ahead", _one_step_ahead(inst.num_stages, inst.num_jobs)),
            ("round-robin", round_robin_orders(inst).orders),
            ("gpipe", gpipe_orders(inst).orders),
        ]
    if budget > 0 and all(over(cand) for _, cand in candidates):
        capped, grouped = _within_budget(inst.num_stages, inst.num_jobs, budget)
        candidates += [("1f1b-capped", capped), ("gpipe-grouped", grouped)]
    scored = [
        (over(cand), replace(window, order=name), cand)
        for name, cand in candidates
        for window in _unrolled(tab, cand, rounds, budget=budget)
    ]
    least = min(o for o, _, _ in scored)
    pool = [(window, cand) for o, window, cand in scored if o == least]
    shortest = min(window.makespan for window, _ in pool)
    near = [(w, c) for w, c in pool if w.makespan <= shortest * (1 + NEAR) + 1e-12]
    distinct: dict[tuple[tuple[RoundBlock, ...], ...], tuple[Window, Sequence[Sequence[object]]]]
    distinct = {}
    for w, c in near:  # rules often give one window twice: replay it once
        distinct.setdefault(w.orders, (w, c))
    near = list(distinct.values())
    window, cand = near[0]
    if len(near) > 1:
        spread = Replay(tab, rounds)
        lowest = spread.expected(window)
        for w, c in near[1:]:  # ties (to a relative 1e-9) keep the earlier candidate
            score = spread.expected(w)
            if score < lowest * (1 - 1e-9):
                window, cand, lowest = w, c, score
    return tuple(tuple(parse_block(b) for b in stage) for stage in cand), window


def _within_budget(stages: int, jobs: int, budget: int) -> list[list[ComputeOrder]]:
    """Orders with at most ``budget`` jobs in flight on every stage: 1F1B whose warm-up
    runs at most ``budget - 1`` forwards, and GPipe over groups of ``budget`` jobs."""
    capped = [
        one_f_one_b_order(stages, jobs, s, warmup=min(stages - s - 1, budget - 1))
        for s in range(stages)
    ]
    grouped: ComputeOrder = []
    for first in range(0, jobs, budget):
        group = range(first, min(first + budget, jobs))
        grouped += [("F", j) for j in group] + [("B", j) for j in group]
    return [capped, [list(grouped) for _ in range(stages)]]


def _one_step_ahead(stages: int, jobs: int) -> list[ComputeOrder]:
    """1F1B with one more forward of warm-up on every stage but the last: the stage
    after it finds its next forward waiting even when a block runs late."""
    return [
        one_f_one_b_order(stages, jobs, s, warmup=stages - s if s < stages - 1 else 0)
        for s in range(stages)
    ]


class _Merge:
    """One list-scheduling pass that merges ``rounds`` copies of the stage orders."""

    def __init__(
        self, tab: OpTable, seqs: list[list[int]], rounds: int, rule: str, limits: list[int]
    ) -> None:
        self.tab, self.seqs, self.rounds, self.rule = tab, seqs, rounds, rule
        self.limits = limits
        self.open: list[set[int]] = [set() for _ in seqs]  # jobs in flight per stage
        self.k2 = 2 * tab.stages
        self.start: dict[_Op, float] = {}
        self.free = [0.0] * tab.stages
        self.prev = [-1] * tab.stages  # last operation placed on each stage

    def run(self) -> Window | None:
        """The merged window, or None when this rule stalls under the in-flight limits."""
        tab, seqs, rounds = self.tab, self.seqs, self.rounds
        ptr = [[0] * rounds for _ in seqs]
        low = [0] * len(seqs)  # per stage, the first round with blocks left
        out: list[list[RoundBlock]] = [[] for _ in seqs]
        remaining = sum(len(seq) for seq in seqs) * rounds
        stages = len(seqs)
        # Each stage's next block, kept until a block placed on it or a neighbour (which
        # its readiness reads) changes it; "fit" bounds read every stage: always redone.
        choices: list[tuple[float, int, int] | None] = [None] * stages
        stale = set(range(stages))
        while remaining:
            for s in range(stages) if self.rule == "fit" else sorted(stale):
                seq = seqs[s]
                while low[s] < rounds and ptr[s][low[s]] == len(seq):
                    low[s] += 1
                heads = []
                for r in range(low[s], rounds):
                    heads.append((r, seq[ptr[s][r]]))
                    # A round not begun here cannot start before an earlier one has: its
                    # first block (a forward) waits for its job's previous backward here.
                    if ptr[s][r] == 0 or self.rule == "serial":
                        break
                choices[s] = self._choose(s, heads)
            pick: tuple[float, int, int, int] | None = None  # (start, round, stage, op)
            for s, choice in enumerate(choices):
                if choice is not None and (pick is None or (choice[0], choice[1], s) < pick[:3]):
                    pick = (choice[0], choice[1], s, choice[2])
            if pick is None:
                return None
            t, r, s, o = pick
            self.start[(o, r)] = t
            self.free[s] = t + tab.dur[o]
            self.prev[s] = o
            ptr[s][r] += 1
            kind, j = tab.block(o)
            if kind == "F":
                self.open[s].add(j)
            else:
                self.open[s].discard(j)
            out[s].append((kind, j, r))
            remaining -= 1
            stale = {n for n in (s - 1, s, s + 1) if 0 <= n < stages}
        makespan = max((t + tab.dur[o] for (o, _), t in self.start.items()), default=0.0)
        return Window(
            rounds=rounds,
            orders=tuple(tuple(stage) for stage in out),
            makespan=makespan,
            rule=self.rule,
        )

    def _choose(self, s: int, heads: list[tuple[int, int]]) -> tuple[float, int, int] | None:
        """(start, round, op) of the block stage ``s`` runs next, or None to wait."""
        ready = [(t, r, o) for r, o in heads if (t := self._ready(s, o, r)) is not None]
        if not ready:
            return None
        if self.rule == "eager":
            return min(ready)
        first_round, first_op = heads[0]
        due = next((t for t, r, _ in ready if r == first_round), None)
        if due is None:
            due = self._bound(first_op, first_round)
        for t, r, o in sorted(ready):
            if r == first_round:
                return t, r, o
            if t + self.tab.dur[o] <= due:
                return t, r, o  # fills the gap before the earliest round's next block
        return None

    def _ready(self, s: int, o: int, r: int) -> float | None:
        """Earliest start of ``(o, r)`` on stage ``s`` now; None while a predecessor waits."""
        tab, k2 = self.tab, self.k2
        t = self.free[s]
        if self.prev[s] >= 0 and self.prev[s] // k2 != o // k2:
            t += tab.sw[self.prev[s]]
        k = o % k2
        if k:
            p = self.start.get((o - 1, r))
            if p is None:
                return None
            t = max(t, p + tab.lag[o - 1])
        if k < tab.stages and len(self.open[s]) >= self.limits[s]:
            return None  # the memory budget holds no further job in flight here
        if k < tab.stages and r:
            b = (o // k2) * k2 + k2 - 1 - s  # this job's backward on this stage
            done = self.start.get((b, r - 1))
            if done is None:
                return None
            t = max(t, done + tab.dur[b])
        return t

    def _bound(self, o: int, r: int) -> float:
        """A lower bound on the start of unplaced ``(o, r)``: its chain, stages' free times."""
        tab, k2 = self.tab, self.k2
        placed = self.start.get((o, r))
        if placed is not None:
            return placed
        t = self.free[tab.machine[o]]
        if o % k2:
            t = max(t, self._bound(o - 1, r) + tab.lag[o - 1])
        return t


def window_schedule(inst: JapspInstance, window: Window, *, name: str = "japsp") -> Schedule:
    """The `Schedule` that runs ``window``: micro-batch ``r`` of job ``j`` is its round ``r``.

    ``update_every = 1``: each round is a whole mini-batch, stepped right after its
    backward on each stage (the just-in-time update); ``weights = "sync"``, and the
    validator checks that a job's next round starts on a stage only after that step.
    """
    recompute = any(any(row) for row in inst.recompute)
    stages = inst.num_stages
    if len(window.orders) != stages:
        raise PlanError(
            f"window_schedule: the window has {len(window.orders)} stages, the instance {stages}"
        )
    program = []
    for s, order in enumerate(window.orders):
        ops: list[Forward | Backward | OptimizerStep] = []
        for kind, j, r in order:
            if kind == "F":
                ops.append(Forward(j, r))
            else:
                ops.extend((Backward(j, r), OptimizerStep(j)))
        program.append(add_transfers(ops, stage=s, num_stages=stages, recompute=recompute))
    return Schedule(
        name=name,
        num_stages=stages,
        num_microbatches=window.rounds,
        num_jobs=inst.num_jobs,
        stages=tuple(program),
        weights="sync",
        update_every=1,
        recompute=recompute,
        meta={
            "rounds": window.rounds,
            "window_rule": window.rule,
            "makespan": window.makespan,
            "orders": window.to_json(),
        },
    )
