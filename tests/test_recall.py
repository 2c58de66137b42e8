"""`adaptipe.controllers.recall`: a controller remembers what the partitions it held
measured, under which conditions, and ranks them at that. On a pipeline
whose last stage carries work the planner cannot see, the threshold rule without it
moves to the planner's favourite, measures it slower and moves there again after every
cooldown; with it, the rule moves back once and stays. After a slowdown ends it goes
back to the partition that was best before, which the planner alone ranks within the
margin."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest

from adaptipe.controllers.observation import Observation
from adaptipe.controllers.recall import Recall, measured_iteration_s
from adaptipe.controllers.threshold import Threshold, ThresholdSettings
from adaptipe.errors import PlanError

WORK = (1e-3, 1e-3, 1e-3, 1e-3)  # per layer, forward + backward, as profiled
WINDOW = 4


def observe(
    bounds: Sequence[int],
    *,
    first: int,
    extra: Sequence[float] = (0.0, 2e-3),
    slow: Sequence[float] = (1.0, 1.0),
    microbatches: int = 1,
) -> Observation:
    """``WINDOW`` iterations from ``first`` under ``bounds``: stage ``s``'s layers at
    ``slow[s]`` times their profile, and ``extra[s]`` seconds a micro-batch of work no
    layer shows (a loss, an optimizer step: what the planner cannot see)."""
    owner = [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
    layers = tuple(WORK[i] * slow[owner[i]] / 2 for i in range(len(WORK)))
    stages = [
        (slow[s] * sum(WORK[a:b]) + extra[s]) * microbatches
        for s, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
    row = (max(stages),) * (len(bounds) - 1)
    return Observation(
        iteration=first + WINDOW - 1,
        bounds=tuple(bounds),
        layer_forward_s=tuple(w / 2 for w in WORK),
        layer_backward_s=tuple(w / 2 for w in WORK),
        boundary_bytes=(0,) * len(WORK),
        state_bytes=(1000,) * len(WORK),
        iterations=tuple(range(first, first + WINDOW)),
        measured_forward_s=(layers,) * WINDOW,
        measured_backward_s=(layers,) * WINDOW,
        stage_compute_s=(tuple(stages),) * WINDOW,
        stage_iteration_s=(row,) * WINDOW,
        microbatches=microbatches,
    )


def drive(
    threshold: Threshold,
    iterations: int,
    slow_from: int = 10**9,
    slow_to: int = 0,
    link: Callable[[tuple[int, ...], int], float] | None = None,
) -> list:
    """Run ``threshold`` on the pipeline of `observe`, starting at cut 3, one check an
    iteration, taking each move at once; stage 0 is 3x slower in [slow_from, slow_to);
    ``link(bounds, moves so far)``: what the link reads (B/s; unmeasured without).
    The partitions it moved to, with the iteration."""
    bounds: tuple[int, ...] = (0, 3, 4)
    since, moves = 0, []
    for it in range(WINDOW, iterations):
        if it - since < WINDOW:
            continue
        slow = (3.0, 1.0) if slow_from <= it < slow_to else (1.0, 1.0)
        obs = observe(bounds, first=it - WINDOW + 1, slow=slow)
        if link is not None:
            obs = replace(obs, link_bandwidth_Bps={"0-1": link(bounds, len(moves))})
        decision = threshold.decide(obs)
        if decision.bounds is not None:
            bounds, since = decision.bounds, it
            moves.append((it, bounds))
    return moves


SETTINGS = ThresholdSettings(margin=0.2, patience=2, cooldown=6, horizon=100)


def test_measured_iteration_is_the_median_of_the_slowest_stage() -> None:
    obs = observe((0, 2, 4), first=0)
    assert measured_iteration_s(obs) == pytest.approx(4e-3)  # stage 1: 2 ms + 2 ms extra


QUIET = (1.0, 1.0)


def test_an_entry_counts_after_min_checks_and_follows_the_measurements() -> None:
    recall = Recall(weight=0.5, min_checks=2)
    at2 = observe((0, 2, 4), first=0)  # measures 4 ms
    assert recall.observe(at2, QUIET) == pytest.approx(4e-3)
    assert recall.seconds(at2, (0, 2, 4), QUIET) is None  # one check: not yet
    slower = observe((0, 2, 4), first=4, extra=(0.0, 4e-3))  # 6 ms
    assert recall.observe(slower, QUIET) == pytest.approx(5e-3)  # 4 + 0.5 * (6 - 4)
    assert recall.seconds(at2, (0, 2, 4), QUIET) == pytest.approx(5e-3)
    two = observe((0, 2, 4), first=0, microbatches=2)
    assert recall.seconds(two, (0, 2, 4), QUIET) is None  # another block count: another key
    assert recall.measured(at2, QUIET) == {"0,2,4": 5.0}
    assert recall.known(at2, QUIET) == []  # the partition in force is not a candidate
    assert recall.known(observe((0, 3, 4), first=8), QUIET) == [(0, 2, 4)]


def test_an_entry_serves_only_conditions_near_those_it_was_measured_under() -> None:
    recall = Recall(min_checks=1, tolerance=1.25)
    at2 = observe((0, 2, 4), first=0)
    recall.observe(at2, QUIET)  # 4 ms
    recall.observe(observe((0, 2, 4), first=0, slow=(1.0, 3.0)), (1.0, 3.0))  # 8 ms
    assert recall.seconds(at2, (0, 2, 4), (1.1, 0.9)) == pytest.approx(4e-3)
    assert recall.seconds(at2, (0, 2, 4), (1.0, 2.8)) == pytest.approx(8e-3)
    assert recall.seconds(at2, (0, 2, 4), (1.0, 1.8)) is None  # near neither
    assert recall.known(observe((0, 3, 4), first=0), (1.0, 1.8)) == []
    for k in range(10):  # at most `entries` conditions; the oldest go
        recall.observe(at2, (1.0, 10.0 * 2**k))
    assert recall.seconds(at2, (0, 2, 4), QUIET) is None


def test_a_link_that_changed_is_other_conditions() -> None:
    recall = Recall(min_checks=1, link_tolerance=2.0)

    def linked(bps: float | None) -> Observation:
        obs = observe((0, 2, 4), first=0)
        return replace(obs, link_bandwidth_Bps={} if bps is None else {"0-1": bps})

    recall.observe(linked(1e9), QUIET)  # measured on a fast link
    assert recall.seconds(linked(0.6e9), (0, 2, 4), QUIET) == pytest.approx(4e-3)
    assert recall.seconds(linked(2.5e6), (0, 2, 4), QUIET) is None  # throttled: not these
    assert recall.seconds(linked(None), (0, 2, 4), QUIET) is None  # unmeasured: not these
    recall.observe(linked(None), QUIET)
    assert recall.seconds(linked(None), (0, 2, 4), QUIET) == pytest.approx(4e-3)


def test_a_partition_held_before_ranks_at_what_it_measured_against_the_one_in_force() -> None:
    recall = Recall(min_checks=1)
    at2, at3 = observe((0, 2, 4), first=0), observe((0, 3, 4), first=0)  # 4 and 3 ms
    recall.observe(at2, QUIET)
    assert recall.corrected(at2, (0, 3, 4), 3e-3, in_force_s=2e-3, slowdowns=QUIET) == 3e-3
    recall.observe(at3, QUIET)
    # cut 2 in force, the planner's 2 ms for it: cut 3 at 2 ms times 3 over 4 measured
    assert recall.corrected(
        at2, (0, 3, 4), 3e-3, in_force_s=2e-3, slowdowns=QUIET
    ) == pytest.approx(1.5e-3)
    assert recall.corrected(
        at3, (0, 2, 4), 2e-3, in_force_s=3e-3, slowdowns=QUIET
    ) == pytest.approx(4e-3)
    assert recall.corrected(at2, (0, 2, 4), 2e-3, in_force_s=2e-3, slowdowns=QUIET) == 2e-3
    other = (3.0, 1.0)  # held under other conditions only: the model's figure
    assert recall.corrected(at2, (0, 3, 4), 3e-3, in_force_s=2e-3, slowdowns=other) == 3e-3


def test_state_round_trips_and_bad_settings_are_refused() -> None:
    recall = Recall(min_checks=1)
    recall.observe(observe((0, 2, 4), first=0), QUIET)
    again = Recall(min_checks=1)
    again.load_state_dict(json.loads(json.dumps(recall.state_dict())))
    at2 = observe((0, 2, 4), first=0)
    assert again.seconds(at2, (0, 2, 4), QUIET) == recall.seconds(at2, (0, 2, 4), QUIET) == 4e-3
    with pytest.raises(PlanError, match="weight"):
        Recall(weight=0.0)
    with pytest.raises(PlanError, match="tolerance"):
        Recall(tolerance=0.5)
    with pytest.raises(PlanError, match="link_tolerance"):
        Recall(link_tolerance=0.9)


# Cut 3 measures 3 ms (stage 1's unseen 2 ms beside one layer), cut 2 4 ms; the planner,
# blind to the 2 ms, ranks cut 2 at 2 ms against cut 3's 3.


def test_without_recall_the_rule_stays_on_the_planners_favourite() -> None:
    assert drive(Threshold(SETTINGS), 80) == [(5, (0, 2, 4))]


def test_with_recall_the_rule_moves_back_once_and_stays() -> None:
    threshold = Threshold(SETTINGS, recall=Recall())
    assert drive(threshold, 80) == [(5, (0, 2, 4)), (11, (0, 3, 4))]
    kept = threshold.decide(observe((0, 3, 4), first=90))
    assert kept.bounds is None
    assert (
        "recalled: the planner's best (0, 2, 4) 2.0 ms, 4.0 ms by what it measured" in kept.reason
    )


def test_after_a_slowdown_ends_recall_goes_back_to_the_best_partition_before_it() -> None:
    # stage 0 3x slower in [40, 80): cut 1 is best (5 ms against cut 3's 9); after it
    # cut 3 is best again (3 ms), cut 2 takes 4 ms and the planner ranks cut 2 first
    with_recall = drive(Threshold(SETTINGS, recall=Recall()), 120, slow_from=40, slow_to=80)
    without = drive(Threshold(SETTINGS), 120, slow_from=40, slow_to=80)
    assert [b for it, b in with_recall if 40 <= it < 80] == [(0, 1, 4)]
    assert [b for it, b in without if 40 <= it < 80] == [(0, 1, 4)]
    assert with_recall[-1][1] == (0, 3, 4) and with_recall[-1][0] >= 80
    assert without[-1][1] == (0, 2, 4) and without[-1][0] >= 80


def test_a_partition_just_left_ranks_no_better_than_it_measured_when_left() -> None:
    recall = Recall(min_checks=1)

    def at(bounds: tuple[int, ...], bps: float, slow: Sequence[float] = QUIET) -> Observation:
        obs = observe(bounds, first=0, slow=slow)  # cut 2: 4 ms, cut 3: 3 ms measured
        return replace(obs, link_bandwidth_Bps={"0-1": bps})

    recall.observe(at((0, 2, 4), 3.4e8), QUIET)
    now = at((0, 3, 4), 0.8e8)  # the same link read 4.25x slower carrying cut 3's traffic
    recall.observe(now, QUIET)
    assert recall.seconds(now, (0, 2, 4), QUIET) is None  # not the same conditions ...
    assert recall.left_seconds(now, (0, 2, 4), QUIET) == pytest.approx(4e-3)  # ... just left
    # the model's 2 ms for cut 2 against cut 3's 3 in force: at least 3 ms x 4 / 3 measured
    assert recall.corrected(now, (0, 2, 4), 2e-3, in_force_s=3e-3, slowdowns=QUIET) == (
        pytest.approx(4e-3)
    )
    assert recall.corrected(now, (0, 2, 4), 5e-3, in_force_s=3e-3, slowdowns=QUIET) == 5e-3
    assert recall.left_ms(now, QUIET) == {"0,2,4": 4.0}
    # it stands down: other stage slowdowns, a link that reads far faster (a throttle
    # ended), another block count, a partition it never held
    assert recall.left_seconds(now, (0, 2, 4), (1.0, 2.0)) is None
    assert recall.left_seconds(at((0, 3, 4), 1.5e9), (0, 2, 4), QUIET) is None  # > 4 x 3.4e8
    two = replace(now, microbatches=2)
    assert recall.corrected(two, (0, 2, 4), 2e-3, in_force_s=3e-3, slowdowns=QUIET) == 2e-3
    assert recall.left_seconds(now, (0, 1, 4), QUIET) is None
    # ... and after revisit_checks checks
    again = Recall(min_checks=1)
    again.load_state_dict(json.loads(json.dumps(recall.state_dict())))
    assert again.left_seconds(now, (0, 2, 4), QUIET) == pytest.approx(4e-3)
    for _ in range(again.revisit_checks):
        again.observe(now, QUIET)
    assert again.left_seconds(now, (0, 2, 4), QUIET) is None
    never = Recall(min_checks=1, revisit_checks=0)
    never.observe(at((0, 2, 4), 3.4e8), QUIET)
    never.observe(now, QUIET)
    assert never.corrected(now, (0, 2, 4), 2e-3, in_force_s=3e-3, slowdowns=QUIET) == 2e-3
    with pytest.raises(PlanError, match="revisit_checks"):
        Recall(revisit_checks=-1)


def test_the_rule_does_not_flip_back_to_a_partition_it_just_measured_slower() -> None:
    # session 23's flip-flop: cut 3's first entry matches at cut 2 (3e8 against 3.4e8),
    # and the rule goes back to it; held at cut 3 the busy link then reads 0.8e8 (its
    # saturated rate), cut 2's entry no longer matches and the planner favours cut 2
    def link(bounds: tuple[int, ...], moves: int) -> float:
        return 3.4e8 if bounds == (0, 2, 4) else 3e8 if moves == 0 else 0.8e8

    guarded = drive(Threshold(SETTINGS, recall=Recall()), 60, link=link)
    assert guarded == [(5, (0, 2, 4)), (11, (0, 3, 4))]
    unguarded = drive(Threshold(SETTINGS, recall=Recall(revisit_checks=0)), 60, link=link)
    assert unguarded[:3] == [(5, (0, 2, 4)), (11, (0, 3, 4)), (17, (0, 2, 4))]


def test_the_threshold_rules_checkpointed_state_carries_what_it_measured() -> None:
    first = Threshold(SETTINGS, recall=Recall())
    assert drive(first, 20) == [(5, (0, 2, 4)), (11, (0, 3, 4))]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = Threshold(SETTINGS, recall=Recall())
    resumed.load_state_dict(state)
    at2 = observe((0, 2, 4), first=30)
    assert resumed.recall is not None
    assert resumed.recall.known(at2, QUIET) == [(0, 3, 4)]
    fresh = Threshold(SETTINGS, recall=Recall())
    assert "recalled" in resumed.decide(at2).reason
    assert "recalled" not in fresh.decide(at2).reason
