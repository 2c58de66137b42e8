"""Replicated stages (PipeDream 1F1B-RR): a stage run by r workers, micro-batch m on
replica m mod r, gradients all-reduced before the step. Runs equal single-process
training; the replicas' instruction lists match and run to the end; what replicated
stages do not run is refused with the field that asks for it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError, ScheduleError
from adaptipe.models import get_model
from adaptipe.plan.partition import Partition
from adaptipe.runtime import resolve_plans, train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.reference import train_reference
from adaptipe.runtime.rundir import RunDir
from adaptipe.schedule.build import build_schedule
from adaptipe.schedule.replicate import (
    ReplicaLayout,
    replica_program,
    replica_walk,
    validate_replicated,
)
from adaptipe.schedule.types import (
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGradient,
    SendActivation,
    SendGradient,
)
from adaptipe.sim.costs import CostModel
from adaptipe.sim.engine import simulate
from adaptipe.sim.replicas import (
    WARMUP_RULES,
    replicated_one_f_one_b,
    replicated_throughput,
)
from tests.conftest import final_state
from tests.test_recipe_runtime import _plain_clipped

# ---------------------------------------------------------------- layout and streams


def test_replica_zero_keeps_the_stage_rank_and_extras_follow() -> None:
    layout = ReplicaLayout((2, 1, 3))
    assert layout.world == 6
    assert [layout.place(r) for r in range(6)] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1),
        (2, 1),
        (2, 2),
    ]
    assert all(layout.rank(*layout.place(r)) == r for r in range(6))
    assert layout.ranks(2) == (2, 4, 5)
    assert layout.owner(2, 7) == layout.rank(2, 1)


def test_replica_program_holds_its_microbatches_and_routes_peers() -> None:
    layout = ReplicaLayout((1, 2))
    schedule = build_schedule("1f1b", stages=2, microbatches=5)
    first = replica_program(schedule, layout, 0)
    sends = {i.microbatch: i.peer for i in first if isinstance(i, SendActivation)}
    assert sends == {0: 1, 1: 2, 2: 1, 3: 2, 4: 1}
    for rank, mine in ((1, {0, 2, 4}), (2, {1, 3})):
        program = replica_program(schedule, layout, rank)
        done = {i.microbatch for i in program if isinstance(i, Forward | Backward)}
        assert done == mine
        assert all(i.peer == 0 for i in program if isinstance(i, RecvActivation | SendGradient))
        assert program[-1] == OptimizerStep(job=0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("replicas", [(1, 2), (2, 1), (2, 2), (3, 1), (1, 3), (2, 3, 1), (1, 1, 4)])
@pytest.mark.parametrize("microbatches", [4, 5, 7])
def test_replicated_streams_validate(
    name: str, replicas: tuple[int, ...], microbatches: int
) -> None:
    schedule = build_schedule(name, stages=len(replicas), microbatches=microbatches)
    validate_replicated(schedule, ReplicaLayout(replicas))


def test_validation_finds_an_unmatched_transfer_and_a_deadlock() -> None:
    layout = ReplicaLayout((1, 2))
    schedule = build_schedule("gpipe", stages=2, microbatches=4)
    # Stage 1's list without micro-batch 3's receive: the stage-level check names it.
    lst = tuple(
        i for i in schedule.stages[1] if not (isinstance(i, RecvActivation) and i.microbatch == 3)
    )
    broken = replace(schedule, stages=(schedule.stages[0], lst))
    with pytest.raises(ScheduleError, match="no earlier RecvActivation"):
        validate_replicated(broken, layout)
    # Stage 0 waits for micro-batch 0's gradient before it sends micro-batch 1, and stage
    # 1 takes micro-batch 1 first: one worker per stage deadlocks, two replicas of
    # stage 1 (one per micro-batch) do not.
    first = (
        Forward(0, 0), SendActivation(0, 0, 0, 1), RecvGradient(0, 0, 0, 1), Backward(0, 0),
        Forward(0, 1), SendActivation(0, 1, 0, 1), RecvGradient(0, 1, 0, 1), Backward(0, 1),
        OptimizerStep(0),
    )  # fmt: skip
    second = (
        *(
            ins
            for m in (1, 0)
            for ins in (
                RecvActivation(0, m, 0, 0), Forward(0, m), Backward(0, m), SendGradient(0, m, 0, 0)
            )
        ),
        OptimizerStep(0),
    )  # fmt: skip
    crossed = replace(build_schedule("gpipe", stages=2, microbatches=2), stages=(first, second))
    with pytest.raises(ScheduleError, match=r"deadlocks: blocked rank 0 \(stage 0 replica 0\)"):
        replica_walk(crossed, ReplicaLayout((1, 1)))
    replica_walk(crossed, ReplicaLayout((1, 2)))


def test_validation_refuses_what_does_not_replicate() -> None:
    with pytest.raises(ScheduleError, match="schedules gpipe, 1f1b only"):
        validate_replicated(
            build_schedule("pipedream", stages=2, microbatches=4), ReplicaLayout((1, 2))
        )
    with pytest.raises(ScheduleError, match="every replica needs one"):
        validate_replicated(build_schedule("1f1b", stages=2, microbatches=2), ReplicaLayout((3, 1)))
    with pytest.raises(ScheduleError, match="one entry per stage"):
        validate_replicated(build_schedule("1f1b", stages=2, microbatches=4), ReplicaLayout((2,)))


# ---------------------------------------------------------------- numerics


def _reference(cfg: RunConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    spec = get_model(cfg.model.name, **cfg.model.config)
    plans = resolve_plans(cfg)
    result = train_reference(
        spec=spec,
        schedule=plans.schedule,
        partition=plans.partition,
        make_optimizer=cfg.optimizer.build,
        batch_size=cfg.data.batch_size,
        iterations=cfg.iterations_total(len(spec.dataset(split=cfg.data.split))),
        seed=cfg.train.seed,
        data_seed=cfg.data.seed,
    )
    return result.params, list(result.losses)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )


def _replicated_run(
    make_config: Callable[..., RunConfig],
    schedule: str,
    replicas: list[int],
    microbatches: int,
    **extra: dict[str, Any],
) -> RunConfig:
    data = {"batch_size": 4 * microbatches, "microbatches": microbatches}
    return make_config(
        pipeline={"stages": len(replicas), "schedule": schedule, "replicas": replicas},
        data=data,
        optimizer={"name": "adam", "lr": 0.01, "momentum": 0.0},
        **extra,
    )


@pytest.mark.parametrize(
    ("schedule", "replicas", "microbatches"),
    [
        pytest.param("gpipe", [1, 2], 4, id="gpipe-1x2-m4", marks=pytest.mark.slow),
        pytest.param("1f1b", [2, 1], 4, id="1f1b-2x1-m4"),
        pytest.param("1f1b", [1, 2], 5, id="1f1b-1x2-m5-uneven"),
        pytest.param("gpipe", [2, 1], 3, id="gpipe-2x1-m3-uneven", marks=pytest.mark.slow),
        pytest.param("1f1b", [2, 2], 4, id="1f1b-2x2-m4", marks=pytest.mark.slow),
    ],
)
def test_replicated_stages_match_single_process(
    make_config: Callable[..., RunConfig], schedule: str, replicas: list[int], microbatches: int
) -> None:
    cfg = _replicated_run(make_config, schedule, replicas, microbatches)
    summary = train(cfg)
    assert summary.iterations == 3
    run = RunDir(summary.run_dir)
    want, losses = _reference(cfg)
    _assert_close(final_state(summary.run_dir, layers=True), want)
    # One merged record per iteration, with the loss of every micro-batch (a replicated
    # last stage all-reduces them), and the checkpoint in the unreplicated format.
    metrics = run.read_metrics()
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-6)
    found = ckpt.latest(run.checkpoints)
    assert found is not None
    committed = json.loads((found / ckpt.COMMITTED).read_text())
    assert committed["num_stages"] == len(replicas)
    extra = sorted(p.name for p in (run.root / "stages").glob("*.replica-*.jsonl"))
    want_extra = [
        f"stage-{s}.replica-{k}.jsonl" for s, r in enumerate(replicas) for k in range(1, r)
    ]
    assert extra == want_extra


def test_clipping_by_the_global_norm_counts_each_replicated_stage_once(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = make_config(
        pipeline={"stages": 2, "schedule": "1f1b", "replicas": [2, 1]},
        optimizer={"clip_grad_norm": 0.05, "schedule": "constant", "warmup": 0},
    )
    got = final_state(train(cfg).run_dir, layers=True)
    _assert_close(got, _plain_clipped(cfg))


@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs",
    [{"recompute": True}, {"batch_weight_grads": True}],
    ids=["recompute", "batch-weight-grads"],
)
def test_replicated_stages_with_recompute_or_batched_weight_grads_match(
    make_config: Callable[..., RunConfig], knobs: dict[str, bool]
) -> None:
    cfg = make_config(
        pipeline={"stages": 2, "schedule": "1f1b", "replicas": [2, 2], **knobs},
        optimizer={"name": "adam", "lr": 0.01, "momentum": 0.0},
    )
    summary = train(cfg)
    _assert_close(final_state(summary.run_dir, layers=True), _reference(cfg)[0])


@pytest.mark.slow
def test_a_replicated_run_resumes_from_its_checkpoint(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = _replicated_run(
        make_config, "1f1b", [1, 2], 4, train={"iterations": 4, "checkpoint_every": 2}
    )
    whole = train(cfg)
    want = final_state(whole.run_dir, layers=True)
    run = Path(whole.run_dir)
    # Keep the checkpoint of iteration 2 only, and go on from there.
    for found in (run / "checkpoints").iterdir():
        if found.name.endswith("4"):
            import shutil

            shutil.rmtree(found)
    resumed = train(cfg, run_dir=run, resume=True)
    assert resumed.iterations == 2
    _assert_close(final_state(resumed.run_dir, layers=True), want)


def test_a_plan_files_replicas_reach_the_run(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    spec = get_model("mlp", in_features=8, hidden=16, depth=6, out_features=4, num_samples=256)
    plan = Partition(model=spec.name, num_layers=spec.num_layers, bounds=(0, 2, 6), replicas=(1, 2))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    cfg = make_config(pipeline={"stages": 2, "partition": str(path)})
    plans = resolve_plans(cfg)
    assert plans.partition.replicas == (1, 2)
    with pytest.raises(PlanError, match=r"differs from the replicas \[1, 2\]"):
        resolve_plans(
            make_config(pipeline={"stages": 2, "partition": str(path), "replicas": [2, 1]})
        )
    with pytest.raises(
        PlanError,
        match=r"^test.toml: \[pipeline\].partition = '.*plan.json': replicas = \[1, 2\] "
        r"replicates a stage, which \[pipeline\].schedule = '2bw' does not allow",
    ):
        resolve_plans(
            make_config(pipeline={"stages": 2, "partition": str(path), "schedule": "2bw"})
        )


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("sections", "match"),
    [
        (
            {"pipeline": {"replicas": [1, 2, 1]}},
            r"\[pipeline\].replicas = \[1, 2, 1\] must hold one",
        ),
        (
            {"pipeline": {"replicas": [0, 2]}},
            r"\[pipeline\].replicas must be a list of integers >= 1",
        ),
        ({"pipeline": {"replicas": "2"}}, r"\[pipeline\].replicas must be a list"),
        (
            {"pipeline": {"replicas": [1, 2], "schedule": "pipedream"}},
            r"\[pipeline\].schedule = 'pipedream' does not allow: .*allowed: gpipe, 1f1b",
        ),
        (
            {"pipeline": {"replicas": [1, 2], "schedule": "2bw", "update_every": 2}},
            r"\[pipeline\].schedule = '2bw' does not allow",
        ),
        (
            {"pipeline": {"replicas": [1, 2], "schedule": "interleaved", "virtual": 2}},
            r"\[pipeline\].schedule = 'interleaved' does not allow",
        ),
        (
            {"pipeline": {"replicas": [1, 4]}, "data": {"batch_size": 12, "microbatches": 3}},
            r"\[data\].microbatches = 3 does not allow: every replica needs a micro-batch",
        ),
        (
            {
                "pipeline": {"replicas": [1, 2]},
                "adapt": {"repartition": [{"iteration": 1, "bounds": [0, 4, 6]}]},
            },
            r"\[adapt\] does not allow: moving layers between replicated stages",
        ),
        (
            {"pipeline": {"replicas": [1, 2]}, "train": {"stage_memory_mb": 4000}},
            r"\[train\].stage_memory_mb does not allow",
        ),
        (
            {
                "pipeline": {"replicas": [1, 2]},
                "data": {"microbatches": 1},
                "sweep": {"jobs": [{"lr": 0.1}, {"lr": 0.2}]},
            },
            r"\[sweep\] does not allow: job-arrays",
        ),
    ],
)
def test_unsupported_replications_are_refused(
    make_config: Callable[..., RunConfig], sections: dict[str, Any], match: str
) -> None:
    with pytest.raises(PlanError, match=match):
        make_config(**sections)


def test_a_replicated_run_refuses_layer_moves_asked_while_it_trains(
    make_config: Callable[..., RunConfig],
) -> None:
    from adaptipe.runtime.adapt_requests import request_adapt
    from adaptipe.runtime.launch import prepare
    from adaptipe.runtime.repartition import repartition

    run, _ = prepare(make_config(pipeline={"replicas": [1, 2]}))
    assert run.read_partition().replicas == (1, 2)
    with pytest.raises(PlanError, match=r"partition.json: replicas \[1, 2\] .*layers do not move"):
        repartition(run.root, [0, 2, 6])
    with pytest.raises(PlanError, match=r"replicas \[1, 2\] .*allowed here: --controller none"):
        request_adapt(run.root, controller="threshold")
    request_adapt(run.root, paused=True)  # pausing is fine
    # A worker that dies is named by its stage and replica.
    from adaptipe.runtime.supervisor import failure

    assert str(failure(run, 2, 1)).startswith("stage 1 replica 1 (rank 2) failed: exited")
    assert str(failure(run, 1, 1)).startswith("stage 1 failed")


def test_unreplicated_lists_run_as_before(make_config: Callable[..., RunConfig]) -> None:
    cfg = make_config(pipeline={"replicas": [1, 1]})
    assert cfg.pipeline.processes == 2
    assert resolve_plans(cfg).partition.replicas == (1, 1)


def test_adaptipe_plan_says_how_to_train_its_replicated_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from adaptipe.cli import main
    from adaptipe.profile.types import LayerProfile, Profile

    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            kind="Linear",
            forward_s=0.001 * (4 if i >= 3 else 1),
            backward_s=0.002 * (4 if i >= 3 else 1),
            activation_bytes=100,
            gradient_bytes=100,
            saved_bytes=0,
            param_bytes=1000,
            optimizer_bytes=2000,
            num_params=250,
        )
        for i in range(6)
    )
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(Profile(model="m", microbatch=4, device="cpu", layers=layers).to_json())
    )
    out = tmp_path / "plan.json"
    args = ["plan", "--profile", str(profile), "--planner", "pipedream"]
    assert main([*args, "--levels", "4:100GB/s", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    replicas = Partition.from_json(json.loads(out.read_text())).replicas
    assert max(replicas) > 1
    assert f"run as {sum(replicas)} processes" in printed and '"1f1b"' in printed
    wide = ["--planner", "2bw", "--devices", "4", "--batch-size", "64", "--memory-limit", "1GiB"]
    assert main(["plan", "--profile", str(profile), *wide]) == 0
    printed = capsys.readouterr().out
    assert "does not run yet" not in printed
    if "x width 1," not in printed:
        assert "replicas = [" in printed and 'schedule = "1f1b"' in printed


# ---------------------------------------------------------------- the simulator


def test_the_replica_simulator_times_an_unreplicated_pipeline_as_the_engine_does() -> None:
    for name in ("gpipe", "1f1b"):
        schedule = build_schedule(name, stages=3, microbatches=6)
        costs = CostModel(
            forward_s=[[1.0, 2.0, 1.5]], backward_s=[[2.0, 3.0, 2.5]], update_s=[[0.5, 0.2, 0.1]]
        )
        want = simulate(schedule, costs).makespan
        got = replicated_throughput(
            schedule,
            (1, 1, 1),
            forward_s=(1.0, 2.0, 1.5),
            backward_s=(2.0, 3.0, 2.5),
            update_s=(0.5, 0.2, 0.1),
        )
        assert got.makespan_s == pytest.approx(want)


def test_replicating_the_slow_stage_raises_simulated_throughput() -> None:
    times = {"forward_s": (1.0, 2.0), "backward_s": (2.0, 4.0), "allreduce_s": 0.1}
    for name, least in (("gpipe", 1.7), ("1f1b", 1.25), ("1f1b-rr", 1.65)):
        schedule = (
            replicated_one_f_one_b(2, 8, (1, 2))
            if name == "1f1b-rr"
            else build_schedule(name, stages=2, microbatches=8)
        )
        base = replicated_throughput(schedule, (1, 1), **times)  # type: ignore[arg-type]
        more = replicated_throughput(schedule, (1, 2), **times)  # type: ignore[arg-type]
        assert more.samples_per_s / base.samples_per_s > least


@pytest.mark.parametrize("replicas", [(1, 2), (2, 1), (2, 2), (1, 3, 1), (2, 1, 2), (1, 2, 1)])
def test_replicated_1f1b_warmups_beat_the_unreplicated_ones(replicas: tuple[int, ...]) -> None:
    stages, microbatches = len(replicas), 8
    chosen = replicated_one_f_one_b(stages, microbatches, replicas)
    validate_replicated(chosen, ReplicaLayout(replicas))
    assert chosen.meta["warmup_rule"] in WARMUP_RULES
    times = {
        "forward_s": [float(r) for r in replicas],
        "backward_s": [2.0 * r for r in replicas],
    }
    plain = build_schedule("1f1b", stages=stages, microbatches=microbatches)
    before = replicated_throughput(plain, replicas, **times)  # type: ignore[arg-type]
    after = replicated_throughput(chosen, replicas, **times)  # type: ignore[arg-type]
    assert after.makespan_s <= before.makespan_s
    assert replicated_one_f_one_b(stages, microbatches, (1,) * stages) == plain


def test_adaptipe_simulate_times_replicated_stages(capsys: pytest.CaptureFixture[str]) -> None:
    from adaptipe.cli import main

    argv = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "8"]
    assert main([*argv, "--slowdown", "1,2", "--replicas", "1,2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan"] == pytest.approx(out["replicated"]["unreplicated_makespan"])
    assert out["replicated"]["workers"] == 3 and out["replicated"]["speedup"] == pytest.approx(1.7)
    assert main([*argv, "--replicas", "1,x"]) != 0
    assert "--replicas '1,x' must be integers >= 1" in capsys.readouterr().err
