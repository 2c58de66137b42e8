"""Local search over JAPSP schedules: tabu search on the critical path and job moves.

`tabu_search` walks the N5/N7 neighbourhoods (Nowicki and Smutnicki; Dell'Amico and
Trubian): on one critical path, cut into blocks of consecutive operations on one stage,
an operation moves to its block's front or end, or the first (last) two trade places.
Evaluating every neighbour exactly costs a pass over the whole schedule each, so moves
are ranked by an *estimate* (Balas and Vazacopoulos's, extended to this problem's lags
and switches): the longest path through the reordered operations, taking the heads of
their chain predecessors and the tails of their successors from before the move. Those
can change too (a block downstream of a moved one), so the estimate is the makespan
for most critical-block moves but not all; only the few best-ranked moves are timed. `job_moves` makes the macro moves
the critical path cannot (a job traded or moved on every stage at once), and `kick`
takes one at random (iterated local search).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from adaptipe.japsp.budget import SearchBudget
from adaptipe.japsp.evaluate import OpTable, critical_blocks, longest_paths, semi_active

__all__ = ["block_moves", "job_moves", "kick", "move_estimate", "tabu_search"]

_EPS = 1e-9
Seqs = list[list[int]]


def move_estimate(
    tab: OpTable,
    seq: Sequence[int],
    i: int,
    j: int,
    head: Sequence[float],
    tail: Sequence[float],
) -> float:
    """Estimated makespan after the operation at position ``i`` of a stage's ``seq`` moves
    to position ``j``: the longest path through the operations between them, in their new
    order, with the heads and tails (`longest_paths`) of everything else unchanged.
    ``math.inf`` if the move puts a block before its own chain predecessor."""
    k2 = 2 * tab.stages
    dur, lag, sw = tab.dur, tab.lag, tab.sw
    lo, hi = (i, j) if i < j else (j, i)
    seg = list(seq[lo : hi + 1])
    seg.insert(j - lo, seg.pop(i - lo))
    size = len(seg)
    # A chain neighbour shares the stage only on the last one (its F -> B): positions
    # of the segment's blocks are needed there alone.
    at = {o: p for p, o in enumerate(seg)} if tab.machine[seq[i]] == tab.stages - 1 else {}
    heads = [0.0] * size
    prev = seq[lo - 1] if lo > 0 else -1
    t = 0.0
    for p in range(size):
        o = seg[p]
        if prev >= 0:
            t = (heads[p - 1] if p else head[prev]) + dur[prev]
            if prev // k2 != o // k2:
                t += sw[prev]
        if o % k2:
            q = at.get(o - 1, -1)
            if q > p:
                return math.inf
            c = (heads[q] if q >= 0 else head[o - 1]) + lag[o - 1]
            if c > t:
                t = c
        heads[p] = t
        prev = o
    best = 0.0
    nxt = seq[hi + 1] if hi + 1 < len(seq) else -1
    rest = tail[nxt] if nxt >= 0 else 0.0
    tails = heads  # filled back to front; heads[p] is read before tails[p] is written
    for p in range(size - 1, -1, -1):
        o = seg[p]
        v = dur[o]
        if (o + 1) % k2:
            q = at.get(o + 1, -1)  # after p here: the head pass returned on the other case
            c = lag[o] + (tails[q] if q >= 0 else tail[o + 1])
            if c > v:
                v = c
        if nxt >= 0:
            c = dur[o] + rest + (sw[o] if o // k2 != nxt // k2 else 0.0)
            if c > v:
                v = c
        h = heads[p]
        if h + v > best:
            best = h + v
        tails[p] = v
        nxt, rest = o, v
    return best


def block_moves(first: int, last: int) -> list[tuple[int, int]]:
    """The N5/N7 moves ``(i, j)`` (the block at stage position ``i`` goes to ``j``) of a
    critical block at positions ``first .. last``: an inner block to either end, an end
    to the other, or the first (last) two trade places; each resulting order once."""
    moves = {(first, first + 1), (last - 1, last)}
    for p in range(first + 1, last):
        moves.update(((p, first), (p, last)))
    if last - first > 1:
        moves.update(((first, last), (last, first)))
    # moving i to j = i + 1 or j to i swaps the same two blocks: keep one of the two
    return sorted({(min(i, j), max(i, j)) if abs(i - j) == 1 else (i, j) for i, j in moves})


def tabu_search(
    tab: OpTable,
    seqs: Seqs,
    *,
    iters: int,
    rng: random.Random,
    floor: float,
    budget: SearchBudget,
    exact: int = 3,
) -> tuple[Seqs, list[float], float]:
    """Tabu search over N5/N7 critical-block moves: each step times moves in the order
    `move_estimate` ranks them until ``exact`` admissible ones (acyclic, and not tabu or
    better than the best makespan found) are timed, and takes the best of those.
    Returns the best orders, their starts and makespan. Stops after ``iters`` steps, at
    ``floor`` (a lower bound), when ``budget`` is spent, or when no move is admissible."""
    n = tab.n
    res = semi_active(tab, seqs)
    assert res is not None
    budget.spend(n)
    best = (res[1], [list(s) for s in seqs], res[0])
    forbidden: dict[tuple[int, int], int] = {}
    for it in range(iters):
        if best[0] <= floor + _EPS or budget.exhausted():
            break
        lp = longest_paths(tab, seqs)
        assert lp is not None
        head, tail = lp
        budget.spend(2 * n)
        pos = [0] * n
        for seq in seqs:
            for p, o in enumerate(seq):
                pos[o] = p
        ranked: list[tuple[float, float, int, int, int, list[tuple[int, int]], bool]] = []
        for block in critical_blocks(tab, seqs, head):
            m = tab.machine[block[0]]
            seq = seqs[m]
            for i, j in block_moves(pos[block[0]], pos[block[-1]]):
                est = move_estimate(tab, seq, i, j, head, tail)
                budget.spend(4 + 2 * abs(i - j))
                if est == math.inf:
                    continue
                x = seq[i]
                new = (
                    [(x, seq[k]) for k in range(j, i)]
                    if j < i
                    else [(seq[k], x) for k in range(i + 1, j + 1)]
                )
                tabu = any(forbidden.get(a, -1) >= it for a in new)
                if tabu and est >= best[0] - _EPS:
                    continue
                ranked.append((est, rng.random(), m, i, j, new, tabu))
        ranked.sort(key=lambda r: (r[0], r[1]))
        chosen = None
        taken = 0  # admissible moves timed: acyclic, and not tabu or better than the best
        for _, tie, m, i, j, new, tabu in ranked:
            if taken >= exact:
                break
            trial_seq = list(seqs[m])
            trial_seq.insert(j, trial_seq.pop(i))
            trial = [*seqs[:m], trial_seq, *seqs[m + 1 :]]
            out = semi_active(tab, trial)
            budget.spend(n)
            if out is None or (tabu and out[1] >= best[0] - _EPS):
                continue
            taken += 1
            key = (out[1], tie)
            if chosen is None or key < chosen[0]:
                chosen = (key, trial, out, new)
        if chosen is None:
            break
        _, seqs, (start, mk), new = chosen
        tenure = rng.randint(4, 10)
        for a, b in new:
            forbidden[(b, a)] = it + tenure
        if mk < best[0] - _EPS:
            best = (mk, [list(s) for s in seqs], start)
    return best[1], best[2], best[0]


def _moved(tab: OpTable, seqs: Seqs, a: int, b: int, after: bool) -> Seqs:
    """Job ``a`` placed, on every stage, just before (or ``after``) job ``b``'s blocks."""
    shift, job = (b - a) * 2 * tab.stages, tab.job
    trial = []
    for seq in seqs:
        out: list[int] = []
        add = out.append
        for o in seq:
            j = job[o]
            if j == b and not after:
                add(o - shift)
            if j != a:
                add(o)
            if j == b and after:
                add(o - shift)
        trial.append(out)
    return trial


