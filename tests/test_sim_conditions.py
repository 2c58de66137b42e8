"""`adaptipe.sim.conditions`: a partition's iterations under per-iteration slowdowns and
bandwidths are the simulator's, block by block."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaptipe.errors import PlanError
from adaptipe.schedule.build import build_schedule
from adaptipe.sim.conditions import LayerCosts, iteration_times, unlimited
from adaptipe.sim.engine import simulate

COSTS = LayerCosts(
    forward_s=(1.0, 1.0, 2.0, 1.0),
    backward_s=(2.0, 2.0, 4.0, 2.0),
    activation_bytes=(100, 100, 50, 10),
    gradient_bytes=(0, 100, 100, 50),
    microbatches=4,
    samples_per_microbatch=8,
)


def test_each_iteration_is_the_simulators_under_its_own_conditions() -> None:
    bounds = (0, 2, 4)
    slow = np.array([[1.0, 1.0], [1.0, 3.0], [2.0, 1.0]])
    bws = np.array([[math.inf], [math.inf], [10.0]])
    got = iteration_times(COSTS, bounds, slow, bws)
    schedule = build_schedule("1f1b", stages=2, microbatches=4)
    for i in range(3):
        model = COSTS.cost_model(bounds, [bws[i, 0]]).with_slowdown(slow[i])
        assert got[i] == pytest.approx(simulate(schedule, model).makespan)
    assert got[1] > got[0] and got[2] > got[0]


def test_a_slower_link_costs_more_where_the_cut_carries_more() -> None:
    slow = np.ones((1, 2))
    narrow = np.array([[20.0]])
    heavy = iteration_times(COSTS, (0, 1, 4), slow, narrow)[0]  # carries 100 B each way
    light = iteration_times(COSTS, (0, 3, 4), slow, narrow)[0]  # carries 50 B each way
    free = iteration_times(COSTS, (0, 1, 4), slow, unlimited(2))[0]
    assert heavy > light and heavy > free


def test_bad_bounds_and_shapes_are_refused() -> None:
    with pytest.raises(PlanError, match=r"not a partition of 4 layers"):
        iteration_times(COSTS, (0, 2, 2, 4), np.ones((1, 3)), unlimited(3))
    with pytest.raises(PlanError, match=r"slowdown must be \(K, 2\)"):
        iteration_times(COSTS, (0, 2, 4), np.ones((1, 3)), unlimited(2))
