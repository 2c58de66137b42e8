"""The controller protocol's input: an `Observation` built from telemetry holds the last
W iterations every stage reported, per-layer times by global layer index (across a
re-partition), each link's newest bandwidth, each stage's latest device features
and the profile's static per-layer metrics; it round-trips through JSON."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from adaptipe.controllers import Decision, Keep, Observation, observe
from adaptipe.controllers.live import inputs
from adaptipe.controllers.replan import best_partition, predicted_time, stage_slowdowns
from adaptipe.controllers.threshold import Threshold, ThresholdSettings
from adaptipe.errors import PlanError
from adaptipe.monitor.features import FEATURES
from adaptipe.monitor.schema import DeviceSample, LinkSample, Record, StageStats
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import LayerProfile, Profile
from adaptipe.runtime.config import RunConfig
from adaptipe.sim.migration import MigrationCost, moved_layers

LAYERS = 6


def _profile() -> Profile:
    return Profile(
        model="m",
        microbatch=4,
        device="cpu",
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                kind="Linear",
                forward_s=0.001 * (i + 1),
                backward_s=0.002 * (i + 1),
                activation_bytes=100 * (i + 1),
                gradient_bytes=10 * (i + 1),
                saved_bytes=0,
                param_bytes=1000 * (i + 1),
                optimizer_bytes=2000 * (i + 1),
                num_params=250 * (i + 1),
            )
            for i in range(LAYERS)
        ),
    )


def _stats(it: int, stage: int, first: int, count: int, scale: float) -> StageStats:
    return StageStats(
        run_id="r",
        stage=stage,
        iteration=it,
        time_s=100.0 + it,
        first_layer=first,
        forward_s=tuple(scale * (first + i + 1) for i in range(count)),
        backward_s=tuple(2 * scale * (first + i + 1) for i in range(count)),
        compute_s=scale * 10,
        wait_s=0.0,
        comm_s=0.0,
        iteration_s=scale * 12,
    )


def _records() -> list[Record]:
    recs: list[Record] = []
    for it in range(12):
        # iterations 0-7 on bounds 0,3,6; from 8 on 0,2,6 (a re-partition)
        split = 3 if it < 8 else 2
        scale = 0.01 if it < 10 else 0.03  # stage work triples from iteration 10
        recs.append(_stats(it, 0, 0, split, scale))
        recs.append(_stats(it, 1, split, LAYERS - split, scale))
        recs.append(
            LinkSample(src=0, dst=1, time_s=100.0 + it, nbytes=1, seconds=1.0,
                       bandwidth_Bps=1e6 if it < 6 else 4e6)
        )  # fmt: skip
    recs.append(_stats(12, 0, 0, 2, 0.03))  # stage 1 has not reported iteration 12
    recs.append(DeviceSample(stage=0, time_s=99.0, source="cpu", fields={"cpu_util": 0.1}))
    recs.append(DeviceSample(stage=0, time_s=111.0, source="cpu", fields={"cpu_util": 0.9}))
    return recs


def test_an_observation_holds_the_last_complete_iterations_by_global_layer() -> None:
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 2, 6))
    obs = observe(_records(), _profile(), partition, window=4)
    assert obs.iterations == (8, 9, 10, 11) and obs.iteration == 11  # 12 is incomplete
    assert obs.bounds == (0, 2, 6) and obs.num_stages == 2 and obs.num_layers == LAYERS
    assert obs.measured_forward_s[0] == pytest.approx(tuple(0.01 * (i + 1) for i in range(6)))
    assert obs.measured_forward_s[-1] == pytest.approx(tuple(0.03 * (i + 1) for i in range(6)))
    assert obs.measured_backward_s[-1][5] == pytest.approx(0.36)
    assert obs.stage_compute_s == ((0.1, 0.1), (0.1, 0.1), (0.3, 0.3), (0.3, 0.3))
    assert obs.stage_iteration_s[2] == pytest.approx((0.36, 0.36))
    assert obs.link_bandwidth_Bps == {"0-1": 4e6}  # the newest sample
    assert len(obs.device) == 2 and len(obs.device[0]) == len(FEATURES)
    assert obs.device[1] == (0.0,) * len(FEATURES)  # stage 1 sent no device sample
    assert obs.layer_forward_s[2] == pytest.approx(0.003)
    assert obs.boundary_bytes[0] == 120 and obs.boundary_bytes[5] == 600  # out + grad in
    assert obs.state_bytes[5] == 18000
    assert Observation.from_json(obs.to_json()) == obs
    # stages report each layer's sum over an iteration's micro-batches: per micro-batch
    # it compares with a profile's (the planner's cycle is one micro-batch's)
    per = observe(_records(), _profile(), partition, window=4, microbatches=4)
    assert per.measured_forward_s[-1] == pytest.approx(tuple(0.0075 * (i + 1) for i in range(6)))
    assert per.stage_compute_s == obs.stage_compute_s and per.microbatches == 4
    assert Observation.from_json(per.to_json()) == per


def test_a_window_across_a_re_partition_keeps_each_layer_where_it_was_measured() -> None:
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 2, 6))
    obs = observe(_records(), _profile(), partition, window=6)
    assert obs.iterations == (6, 7, 8, 9, 10, 11)
    for row in obs.measured_forward_s:  # layer 2 moved from stage 0 to 1 at 8: never lost
        assert not any(math.isnan(v) for v in row)
    assert obs.link_bandwidth_Bps["0-1"] == pytest.approx(4e6)
    # a window reaching back to the 1 MB/s samples still reads the link as it is now
    longer = observe(_records(), _profile(), partition, window=10)
    assert longer.iterations[0] == 2 and longer.link_bandwidth_Bps["0-1"] == 4e6


def test_a_boundary_reads_at_its_slower_direction() -> None:
    """Activations cross a boundary one way and gradients the other: a link throttled
    only from stage 1 to stage 0 prices the boundary, and so the planner's choice."""
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 2, 6))
    obs = observe(_records(), _profile(), partition, window=4)
    assert obs.boundary_bandwidth_Bps(0) == 4e6  # only 0 -> 1 measured
    slow_back = replace(obs, link_bandwidth_Bps={"0-1": 4e6, "1-0": 100.0})
    assert slow_back.boundary_bandwidth_Bps(0) == 100.0
    assert replace(obs, link_bandwidth_Bps={"1-0": 1e5}).boundary_bandwidth_Bps(0) == 1e5
    assert replace(obs, link_bandwidth_Bps={}).boundary_bandwidth_Bps(0) == math.inf
    # the planner prices the boundary at the slow direction, and a decision logs it
    assert predicted_time(slow_back, (0, 2, 6)) > predicted_time(obs, (0, 2, 6))
    throttled = replace(obs, link_bandwidth_Bps={"0-1": 4e6, "1-0": 2.5e6})
    assert inputs(throttled)["links_MBps"] == [2.5]
    assert inputs(replace(obs, link_bandwidth_Bps={}))["links_MBps"] == [None]


