"""The pure helpers of bench/bench_adaptive.py: phases (with steps), recovery counting,
the validity rule, the controllers' summary and the paired PPO-threshold figures, the
arguments, on small synthetic runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.bench_adaptive import (
    Setting,
    Spans,
    _adapt,
    _config,
    controller_summary,
    initial_cut,
    paired,
    parse_args,
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


def test_steps_split_the_injection_into_one_phase_per_level() -> None:
    got = phase_ranges(iterations=80, onset=20, end=60, warmup=3, steps=(33, 46))
    assert got == {
        "before": range(3, 20),
        "step1": range(20, 33),
        "step2": range(33, 46),
        "step3": range(46, 60),
        "after": range(60, 80),
    }
    with pytest.raises(ValueError, match="steps"):
        phase_ranges(iterations=80, onset=20, end=60, warmup=3, steps=(46, 33))


def test_bandwidth_steps_write_one_link_shape_per_level_back_to_back() -> None:
    s = Setting(
        scenario="bandwidth_steps", iterations=80, onset=20, end=60,
        injection={"kind": "link_shape", "host": 1}, levels=("20mbit", "200mbit", "10mbit"),
    )  # fmt: skip
    assert s.steps == (33, 46)
    assert [(t["rate"], t["at_iteration"], t["iterations"]) for t in s.tables()] == [
        ("20mbit", 20, 13),
        ("200mbit", 33, 13),
        ("10mbit", 46, 14),
    ]
    # the oracle moves at each step whose best cut differs from the one before it
    best = {"before": 4, "step1": 5, "step2": 5, "step3": 3, "after": 4}
    moves = _adapt("oracle", s, best)["repartition"]
    assert [(m["iteration"], m["bounds"][1]) for m in moves] == [(22, 5), (48, 3), (62, 4)]


def test_a_job_array_setting_trains_the_sibling_learning_rates_on_the_same_samples() -> None:
    s = Setting(scenario="x", iterations=8, onset=4, end=6, injection={}, jobs=4)
    config = _config(Path("unused"), s, 3, _adapt("ppo", s, {}))
    assert config.sweep is not None and len(config.sweep.jobs) == 4
    assert {j.batch_size for j in config.sweep.jobs} == {16}
    assert config.adapt.controller == "ppo" and config.adapt.method == "live"


def test_steps_are_valid_when_one_step_changes_the_best_cut_by_20_percent() -> None:
    rel = {
        1: {"before": 1.0, "step1": 1.0, "step2": 1.0},
        2: {"before": 0.9, "step1": 1.1, "step2": 1.5},
    }
    got = validity(rel, initial=1)
    assert got["valid"] is True and got["valid_phases"] == ["step2"]
    assert got["gains_over_initial"] == pytest.approx({"step1": 0.1, "step2": 0.5})
    assert "by 50.0% in step2" in got["why"]


def _row(r: int, ppo: float, thr: float, **extra: Any) -> dict[str, Any]:
    def entry(v: float, n: int | None) -> dict[str, Any]:
        return {
            "throughput_vs_best_static": {"before": 1.0, "during": v},
            "injected_vs_best_static": v,
            "recovery_iterations": {"during": n},
            "target_met_phases": {"during": n is not None and n <= 10},
            "target_met": n is not None and n <= 10,
        }

    return {"round": r, "ppo": entry(ppo, 8), "threshold": entry(thr, 12), **extra}


def test_ppo_minus_threshold_per_round_with_its_median_and_the_round_to_round_spread() -> None:
    rows = [_row(0, 0.90, 0.95), _row(1, 0.80, 0.85), _row(2, 1.00, 0.90)]
    got = paired(rows)
    assert got["per_round"] == pytest.approx([-0.05, -0.05, 0.10])
    assert got["median"] == pytest.approx(-0.05)
    assert got["spread"] == pytest.approx(0.1)  # ppo's stdev of 0.9, 0.8, 1.0
    assert got["not_worse"] is True
    tight = [_row(0, 0.80, 0.95), _row(1, 0.81, 0.96), _row(2, 0.79, 0.94)]
    assert paired(tight)["not_worse"] is False  # 15% worse, every round, spread 1%


def test_a_failed_run_is_left_out_of_its_controllers_figures_and_the_pairs() -> None:
    rows = [_row(0, 0.9, 0.8), _row(1, 0.7, 0.8), {**_row(2, 0.0, 0.8), "ppo": {"error": "x"}}]
    got = controller_summary(rows, "ppo")
    assert got["rounds"] == 2 and got["errors"] == ["x"]
    assert got["injected_vs_best_static"] == pytest.approx(0.8)
    assert got["target_met_rounds"] == 2 and got["target_met_share"] == 1.0
    thr = controller_summary(rows, "threshold")
    assert thr["target_met_rounds"] == 0 and thr["recovery_iterations"] == {"during": 12}
    assert paired(rows)["rounds"] == 2


def test_the_arguments_are_checked_before_anything_runs() -> None:
    args = parse_args(["--scenarios", "slowdown,bandwidth_steps", "--jobs", "1,4"])
    assert args.scenario_list == ["slowdown", "bandwidth_steps"] and args.job_list == [1, 4]
    assert args.controller_rounds == 5 and args.level_list == [20.0, 200.0, 10.0]
    for bad in (["--scenarios", "flood"], ["--jobs", "3"], ["--controllers", "ppo,magic"],
                ["--levels", "20"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)
