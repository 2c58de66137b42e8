"""A job-array re-planned for a new partition: the per-layer costs kept at launch give
the new partition's JAPSP instance, the solver orders it again, and the workers unroll
their windows from the plan version's costs (not the run's first instance)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from adaptipe.errors import PlanError
from adaptipe.japsp.array import ArrayCosts, SolveSettings, solve_array
from adaptipe.japsp.evaluate import evaluate
from adaptipe.japsp.instance import JapspInstance
from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.control import JobController
from adaptipe.runtime.jobarray import window_for
from adaptipe.runtime.launch import prepare
from adaptipe.runtime.partition_plan import array_costs, for_partition
from adaptipe.runtime.planversion import PlanVersion, commit_plan, read_active, remap_jobs
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.windows import Windows
from adaptipe.schedule.types import Backward, Forward, Schedule
from adaptipe.schedule.validate import validate
from adaptipe.serial import load_json_file


def _costs(**kw: Any) -> ArrayCosts:
    return ArrayCosts(
        names=("a", "b"),
        forward=((1.0, 2.0, 3.0, 4.0), (10.0, 20.0, 30.0, 40.0)),
        backward=((2.0, 4.0, 6.0, 8.0), (20.0, 40.0, 60.0, 80.0)),
        update=((0.5, 0.5, 0.5, 0.5), (0.25, 0.25, 0.25, 0.25)),
        **kw,
    )


def _part(*bounds: int, layers: int = 4) -> Partition:
    return Partition(model="m", num_layers=layers, bounds=bounds)


def test_costs_sum_each_stages_layers_and_round_trip() -> None:
    costs = _costs(recompute=True, settings=SolveSettings(solver="bb", window=3, seed=7))
    inst = costs.instance(_part(0, 1, 4))
    assert inst.forward == ((1.0, 9.0), (10.0, 90.0))
    assert inst.backward == ((2.0, 18.0), (20.0, 180.0))
    assert inst.update == ((0.5, 1.5), (0.25, 0.75))
    assert inst.recompute == inst.forward  # a recomputed forward runs again before backward
    assert inst.names == ("a", "b")
    only_b = costs.instance(_part(0, 3, 4), jobs=[1])
    assert only_b.names == ("b",) and only_b.forward == ((60.0, 40.0),)
    assert ArrayCosts.from_json(costs.to_json()) == costs


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kind": "profile", "version": 1}, "kind must be 'japsp_array_costs'"),
        ({**_costs().to_json(), "forward": [[1.0]]}, "every table needs 2 rows of equal length"),
        ({**_costs().to_json(), "settings": {"window": 0}}, "window must be 'auto' or an integer"),
        ({**_costs().to_json(), "names": None}, "malformed array costs"),
    ],
)
def test_bad_cost_files_name_what_is_wrong(data: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        ArrayCosts.from_json(data, source="japsp-costs.json")


def test_costs_refuse_a_partition_of_another_model() -> None:
    with pytest.raises(PlanError, match="covers 6 layers, the costs 4"):
        _costs().instance(_part(0, 3, 6, layers=6))


def _array(make_config: Callable[..., RunConfig], solver: str) -> RunConfig:
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"iterations": 8},
    )
    data = cfg.to_dict()
    data["sweep"] = {"grid": {"lr": [0.05, 0.2], "batch_size": [8, 16]}, "solver": solver}
    return RunConfig.from_dict(data, source="test.toml")


@pytest.fixture
def prepared(make_config: Callable[..., RunConfig]) -> tuple[RunDir, RunConfig]:
    return prepare(_array(make_config, "bb"))


def test_the_runs_instance_is_its_costs_under_its_partition(
    prepared: tuple[RunDir, RunConfig],
) -> None:
    run, cfg = prepared
    costs = array_costs(run)
    assert costs is not None and costs.names == tuple(j.name for j in cfg.jobs)
    assert costs.settings == SolveSettings(solver="bb", time_limit_s=1.0, seed=cfg.train.seed)
    first = load_json_file(run.root / "japsp-instance.json", JapspInstance.from_json)
    assert costs.instance(run.read_partition()) == first  # bit for bit: the same sums


def _block_orders(schedule: Schedule) -> list[list[tuple[str, int]]]:
    return [
        [("F" if isinstance(i, Forward) else "B", i.job) for i in s if isinstance(i, Forward | Backward)]
        for s in schedule.stages
    ]  # fmt: skip


def test_a_new_partition_gets_its_costs_and_a_block_order_solved_for_them(
    prepared: tuple[RunDir, RunConfig],
) -> None:
    run, cfg = prepared
    costs = array_costs(run)
    assert costs is not None
    current = read_active(run, 0, cfg)
    skewed = Partition(model=cfg.model.name, num_layers=6, bounds=(0, 5, 6))
    plan = for_partition(run, current, skewed)
    assert plan.partition == skewed and plan.jobs == current.jobs
    assert plan.instance == costs.instance(skewed, current.jobs)
    validate(plan.schedule)
    assert plan.schedule.meta["makespan"] == pytest.approx(
        evaluate(plan.instance, _block_orders(plan.schedule)).makespan
    )
    # re-optimised: never longer on the new costs than the order solved for the old ones
    old_order_there = evaluate(plan.instance, _block_orders(current.schedule)).makespan
    assert plan.schedule.meta["makespan"] <= old_order_there + 1e-12
    # the same as solving the new instance from scratch with the run's settings
    again, _ = solve_array(plan.instance, costs.settings)
    assert _block_orders(again) == _block_orders(plan.schedule)
    committed = commit_plan(run, plan)
    assert read_active(run, committed.version).instance == plan.instance  # in the file
    # back to the run's own partition: its costs again
    home = for_partition(run, committed, None)
    assert home.partition is None and home.instance == costs.instance(run.read_partition())


def test_one_job_keeps_its_schedule_and_only_changes_partition(
    make_config: Callable[..., RunConfig],
) -> None:
    run, cfg = prepare(make_config(train={"iterations": 4}))
    assert array_costs(run) is None
    current = read_active(run, 0, cfg)
    plan = for_partition(run, current, Partition(model="mlp", num_layers=6, bounds=(0, 2, 6)))
    assert plan.schedule == current.schedule and plan.instance is None
    assert plan.partition is not None and plan.partition.bounds == (0, 2, 6)


def test_block_costs_follow_the_version_not_the_first_instance() -> None:
    base = JapspInstance.build([[1.0, 1.0]] * 4, [[2.0, 2.0]] * 4, names=list("abcd"))
    own = JapspInstance.build([[5.0, 1.0], [6.0, 1.0], [7.0, 1.0]], [[9.0, 9.0]] * 3)
    sched, _ = solve_array(own, SolveSettings(solver="1f1b", window=1))
    plain = PlanVersion(version=1, jobs=(0, 2, 3), schedule=sched)
    assert plain.block_costs(base) == base.select([0, 2, 3])
    moved = replace(plain, instance=own)
    assert moved.block_costs(base) == own
    assert moved.block_costs(base, [2, 3]).forward == ((6.0, 1.0), (7.0, 1.0))
    with pytest.raises(PlanError, match="the instance has 4 jobs but 3 are active"):
        PlanVersion.from_json({**moved.to_json(), "instance": base.to_json()}, source="a.json")


def test_workers_unroll_windows_from_the_versions_costs(
    prepared: tuple[RunDir, RunConfig],
) -> None:
    run, cfg = prepared
    first = load_json_file(run.root / "japsp-instance.json", JapspInstance.from_json)
    current = read_active(run, 0, cfg)
    plan = for_partition(run, current, Partition(model="mlp", num_layers=6, bounds=(0, 5, 6)))
    assert plan.instance is not None and plan.instance != first
    windows = Windows(cfg, first, stage=None, plan=current)  # type: ignore[arg-type]
    windows.adopt(replace(plan, version=1))
    jobs = (plan.jobs, len(cfg.jobs))
    assert windows._unrolled(3) == remap_jobs(window_for(plan.schedule, plan.instance, 3), *jobs)
    before = Windows(cfg, first, stage=None, plan=current)  # type: ignore[arg-type]
    assert before._unrolled(3) == remap_jobs(window_for(current.schedule, first, 3), *jobs)
    assert windows._unrolled(3) != before._unrolled(3)


def test_a_stop_after_a_move_plans_the_remaining_jobs_on_the_new_costs(
    prepared: tuple[RunDir, RunConfig],
) -> None:
    run, cfg = prepared
    first = load_json_file(run.root / "japsp-instance.json", JapspInstance.from_json)
    skewed = Partition(model=cfg.model.name, num_layers=6, bounds=(0, 1, 6))
    commit_plan(run, lambda newest: for_partition(run, newest, skewed))
    controller = JobController(run, cfg, first, total=8)
    events = controller._stop([1], reason="user", iteration=None)
    assert [e["event"] for e in events] == ["stop"]
    after = read_active(run, 2)
    costs = array_costs(run)
    assert costs is not None
    assert after.jobs == (0, 2, 3) and after.partition == skewed
    assert after.instance == costs.instance(skewed, [0, 2, 3])
    validate(after.schedule)
