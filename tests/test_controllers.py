"""The controller protocol's input: an `Observation` built from telemetry holds the last
W iterations every stage reported, per-layer times by global layer index (across a
re-partition), the window's mean link bandwidth, each stage's latest device features
and the profile's static per-layer metrics; it round-trips through JSON."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from adaptipe.controllers import Decision, Keep, Observation, observe
from adaptipe.errors import PlanError
from adaptipe.monitor.features import FEATURES
from adaptipe.monitor.schema import DeviceSample, LinkSample, Record, StageStats
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import LayerProfile, Profile
from adaptipe.runtime.config import RunConfig

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
    assert obs.link_bandwidth_Bps == {"0-1": 4e6}  # only the window's samples
    assert len(obs.device) == 2 and len(obs.device[0]) == len(FEATURES)
    assert obs.device[1] == (0.0,) * len(FEATURES)  # stage 1 sent no device sample
    assert obs.layer_forward_s[2] == pytest.approx(0.003)
    assert obs.boundary_bytes[0] == 110 and obs.state_bytes[5] == 18000
    assert Observation.from_json(obs.to_json()) == obs


def test_a_window_across_a_re_partition_keeps_each_layer_where_it_was_measured() -> None:
    partition = Partition(model="m", num_layers=LAYERS, bounds=(0, 2, 6))
    obs = observe(_records(), _profile(), partition, window=6)
    assert obs.iterations == (6, 7, 8, 9, 10, 11)
    for row in obs.measured_forward_s:  # layer 2 moved from stage 0 to 1 at 8: never lost
        assert not any(math.isnan(v) for v in row)
    assert obs.link_bandwidth_Bps["0-1"] == pytest.approx(4e6)


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