def job_moves(
    tab: OpTable, seqs: Seqs, mk: float, *, rng: random.Random, tries: int, budget: SearchBudget
) -> tuple[Seqs, float]:
    """Descent over macro moves the critical-path neighbourhoods cannot make: two jobs
    trade places on every stage at once, or one job moves, on every stage, to just
    before or just after another (a short job to the front starts the pipeline sooner,
    one at the end drains it sooner). First improvement over ``tries`` random moves."""
    k2, jobs = 2 * tab.stages, tab.jobs
    moves = [(a, b, kind) for a in range(jobs) for b in range(jobs) if a != b for kind in (0, 1, 2)]
    moves = [m for m in moves if m[2] or m[0] < m[1]]
    improved = True
    while improved and not budget.exhausted():
        improved = False
        rng.shuffle(moves)
        budget.spend(len(moves) // 2)  # J^2 moves: the shuffle counts on many jobs
        for a, b, kind in moves[:tries]:
            if budget.exhausted():
                return seqs, mk
            if kind == 0:
                swap = {a * k2 + k: b * k2 + k for k in range(k2)}
                swap.update({b * k2 + k: a * k2 + k for k in range(k2)})
                trial = [[swap.get(o, o) for o in seq] for seq in seqs]
            else:
                trial = _moved(tab, seqs, a, b, after=kind == 2)
            res = semi_active(tab, trial)
            budget.spend(tab.n)
            if res is not None and res[1] < mk - _EPS:
                seqs, mk, improved = trial, res[1], True
                break
    return seqs, mk


def kick(tab: OpTable, seqs: Seqs, rng: random.Random, budget: SearchBudget) -> Seqs:
    """A random job move of `job_moves`, taken whatever it costs (if it stays acyclic)."""
    for _ in range(10):
        a, b = rng.sample(range(tab.jobs), 2) if tab.jobs > 1 else (0, 0)
        trial = _moved(tab, seqs, a, b, after=rng.random() < 0.5)
        budget.spend(tab.n)
        if a != b and semi_active(tab, trial) is not None:
            return trial
    return seqs
