"""`adaptipe.controllers.positions`: a stage's readings divided by what its place in the
pipeline costs, measured across the move that put its layers there. On a pipeline whose
stages pay a fixed cost per block (a cold core after a wait: the first layer of each
stage runs slower), a stage left holding one small layer reads 3.5x on a quiet machine;
without the calibration the threshold rule takes that for a load and never moves layers
back after a real load on that stage has ended; with it, it does."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pytest

from adaptipe.controllers.live import LiveDecider
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.positions import Positions
from adaptipe.controllers.replan import best_partition, stage_slowdowns
from adaptipe.controllers.threshold import Threshold, ThresholdSettings
from adaptipe.errors import PlanError

WORK = (1e-3, 1e-3, 1e-3, 1e-3, 2e-3, 1e-4)  # per layer, forward + backward, as profiled
COST = 2.5e-4  # what a stage's first layer costs beyond its profile (a cold core)
WINDOW = 4


def observe(
    bounds: Sequence[int],
    *,
    first: int,
    slow: Sequence[float] = (1.0, 1.0),
    spike: float = 1.0,
    last: float = 1.0,
    window: int = WINDOW,
) -> Observation:
    """``window`` iterations from ``first`` under ``bounds``: stage ``s``'s layers at
    ``slow[s]`` times their profile, its first layer ``COST`` more (times ``slow[s]``);
    the first iteration's times ``spike`` times that (a switch's own iteration), the last
    one's ``last`` times (a link's shaping stalled the stage as it began)."""
    stages = len(bounds) - 1
    owner = [s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])]
    layers = [
        slow[owner[i]] * (WORK[i] + (COST if i in bounds[:-1] else 0.0)) / 2
        for i in range(len(WORK))
    ]
    factor = [spike, *[1.0] * (window - 2), last][-window:]
    rows = [tuple(v * factor[k] for v in layers) for k in range(window)]
    compute = [sum(layers[bounds[s] : bounds[s + 1]]) * 2 for s in range(stages)]
    return Observation(
        iteration=first + window - 1,
        bounds=tuple(bounds),
        layer_forward_s=tuple(w / 2 for w in WORK),
        layer_backward_s=tuple(w / 2 for w in WORK),
        boundary_bytes=(0,) * len(WORK),
        state_bytes=(1000,) * len(WORK),
        iterations=tuple(range(first, first + window)),
        measured_forward_s=tuple(rows),
        measured_backward_s=tuple(rows),
        stage_compute_s=(tuple(compute),) * window,
        stage_iteration_s=((max(compute),) * stages,) * window,
    )


def test_the_first_partition_is_the_reference() -> None:
    positions = Positions()
    obs = observe((0, 3, 6), first=0)
    assert positions.apply(obs) is obs
    assert positions.factors == (1.0, 1.0)


def test_a_moved_stage_reads_as_it_did_before_the_move() -> None:
    positions = Positions()
    before = stage_slowdowns(positions.apply(observe((0, 3, 6), first=0)))
    raw = observe((0, 5, 6), first=10)
    assert stage_slowdowns(raw)[1] == pytest.approx((WORK[5] + COST) / WORK[5])  # 3.5
    after = stage_slowdowns(positions.apply(raw))
    assert after == pytest.approx(before)
    assert positions.factors[1] == pytest.approx(3.5 / before[1])
    # a load that comes later shows at its size
    loaded = stage_slowdowns(positions.apply(observe((0, 5, 6), first=20, slow=(1.0, 3.0))))
    assert loaded[1] == pytest.approx(3 * before[1])
    assert loaded[0] == pytest.approx(before[0])


def test_the_switch_iteration_is_left_out_and_the_factor_settles() -> None:
    positions = Positions(settle=3)
    positions.apply(observe((0, 3, 6), first=0))
    positions.apply(observe((0, 5, 6), first=10, spike=10.0))  # the switch's iteration
    factors = positions.factors
    stage1 = sum(WORK[3:])
    assert factors[1] == pytest.approx(3.5 / ((stage1 + COST) / stage1))
    positions.apply(observe((0, 5, 6), first=14, slow=(1.0, 2.0)))  # settled: kept
    assert positions.factors == factors


def test_a_small_window_settles_once_enough_iterations_have_passed() -> None:
    """With a 2-iteration window no call holds 3 iterations after the switch; the factor
    is fixed once 3 have passed, and a load that comes later shows."""
    positions = Positions(settle=3)
    positions.apply(observe((0, 3, 6), first=0, window=2))
    for first in (10, 11, 12):  # the switch at 10; 11 and 12 read as before
        positions.apply(observe((0, 5, 6), first=first, window=2))
    loaded = positions.apply(observe((0, 5, 6), first=13, slow=(1.0, 2.0), window=2))
    before = stage_slowdowns(observe((0, 3, 6), first=0, window=2))
    assert stage_slowdowns(loaded)[1] == pytest.approx(2 * before[1])


def test_a_one_iteration_spike_before_the_move_does_not_count() -> None:
    plain, spiked = Positions(), Positions()
    plain.apply(observe((0, 3, 6), first=0))
    spiked.apply(observe((0, 3, 6), first=0, last=5.0))
    for positions in (plain, spiked):
        positions.apply(observe((0, 5, 6), first=10))
    assert spiked.factors == pytest.approx(plain.factors)


def test_a_stage_that_kept_its_layers_keeps_its_factor() -> None:
    positions = Positions()
    positions.apply(observe((0, 2, 4, 6), first=0, slow=(1.0, 1.0, 1.0)))
    positions.apply(observe((0, 3, 4, 6), first=10, slow=(1.0, 1.0, 2.0)))  # 2 slowed
    assert positions.factors[2] == 1.0
    assert positions.factors[1] != 1.0  # layer 3 alone, a first layer's cost on 1e-3


def test_positions_survive_a_resume() -> None:
    positions = Positions()
    positions.apply(observe((0, 3, 6), first=0))
    positions.apply(observe((0, 5, 6), first=10))
    restored = Positions()
    restored.load_state_dict(json.loads(json.dumps(positions.state_dict())))
    nxt = observe((0, 5, 6), first=20, slow=(1.0, 2.0))
    assert stage_slowdowns(restored.apply(nxt)) == stage_slowdowns(positions.apply(nxt))
    with pytest.raises(PlanError, match="settle"):
        Positions(settle=0)


def test_the_planner_goes_back_once_a_load_has_ended() -> None:
    """Calm at the move's end the raw readings put the best partition at cut 4 (stage 1
    at 3.5x), the calibrated ones at cut 3, where the run started."""
    positions = Positions()
    start = positions.apply(observe((0, 3, 6), first=0))
    assert best_partition(start)[0] == (0, 3, 6)
    positions.apply(observe((0, 3, 6), first=4, slow=(1.0, 3.0)))  # stage 1 loaded
    positions.apply(observe((0, 5, 6), first=10, slow=(1.0, 3.0)))  # moved off it
    calm = observe((0, 5, 6), first=20)  # the load ended
    assert best_partition(calm)[0] != (0, 3, 6)
    assert best_partition(positions.apply(calm))[0] == (0, 3, 6)


def drive(settings: ThresholdSettings, positions: Positions | None) -> list:
    """The threshold rule from cut 3, a check an iteration (each after a full window
    under the partition in force), stage 1 loaded 3x in iterations [10, 40). Its moves."""
    threshold = Threshold(settings)
    bounds: tuple[int, ...] = (0, 3, 6)
    since, moves = 0, []
    for it in range(WINDOW, 80):
        if it - since < WINDOW:
            continue
        slow = (1.0, 3.0) if 10 <= it < 40 else (1.0, 1.0)
        obs = observe(bounds, first=it - WINDOW + 1, slow=slow)
        decision = threshold.decide(positions.apply(obs) if positions is not None else obs)
        if decision.bounds is not None:
            bounds, since = decision.bounds, it
            moves.append((it, bounds))
    return moves


def test_the_threshold_rule_moves_back_with_positions_only() -> None:
    settings = ThresholdSettings(margin=0.2, patience=2, cooldown=6, horizon=100)
    calibrated = drive(settings, Positions())
    raw = drive(settings, None)
    assert calibrated[0][1] != (0, 3, 6) and 10 <= calibrated[0][0] < 40  # off the load
    assert calibrated[-1][1] == (0, 3, 6) and calibrated[-1][0] >= 40  # back after it
    assert raw[0] == calibrated[0]
    assert raw[-1][1] != (0, 3, 6)  # the raw readings keep the load forever


class _Stateful:
    name = "stub"

    def __init__(self) -> None:
        self.loaded: dict | None = None

    def decide(self, obs: Observation) -> object:  # pragma: no cover - not called
        raise AssertionError

    def state_dict(self) -> dict:
        return {"mine": 1}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def test_the_decider_keeps_positions_beside_the_controller_state() -> None:
    stub = _Stateful()
    live = LiveDecider(stub, None, window=WINDOW, workers=2, positions=Positions())  # type: ignore[arg-type]
    live.positions.apply(observe((0, 3, 6), first=0))  # type: ignore[union-attr]
    state = live.state_dict()
    assert state["mine"] == 1 and state["positions"]["bounds"] == [0, 3, 6]
    fresh = LiveDecider(_Stateful(), None, window=WINDOW, workers=2, positions=Positions())  # type: ignore[arg-type]
    fresh.load_state_dict(state)
    assert fresh.controller.loaded == {"mine": 1}  # type: ignore[attr-defined]
    assert fresh.positions.factors == (1.0, 1.0)  # type: ignore[union-attr]
    switched = LiveDecider(_Stateful(), None, window=WINDOW, workers=2, positions=Positions())  # type: ignore[arg-type]
    switched.carry_from(live)  # `adaptipe adapt --controller`: the run's positions go on
    assert switched.positions is live.positions
    assert math.isfinite(switched.positions.factors[0])  # type: ignore[union-attr]
