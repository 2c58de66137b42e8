"""Candidate partitions: AutoPipe's moves are exactly the partitions that change two
stages, DynPipe's cut only between condensed blocks, the simulator's best of all
candidates is the best of every partition, and `top_k` is an environment's action
space: the best few, never the partition in force, in a fixed order."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from adaptipe.controllers.candidates import (
    autopipe_moves,
    candidates,
    dynpipe_candidates,
    layer_costs,
    score,
    top_k,
)
from adaptipe.controllers.observation import Observation
from adaptipe.errors import PlanError
from adaptipe.sim.conditions import iteration_times


def _obs(
    work: list[float],
    bounds: tuple[int, ...],
    *,
    bandwidth: float = math.inf,
    nbytes: int = 0,
    microbatches: int = 4,
) -> Observation:
    n = len(work)
    links = (
        {} if math.isinf(bandwidth) else {f"{s}-{s + 1}": bandwidth for s in range(len(bounds) - 2)}
    )
    return Observation(
        iteration=0,
        bounds=bounds,
        layer_forward_s=tuple(w / 3 for w in work),
        layer_backward_s=tuple(2 * w / 3 for w in work),
        boundary_bytes=(nbytes,) * n,
        state_bytes=(0,) * n,
        link_bandwidth_Bps=links,
        microbatches=microbatches,
    )  # fmt: skip


def _every(n: int, stages: int) -> list[tuple[int, ...]]:
    return [(0, *cut, n) for cut in itertools.combinations(range(1, n), stages - 1)]


def _layers(bounds: tuple[int, ...], s: int) -> range:
    return range(bounds[s], bounds[s + 1])


@pytest.mark.parametrize(("n", "stages"), [(4, 2), (6, 3), (7, 3), (8, 4)])
def test_autopipe_moves_are_every_partition_that_changes_two_stages(n: int, stages: int) -> None:
    for bounds in _every(n, stages):
        moves = autopipe_moves(bounds)
        assert len(moves) == len(set(moves)) and bounds not in moves
        brute = {
            other
            for other in _every(n, stages)
            if sum(_layers(bounds, s) != _layers(other, s) for s in range(stages)) == 2
        }
        assert set(moves) == brute
        # boundary k ranges over b[k+1] - b[k-1] - 2 new places: under 2 L in all
        assert len(moves) == n + bounds[-2] - bounds[1] - 2 * (stages - 1) < 2 * n


def test_dynpipe_candidates_cut_only_on_block_boundaries() -> None:
    # layers 2 and 5 are heaviest; the third block end is the earliest of the rest (0),
    # and the last block runs to the end: blocks [0, 1), [1, 3), [3, 8)
    obs = _obs([1, 1, 5, 1, 1, 5, 1, 1], (0, 4, 8))
    assert dynpipe_candidates(obs, 2, 3) == [(0, 1, 8), (0, 3, 8)]
    got = dynpipe_candidates(obs, 3, 5)
    assert len(got) == math.comb(5 - 1, 3 - 1)
    blocks = {0, 1, 2, 3, 4, 8}  # ends at 0, 1, 2, 3 and the model's end
    assert all(set(b) <= blocks for b in got)
    # the layers a slowed stage holds weigh more now: stage 1's layer 4 outranks 0 and 1
    slowed = dynpipe_candidates(obs, 2, 3, slowdowns=(1.0, 3.0))
    assert slowed == [(0, 3, 8), (0, 5, 8)]
    # with as many blocks as layers every partition is a candidate
    assert dynpipe_candidates(obs, 3, 8) == _every(8, 3)


@pytest.mark.parametrize("seed", range(6))
def test_the_best_scored_candidate_is_the_best_of_every_partition(seed: int) -> None:
    rng = random.Random(seed)
    n, stages = rng.randint(4, 7), rng.randint(2, 3)
    work = [rng.uniform(0.1, 2.0) for _ in range(n)]
    obs = _obs(work, _every(n, stages)[0], bandwidth=rng.choice([math.inf, 2e3]),
               nbytes=rng.choice([0, 1000]))  # fmt: skip
    slow = tuple(rng.choice([1.0, 1.0, 2.5]) for _ in range(stages))
    scored = score(obs, dynpipe_candidates(obs, stages, n), slow)
    costs = layer_costs(obs)
    bws = [[obs.link_bandwidth_Bps.get(f"{s}-{s + 1}", math.inf) for s in range(stages - 1)]]
    brute = min(float(iteration_times(costs, b, [slow], bws)[0]) for b in _every(n, stages))
    assert scored[0][1] == pytest.approx(brute)
    assert [t for _, t in scored] == sorted(t for _, t in scored)


def test_a_slowed_stage_gives_its_layers_away() -> None:
    obs = _obs([1.0] * 8, (0, 4, 8))
    assert top_k(obs, (1.0, 3.0), 1)[0][0][1] > 4
    assert top_k(obs, (3.0, 1.0), 1)[0][0][1] < 4
    three = _obs([1.0] * 9, (0, 3, 6, 9))
    best = top_k(three, (1.0, 3.0, 1.0), 1, include=("dynpipe",), blocks=9)[0][0]
    assert best[2] - best[1] < 3  # the middle stage holds fewer


def test_top_k_is_sorted_deterministic_and_never_the_partition_in_force() -> None:
    obs = _obs([1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0, 1.0], (0, 3, 5, 8), bandwidth=1e4,
               nbytes=500)  # fmt: skip
    slow = (1.0, 2.0, 1.0)
    got = top_k(obs, slow, 5)
    assert len(got) == 5 and all(b != obs.bounds for b, _ in got)
    assert got == sorted(got, key=lambda bt: (bt[1], bt[0]))
    assert top_k(obs, slow, 5) == got
    # screening by the analytic model keeps this instance's best five
    every = score(obs, set(candidates(obs, slow)) - {obs.bounds}, slow)
    assert top_k(obs, slow, 5, screen=None) == every[:5] == got
    # ties (a symmetric model) go to the smaller bounds
    flat = _obs([1.0] * 6, (0, 2, 4, 6))
    tied = top_k(flat, (1.0, 1.0, 1.0), 8, screen=None)
    for (b1, t1), (b2, t2) in itertools.pairwise(tied):
        assert t1 < t2 or (t1 == t2 and b1 < b2)
    # fewer when fewer exist: two layers, two stages, nothing but the partition in force
    assert top_k(_obs([1.0, 1.0], (0, 1, 2)), (1.0, 1.0), 3) == []


def test_layer_costs_split_a_cuts_bytes_between_directions() -> None:
    obs = _obs([1.0] * 3, (0, 1, 3), nbytes=101)
    costs = layer_costs(obs)
    assert costs.activation_bytes == (51, 51, 51) and costs.gradient_bytes == (0, 50, 50)
    assert all(costs.activation_bytes[i] + costs.gradient_bytes[i + 1] == 101 for i in range(2))
    assert costs.microbatches == 4 and costs.forward_s == obs.layer_forward_s


def test_bad_requests_name_the_value_and_what_is_allowed() -> None:
    obs = _obs([1.0] * 6, (0, 3, 6))
    with pytest.raises(PlanError, match=r"2 finite factors > 0"):
        top_k(obs, (1.0,), 2)
    with pytest.raises(PlanError, match=r"k must be an integer >= 1"):
        top_k(obs, (1.0, 1.0), 0)
    with pytest.raises(PlanError, match=r"include must name some of"):
        top_k(obs, (1.0, 1.0), 1, include=("genetic",))
    with pytest.raises(PlanError, match=r"top_k must be >= the 3 stages"):
        dynpipe_candidates(obs, 3, 2)
    with pytest.raises(PlanError, match=r"2 slowdowns for the 3 stages"):
        score(obs, [(0, 2, 4, 6)], (1.0, 1.0))
    with pytest.raises(PlanError, match=r"not a partition"):
        autopipe_moves((0, 3, 3, 6))
    assert np.isfinite(score(obs, [(0, 2, 6)], (1.0, 1.0))[0][1])
