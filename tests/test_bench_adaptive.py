"""The pure helpers of bench/bench_adaptive.py: phases, recovery counting, the validity
rule, on small synthetic runs."""

from __future__ import annotations

import pytest

from bench.bench_adaptive import (
    Spans,
    initial_cut,
    phase_ranges,
    recovery,
    relative,
    validity,
)


def test_phases_split_at_the_onset_and_the_end_and_leave_out_the_warmup() -> None:
    got = phase_ranges(iterations=80, onset=20, end=60, warmup=3)
    assert got == {"before": range(3, 20), "during": range(20, 60), "after": range(60, 80)}


def test_an_injection_that_lasts_to_the_end_has_no_after_phase() -> None:
    got = phase_ranges(iterations=50, onset=20, end=60, warmup=3)
    assert got == {"before": range(3, 20), "during": range(20, 50)}


@pytest.mark.parametrize("onset", [2, 80])
def test_an_onset_outside_the_run_is_refused(onset: int) -> None:
    with pytest.raises(ValueError, match="onset"):
        phase_ranges(iterations=80, onset=onset, end=90, warmup=3)


def test_throughput_is_samples_over_summed_spans_less_the_settling_iterations() -> None:
    spans = Spans.from_records(
        [{"iteration": i, "iteration_s": s, "samples": 10} for i, s in enumerate([9, 1, 1, 2])]
    )
    assert spans.throughput(range(0, 4)) == pytest.approx(40 / 13)
    assert spans.throughput(range(0, 4), settle=1) == pytest.approx(30 / 4)
    assert spans.mean_span(range(1, 4)) == pytest.approx(4 / 3)


def _seconds(values: list[float], start: int = 0) -> dict[int, float]:
    return {start + i: v for i, v in enumerate(values)}


def test_recovery_counts_from_the_phase_start_to_where_the_rolling_mean_stays_close() -> None:
    # slow for 4 iterations, then at the target: a window of 2 is within 10% from the
    # second fast iteration (mean of 1.0 and 1.0)
    seconds = _seconds([2.0] * 4 + [1.0] * 10, start=20)
    assert recovery(seconds, range(20, 34), 1.0, window=2) == 5
    assert recovery(seconds, range(20, 34), 1.0, window=1) == 4


def test_a_relapse_restarts_the_count() -> None:
    seconds = _seconds([2.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0], start=10)
    assert recovery(seconds, range(10, 18), 1.0, window=1) == 4


def test_a_run_already_at_the_target_recovers_at_once() -> None:
    assert recovery(_seconds([1.05] * 8), range(0, 8), 1.0, window=3) == 0


def test_no_recovery_when_it_never_comes_or_comes_too_late_to_show_it_stays() -> None:
    assert recovery(_seconds([1.2] * 8), range(0, 8), 1.0, window=1) is None
    # fast in the last two iterations: a window of 2 is within only at the last one,
    # fewer than a window's iterations to show that it stays
    assert recovery(_seconds([2.0] * 6 + [1.0] * 2), range(0, 8), 1.0, window=1) == 6
    assert recovery(_seconds([2.0] * 6 + [1.0] * 2), range(0, 8), 1.0, window=2) is None


def _rounds() -> list[dict[int, dict[str, float]]]:
    """Two rounds of three cuts; the second round runs everything 2x slower (drift)."""
    one = {
        1: {"before": 100.0, "during": 40.0},
        2: {"before": 90.0, "during": 80.0},
        3: {"before": 50.0, "during": 60.0},
    }
    half = {c: {p: v / 2 for p, v in row.items()} for c, row in one.items()}
    return [one, half]


def test_ratios_within_a_round_cancel_drift_between_rounds() -> None:
    rel = relative(_rounds(), reference=1)
    assert rel[2] == pytest.approx({"before": 0.9, "during": 2.0})
    assert rel[1] == {"before": 1.0, "during": 1.0}


def test_the_initial_plan_is_the_best_cut_before_the_onset() -> None:
    assert initial_cut(_rounds()) == 1


def test_a_scenario_whose_best_cut_changes_and_gains_20_percent_is_valid() -> None:
    got = validity(relative(_rounds(), reference=1), initial=1)
    assert got["valid"] is True
    assert got["best"] == {"before": 1, "during": 2}
    assert got["gain_over_initial"] == pytest.approx(1.0)


def test_a_scenario_whose_best_cut_does_not_change_is_invalid_and_says_why() -> None:
    rel = {1: {"before": 1.0, "during": 1.0}, 2: {"before": 0.9, "during": 0.8}}
    got = validity(rel, initial=1)
    assert got["valid"] is False
    assert "cut 1 is the best static partition both before and during" in got["why"]


def test_a_gain_under_20_percent_is_invalid_even_when_the_best_cut_changes() -> None:
    rel = {1: {"before": 1.0, "during": 1.0}, 2: {"before": 0.9, "during": 1.15}}
    got = validity(rel, initial=1)
    assert got["valid"] is False and got["best"]["during"] == 2
    assert "beats the initial plan (cut 1) by 15.0%, under 20%" in got["why"]