def test_observe_refuses_what_it_cannot_build() -> None:
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 3, 6))
    with pytest.raises(PlanError, match="no iteration has been reported by every stage"):
        observe([_stats(0, 0, 0, 3, 0.01)], _profile(), partition)
    with pytest.raises(PlanError, match="the profile has 6 layers, the partition 8"):
        observe(_records(), _profile(), Partition(model="m", num_layers=8, bounds=(0, 4, 8)))
    with pytest.raises(PlanError, match="window must be >= 1"):
        observe(_records(), _profile(), partition, window=0)
    with pytest.raises(PlanError, match="not an observation"):
        Observation.from_json({"kind": "profile"})


def test_the_static_plan_never_moves() -> None:
    obs = observe(_records(), _profile(), Partition(model="m", num_layers=6, bounds=(0, 2, 6)))
    decision = Keep().decide(obs)
    assert not decision.moves and decision.to_json()["bounds"] is None
    assert Decision(bounds=(0, 3, 6), reason="x").moves


def test_an_observation_from_a_real_runs_telemetry(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    from adaptipe.monitor.runlog import load_run
    from adaptipe.profile import profile_model
    from adaptipe.runtime.launch import train
    from adaptipe.runtime.rundir import RunDir

    cfg = make_config(
        train={"iterations": 12, "telemetry": True, "telemetry_interval_s": 0.1,
               "run_dir": str(tmp_path / "run")}
    )  # fmt: skip
    train(cfg)
    run = RunDir(tmp_path / "run")
    log = load_run(run.root)
    profile = profile_model(cfg.model.spec(), microbatch=4, warmup=0, repeats=1)
    obs = observe(log.records, profile, run.read_partition())
    assert obs.iteration == 11 and len(obs.iterations) == 8
    assert all(v > 0 for row in obs.measured_forward_s for v in row)
    assert obs.bounds == run.read_partition().bounds
    assert Observation.from_json(obs.to_json()) == obs


def _synthetic(work: list[float], stages: int, bandwidth: float, nbytes: int) -> Observation:
    n = len(work)
    bounds = tuple(round(k * n / stages) for k in range(stages + 1))
    return Observation(
        iteration=0,
        bounds=bounds,
        layer_forward_s=tuple(w / 3 for w in work),
        layer_backward_s=tuple(2 * w / 3 for w in work),
        boundary_bytes=(nbytes,) * n,
        state_bytes=(0,) * n,
        link_bandwidth_Bps={f"{s}-{s + 1}": bandwidth for s in range(stages - 1)},
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_best_partition_is_the_least_predicted_one_of_all(seed: int) -> None:
    """Optimality on small instances: the programme against every partition."""
    import itertools
    import random

    rng = random.Random(seed)
    n, stages = rng.randint(4, 9), rng.randint(2, 4)
    obs = _synthetic([rng.uniform(0.1, 2.0) for _ in range(n)], stages, rng.choice([1e3, 1e9]),
                     rng.choice([0, 500]))  # fmt: skip
    slow = tuple(rng.choice([1.0, 1.0, 2.5]) for _ in range(stages))
    bounds, t = best_partition(obs, slow)
    every = [(0, *cut, n) for cut in itertools.combinations(range(1, n), stages - 1)]
    least = min(predicted_time(obs, b, slow) for b in every)
    assert t == pytest.approx(least) and predicted_time(obs, bounds, slow) == pytest.approx(t)
    assert bounds[0] == 0 and bounds[-1] == n and all(a < b for a, b in itertools.pairwise(bounds))


def test_a_slow_stage_gets_fewer_layers_and_slowdowns_come_from_measurements() -> None:
    obs = _synthetic([1.0] * 8, 2, 1e12, 0)
    assert best_partition(obs, (1.0, 1.0))[0] == (0, 4, 8)
    assert best_partition(obs, (1.0, 3.0))[0] == (0, 6, 8)  # 6 x 1 against 2 x 3
    measured = replace(
        obs,
        measured_forward_s=(tuple(1 / 3 for _ in range(4)) + tuple(1.0 for _ in range(4)),),
        measured_backward_s=(tuple(2 / 3 for _ in range(4)) + tuple(2.0 for _ in range(4)),),
    )
    assert stage_slowdowns(measured) == pytest.approx((1.0, 3.0))
    assert best_partition(measured)[0] == (0, 6, 8)
    with pytest.raises(PlanError, match="2 slowdowns for 3 stages"):
        best_partition(_synthetic([1.0] * 6, 3, 1e9, 0), (1.0, 1.0))


def _slowed_records(iterations: int, slow_from: int, factor: float) -> list[Record]:
    """Two stages on bounds 0,3,6 of `_profile`; stage 1 runs ``factor`` x slower from
    iteration ``slow_from``; each stage's iteration time is the slower one's compute."""
    prof = _profile()
    recs: list[Record] = []
    for it in range(iterations):
        slow = factor if it >= slow_from else 1.0
        per = [(0, 3, 1.0), (1, 3, slow)]
        times = [
            sum(slow_s * (prof.layers[i].forward_s + prof.layers[i].backward_s)
                for i in range(3 * stage, 3 * stage + 3))
            for stage, _, slow_s in per
        ]  # fmt: skip
        for stage, count, slow_s in per:
            first = 3 * stage
            recs.append(
                StageStats(
                    run_id="r", stage=stage, iteration=it, time_s=100.0 + it,
                    first_layer=first,
                    forward_s=tuple(slow_s * prof.layers[first + i].forward_s for i in range(count)),
                    backward_s=tuple(
                        slow_s * prof.layers[first + i].backward_s for i in range(count)
                    ),
                    compute_s=times[stage], wait_s=0.0, comm_s=0.0, iteration_s=max(times),
                )
            )  # fmt: skip
    return recs


def test_the_threshold_controller_moves_after_k_checks_over_the_margin() -> None:
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 3, 6))
    balanced = replace(_synthetic([0.3] * 8, 2, 1e12, 0), stage_iteration_s=((1.2, 1.2),))
    steady = Threshold(ThresholdSettings(patience=1))
    assert "within the margin 0/1 checks" in steady.decide(balanced).reason  # 1.2 s = best
    # slower iterations with no layer slower (overhead, waits): nothing a move would gain
    slower = replace(balanced, stage_iteration_s=((2.0, 2.0),))
    said = steady.decide(slower).reason
    assert "iteration measured 2000.0 ms" in said and "within the margin 0/1" in said
    controller = Threshold(ThresholdSettings(patience=3, cooldown=10, horizon=100))
    recs = _slowed_records(30, 10, 3.0)
    decisions = []
    for upto in (20, 21, 22):  # three checks, all in the slowed phase
        obs = observe([r for r in recs if r.iteration < upto], _profile(), partition, window=4)  # type: ignore[attr-defined]
        decisions.append(controller.decide(obs))
    assert [d.moves for d in decisions] == [False, False, True]
    assert "1/3 checks" in decisions[0].reason and "2/3 checks" in decisions[1].reason
    moved = decisions[-1]
    assert moved.bounds is not None and moved.bounds[1] > 3  # stage 1 gives layers away
    assert moved.predicted_gain_s is not None and moved.predicted_gain_s > 0
    again = observe([r for r in recs if r.iteration < 25], _profile(), partition, window=4)  # type: ignore[attr-defined]
    for _ in range(3):
        late = controller.decide(again)
    assert not late.moves and "cooling down since iteration 21" in late.reason


