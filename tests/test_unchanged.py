"""`adaptipe.controllers.unchanged`: a check whose readings match those of the last
check the controller settled on keeps without asking it, at most ``most`` checks in a
row; any reading that moved, another partition, or a controller that is counting toward
a move is asked at once."""

from __future__ import annotations

from typing import Any

import pytest

from adaptipe.controllers.base import Decision
from adaptipe.controllers.live import LiveDecider
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.threshold import Threshold, ThresholdSettings
from adaptipe.controllers.unchanged import Settles, Unchanged
from adaptipe.monitor.schema import StageStats
from adaptipe.plan.partition import Partition

LAYER_S = 1e-3


def obs(
    it: int = 10,
    *,
    stage_s: tuple[float, float] = (3e-3, 3e-3),
    bps: float = 1e8,
    device: float = 0.5,
    bounds: tuple[int, ...] = (0, 3, 6),
) -> Observation:
    """A window of 4 iterations ending at ``it`` with these readings."""
    rows = (stage_s,) * 4
    return Observation(
        iteration=it,
        bounds=bounds,
        layer_forward_s=(LAYER_S,) * 6,
        layer_backward_s=(2 * LAYER_S,) * 6,
        boundary_bytes=(0,) * 6,
        state_bytes=(0,) * 6,
        iterations=tuple(range(it - 3, it + 1)),
        stage_compute_s=rows,
        stage_iteration_s=rows,
        link_bandwidth_Bps={"0-1": bps, "1-0": bps},
        device=((device, 0.0), (device, 0.0)),
    )


def test_matching_readings_keep_for_at_most_most_checks_in_a_row() -> None:
    quiet = Unchanged(tolerance=0.05, most=3)
    assert quiet.since(obs(10)) is None  # nothing settled yet
    quiet.asked(obs(10), settled=True)
    near = obs(11, stage_s=(3.1e-3, 2.9e-3), bps=1.8e8, device=0.55)  # 3%, 1.8x, +0.05
    assert [quiet.since(near) for _ in range(4)] == [10, 10, 10, None]  # then ask again
    quiet.asked(near, settled=True)
    assert quiet.since(obs(15)) == 11


@pytest.mark.parametrize(
    "moved",
    [
        {"stage_s": (3.3e-3, 3e-3)},  # a stage 10% slower
        {"bps": 4e7},  # a link read 2.5x slower (a throttle: 4x and more)
        {"bps": 3e8},  # ... or 3x faster (a throttle's end, on the probe)
        {"device": 0.7},  # a device feature the forest reads
        {"bounds": (0, 4, 6)},  # another partition
    ],
)
def test_a_moved_reading_or_another_partition_asks(moved: dict[str, Any]) -> None:
    quiet = Unchanged(tolerance=0.05)
    quiet.asked(obs(10), settled=True)
    assert quiet.since(obs(11)) == 10
    assert quiet.since(obs(12, **moved)) is None


def test_a_check_that_asks_forgets_what_was_settled_until_asked_says_so_again() -> None:
    quiet = Unchanged(tolerance=0.05)
    quiet.asked(obs(10), settled=True)
    assert quiet.since(obs(11, stage_s=(4e-3, 3e-3))) is None  # moved: the controller ...
    assert quiet.since(obs(12)) is None  # ... raised, say: asked again, not kept


def test_an_unsettled_controller_or_tolerance_zero_is_always_asked() -> None:
    quiet = Unchanged(tolerance=0.05)
    quiet.asked(obs(10), settled=False)
    assert quiet.since(obs(11)) is None
    off = Unchanged(tolerance=0.0)
    off.asked(obs(10), settled=True)
    assert off.since(obs(11)) is None


def test_the_threshold_rule_is_settled_only_while_no_check_counts_toward_a_move() -> None:
    rule = Threshold(ThresholdSettings(margin=0.2, patience=3))
    assert isinstance(rule, Settles) and rule.settled()
    rule._over = 1
    assert not rule.settled()


class _Counting:
    """Keeps, settled; counts the checks it was asked."""

    name = "counting"

    def __init__(self, settled: bool = True) -> None:
        self.asked, self._settled = 0, settled

    def decide(self, observation: Observation) -> Decision:
        self.asked += 1
        return Decision(reason="keep")

    def settled(self) -> bool:
        return self._settled


def _stats(it: int, stage: int, slow: float = 1.0) -> StageStats:
    compute = 3 * 3 * LAYER_S * slow
    return StageStats(
        run_id="r",
        stage=stage,
        iteration=it,
        time_s=1000.0 + it,
        first_layer=3 * stage,
        forward_s=(LAYER_S * slow,) * 3,
        backward_s=(2 * LAYER_S * slow,) * 3,
        compute_s=compute,
        wait_s=0.0,
        comm_s=0.0,
        iteration_s=compute,
    )


@pytest.mark.parametrize("settled", [True, False])
def test_the_live_decider_asks_a_settled_controller_only_when_readings_move(
    settled: bool,
) -> None:
    counting = _Counting(settled)
    live = LiveDecider(
        counting,  # type: ignore[arg-type]
        None,
        window=4,
        workers=2,
        unchanged=Unchanged(tolerance=0.05, most=4),
    )
    partition = Partition(model="mlp", num_layers=6, bounds=(0, 3, 6))
    records: list[Any] = []
    reasons = []
    for it in range(30):  # stage 1 twice as slow from iteration 24 on
        records += [_stats(it, s, 2.0 if s == 1 and it >= 24 else 1.0) for s in (0, 1)]
        reasons.append(live(records, partition).decision["reason"])
    keeps = [i for i, r in enumerate(reasons) if r == "keep"]
    if not settled:
        assert keeps == list(range(7, 30)) and counting.asked == 23
        return
    # the baseline is the first two windows (0-7); asked at 7, kept 4 checks, asked at
    # 12, ...; at once when stage 1 slowed at 24, and while its window filled (24-27)
    assert reasons[8] == "unchanged since iteration 7: kept"
    assert keeps == [7, 12, 17, 22, 24, 25, 26, 27] and counting.asked == 8
    assert reasons[28] == "unchanged since iteration 27: kept"
