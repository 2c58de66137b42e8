"""Baseline controllers on synthetic observations: AlwaysBest moves whenever the best
candidate differs and is faster, Straggler only past its 2x / 0.5x trigger, Stale one
check late, RestartAtEpoch only at epoch boundaries and by restarting; a decision says
how it moves, and the migration cost prices either way."""

from __future__ import annotations

import pytest

from adaptipe.controllers.base import Decision, Keep
from adaptipe.controllers.baselines import (
    BASELINES,
    AlwaysBest,
    RestartAtEpoch,
    RestartAtEpochSettings,
    Stale,
    Straggler,
    StragglerSettings,
)
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.replan import stage_slowdowns
from adaptipe.controllers.threshold import Threshold
from adaptipe.errors import PlanError
from adaptipe.sim.migration import MigrationCost

LAYERS = 8


def _obs(
    slow: tuple[float, ...], bounds: tuple[int, ...] = (0, 4, 8), iteration: int = 0
) -> Observation:
    """Eight equal layers; stage s measures ``slow[s]`` times the profile on its layers."""
    fwd, bwd = (1 / 3,) * LAYERS, (2 / 3,) * LAYERS
    owner = [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
    return Observation(
        iteration=iteration,
        bounds=bounds,
        layer_forward_s=fwd,
        layer_backward_s=bwd,
        boundary_bytes=(0,) * LAYERS,
        state_bytes=(1000,) * LAYERS,
        iterations=(iteration,),
        measured_forward_s=(tuple(slow[owner[i]] * fwd[i] for i in range(LAYERS)),),
        measured_backward_s=(tuple(slow[owner[i]] * bwd[i] for i in range(LAYERS)),),
        stage_iteration_s=((1.0,) * (len(bounds) - 1),),
        microbatches=4,
    )  # fmt: skip


def test_the_helper_observes_the_slowdowns_it_was_given() -> None:
    assert stage_slowdowns(_obs((1.0, 2.5))) == pytest.approx((1.0, 2.5))


def test_always_best_moves_whenever_the_best_is_faster() -> None:
    controller = AlwaysBest()
    balanced = controller.decide(_obs((1.0, 1.0)))
    assert not balanced.moves and "the partition in force is the best" in balanced.reason
    slowed = controller.decide(_obs((1.0, 1.2)))  # a small slowdown is enough
    assert slowed.bounds is not None and slowed.bounds[1] > 4 and slowed.method == "live"
    assert slowed.predicted_gain_s is not None and slowed.predicted_gain_s > 0
    assert not controller.decide(_obs((1.0, 1.2), slowed.bounds)).moves  # there already


def test_straggler_fires_past_2x_and_not_at_1_5x_then_on_recovery() -> None:
    controller = Straggler()
    mild = controller.decide(_obs((1.0, 1.5)))
    assert not mild.moves and "no straggler" in mild.reason and "1.50x" in mild.reason
    assert AlwaysBest().decide(_obs((1.0, 1.5))).moves  # where AlwaysBest would move
    heavy = controller.decide(_obs((1.0, 2.5)))
    assert heavy.bounds is not None and heavy.bounds[1] > 4
    assert "stage 1 2.50x" in heavy.reason
    # planned for 2.5 now: the same slowdown on the new partition fires nothing
    assert not controller.decide(_obs((1.0, 2.5), heavy.bounds)).moves
    back = controller.decide(_obs((1.0, 1.0), heavy.bounds))  # 0.4x of planned
    assert back.bounds == (0, 4, 8) and "stage 1 0.40x" in back.reason
    with pytest.raises(PlanError, match="factor must be > 1"):
        StragglerSettings(factor=1.0)


def test_stale_acts_one_check_late() -> None:
    checks = [(1.0, 1.0), (1.0, 3.0), (1.0, 3.0)]
    best, stale = AlwaysBest(), Stale()
    now = [best.decide(_obs(s)).moves for s in checks]
    late = [stale.decide(_obs(s)) for s in checks]
    assert now == [False, True, True]
    assert [d.moves for d in late] == [False, False, True]
    assert "no earlier measurement" in late[0].reason
    assert "(1.00, 1.00)" in late[1].reason and "(1.00, 3.00)" in late[2].reason
    assert late[2].bounds == best.decide(_obs(checks[1])).bounds


def test_restart_at_epoch_moves_only_at_epoch_boundaries_by_restarting() -> None:
    controller = RestartAtEpoch(RestartAtEpochSettings(epoch_iterations=10))
    decisions = {it: controller.decide(_obs((1.0, 3.0), iteration=it)) for it in range(0, 26, 3)}
    moved = {it: d for it, d in decisions.items() if d.moves}
    assert sorted(moved) == [12, 21]  # the first checks of epochs 1 and 2
    assert all(d.method == "restart" and d.bounds and d.bounds[1] > 4 for d in moved.values())
    assert "within epoch 0" in decisions[0].reason
    quiet = RestartAtEpoch(RestartAtEpochSettings(epoch_iterations=10))
    assert not any(quiet.decide(_obs((1.0, 1.0), iteration=it)).moves for it in range(25))
    with pytest.raises(PlanError, match="epoch_iterations must be >= 1"):
        RestartAtEpochSettings(epoch_iterations=0)


def test_a_decision_carries_its_method() -> None:
    live = Decision(bounds=(0, 5, 8), reason="x")
    assert live.to_json()["method"] == "live"
    assert Decision(bounds=(0, 5, 8), method="restart").to_json() == {
        "bounds": [0, 5, 8], "reason": "", "predicted_gain_s": None, "method": "restart",
    }  # fmt: skip
    with pytest.raises(PlanError, match=r"method must be one of \('live', 'restart'\)"):
        Decision(method="teleport")


def test_the_migration_cost_prices_a_switch_either_way() -> None:
    cost = MigrationCost()
    assert cost.restart_s == 4.5  # bench_migration's restarts: 3.9-5.2 s here
    assert cost.switch_s("live", 10**6, 1e8) == cost.stall_s(10**6, 1e8)
    assert cost.switch_s("restart", 10**6, 1e8) == cost.switch_s("restart", 0, 1e3) == 4.5
    assert cost.switch_s("live", 0, 1e8) == 0.0
    assert MigrationCost(restart_s=2.0).to_json()["restart_s"] == 2.0
    with pytest.raises(PlanError, match="'live' or 'restart'"):
        cost.switch_s("streamed", 1, 1e8)
    with pytest.raises(PlanError, match="restart_s must be >= 0"):
        MigrationCost(restart_s=-1.0)


def test_every_baseline_is_registered_by_its_name_and_decides() -> None:
    assert {"none", "threshold", "always_best", "straggler", "stale", "restart_at_epoch"} <= set(
        BASELINES
    )
    assert isinstance(BASELINES["none"](), Keep) and isinstance(BASELINES["threshold"](), Threshold)
    for name, factory in BASELINES.items():
        controller = factory()
        assert controller.name == name
        assert isinstance(controller.decide(_obs((1.0, 2.5))), Decision)