def test_the_threshold_controller_weighs_the_move_and_counts_moves_per_hour() -> None:
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 3, 6))
    obs = observe(_slowed_records(12, 0, 3.0), _profile(), partition, window=4)
    costly = Threshold(ThresholdSettings(patience=1, horizon=1), cost=MigrationCost(fixed_s=10.0))
    decision = costly.decide(obs)
    assert not decision.moves and "does not pay the move's 10.0" in decision.reason
    now = [0.0]
    capped = Threshold(
        ThresholdSettings(patience=1, cooldown=0, max_per_hour=2), clock=lambda: now[0]
    )
    assert [capped.decide(obs).moves for _ in range(3)] == [True, True, False]
    assert "2 moves in the last hour" in capped.decide(obs).reason
    now[0] = 3601.0
    assert capped.decide(obs).moves
    with pytest.raises(PlanError, match="patience must be >= 1"):
        ThresholdSettings(patience=0)


def test_the_threshold_controller_waits_a_check_its_model_cannot_explain() -> None:
    """A throttled link slows the iterations a check or two before its readings come:
    a check measured far beyond what the model puts the partition at waits, neither
    counting toward the patience nor breaking it, and only once while it lasts."""
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 3, 6))
    quiet = observe(_slowed_records(12, 100, 1.0), _profile(), partition, window=4)
    slowed = observe(_slowed_records(12, 0, 3.0), _profile(), partition, window=4)
    unexplained = replace(
        slowed,
        stage_iteration_s=tuple(tuple(5 * t for t in row) for row in slowed.stage_iteration_s),
    )
    controller = Threshold(ThresholdSettings(patience=2, cooldown=0, margin=0.5))
    for _ in range(3):
        assert "within the margin 0/2" in controller.decide(quiet).reason
    assert "within the margin 1/2" in controller.decide(slowed).reason
    held = controller.decide(unexplained)
    assert not held.moves and "waiting a check for the telemetry" in held.reason
    assert "(1/2 checks)" in held.reason and not controller.settled()
    assert controller.decide(slowed).moves  # the second check over the margin
    # a model that never catches up: one check waits, then the factor is the usual one
    stuck = Threshold(ThresholdSettings(patience=2, cooldown=0, margin=0.5))
    for _ in range(3):
        stuck.decide(quiet)
    assert [stuck.decide(unexplained).moves for _ in range(3)] == [False, False, True]
    state = stuck.state_dict()
    assert len(state["factors"]) == 2  # afresh after the wait
    # the hold survives a resume: the factors come back with the state
    resumed = Threshold(ThresholdSettings(patience=2, cooldown=0, margin=0.5))
    for _ in range(3):
        resumed.decide(quiet)
    again = Threshold(ThresholdSettings(patience=2, cooldown=0, margin=0.5))
    again.load_state_dict(resumed.state_dict())
    assert "waiting a check" in again.decide(unexplained).reason
    never = Threshold(ThresholdSettings(patience=2, cooldown=0, margin=0.5, unexplained=0))
    for _ in range(3):
        never.decide(quiet)
    assert [never.decide(unexplained).moves for _ in range(2)] == [False, True]
    with pytest.raises(PlanError, match="unexplained must be 0 or > 1"):
        ThresholdSettings(unexplained=0.5)


def test_the_migration_cost_fits_its_own_figures_and_prices_the_moving_layers() -> None:
    truth = MigrationCost(fixed_s=0.02, efficiency=0.5)
    samples = [(n, bw, truth.stall_s(n, bw)) for n in (1 << 20, 8 << 20) for bw in (1e8, 1e9)]
    fitted = MigrationCost.fit(samples)
    assert fitted.fixed_s == pytest.approx(0.02) and fitted.efficiency == pytest.approx(0.5)
    assert truth.stall_s(0, 1e9) == 0.0
    assert moved_layers((0, 3, 6), (0, 5, 6)) == [3, 4]
    assert moved_layers((0, 1, 2, 6), (0, 3, 4, 6)) == [1, 2, 3]
    with pytest.raises(PlanError, match="does not grow"):
        MigrationCost.fit([(1, 1.0, 2.0), (2, 1.0, 1.0)])
