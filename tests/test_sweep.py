"""[sweep] expands into a job-array; bad sweeps are clear errors naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from adaptipe.errors import PlanError
from adaptipe.japsp.window import auto_window
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir

BASE: dict[str, Any] = {
    "model": {
        "name": "mlp",
        "config": {"in_features": 8, "hidden": 16, "depth": 4, "out_features": 4},
    },
    "data": {"batch_size": 16, "microbatches": 1},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "pipeline": {"stages": 2},
    "train": {"iterations": 3, "seed": 5},
}


def _config(sweep: dict[str, Any], **over: dict[str, Any]) -> RunConfig:
    data = copy.deepcopy(BASE)
    for key, value in over.items():
        data[key].update(value)
    data["sweep"] = sweep
    return RunConfig.from_dict(data, source="sweep.toml")


def test_grid_expands_to_the_cartesian_product_in_order() -> None:
    cfg = _config({"grid": {"lr": [0.1, 0.01], "batch_size": [8, 16]}})
    jobs = cfg.jobs
    assert [(j.optimizer.lr, j.batch_size) for j in jobs] == [
        (0.1, 8),
        (0.1, 16),
        (0.01, 8),
        (0.01, 16),
    ]
    assert [j.index for j in jobs] == [0, 1, 2, 3]
    assert jobs[0].name == "lr=0.1,batch_size=8"
    assert all(j.seed == 5 and j.optimizer.momentum == 0.9 for j in jobs)  # the rest is inherited


def test_grid_jobs_are_named_by_the_axes_that_vary() -> None:
    cfg = _config({"grid": {"lr": [0.1, 0.2], "batch_size": [8], "seed": [1, 2]}})
    assert [j.name for j in cfg.jobs] == [
        "lr=0.1,seed=1",
        "lr=0.1,seed=2",
        "lr=0.2,seed=1",
        "lr=0.2,seed=2",
    ]
    assert all(j.batch_size == 8 for j in cfg.jobs)  # set, only not in the names
    (one,) = _config({"grid": {"lr": [0.1], "batch_size": [8]}}).jobs
    assert one.name == "lr=0.1,batch_size=8"  # nothing varies: every axis names it


def test_explicit_jobs_may_switch_optimizer_and_drop_momentum() -> None:
    cfg = _config(
        {
            "jobs": [
                {"name": "a", "lr": 0.1},
                {"name": "b", "optimizer": "adam", "lr": 1e-3, "seed": 9},
            ]
        }
    )
    a, b = cfg.jobs
    assert (a.optimizer.name, a.optimizer.momentum) == ("sgd", 0.9)
    assert (b.optimizer.name, b.optimizer.momentum, b.seed) == ("adam", 0.0, 9)


def test_sweep_round_trips_through_the_resolved_dict() -> None:
    cfg = _config({"grid": {"lr": [0.1, 0.01], "seed": [1, 2]}, "memory_budget": 2, "solver": "ga"})
    again = RunConfig.from_dict(cfg.to_dict(), source="sweep.toml")
    assert again.jobs == cfg.jobs
    assert again.sweep is not None and again.sweep.memory_budget == 2 and again.sweep.solver == "ga"


def test_without_a_sweep_the_run_is_a_one_job_array() -> None:
    data = copy.deepcopy(BASE)
    cfg = RunConfig.from_dict(data, source="x.toml")
    (job,) = cfg.jobs
    assert job.batch_size == 16 and job.seed == 5 and job.optimizer == cfg.optimizer
    assert job.data_seed == cfg.data.seed == 5  # the data order follows [train].seed


@pytest.mark.parametrize(
    ("data", "want"),
    [
        pytest.param({}, [5, 9, 1], id="no-data-seed: each job's own seed"),
        pytest.param({"seed": 3}, [3, 3, 1], id="data-seed-3: as alone, the config's"),
    ],
)
def test_a_jobs_data_order_follows_the_config_as_if_it_trained_alone(
    data: dict[str, Any], want: list[int]
) -> None:
    # Alone, a job's config would set [train].seed to the job's seed; its data order then
    # follows [data].seed where the config sets one, and [train].seed otherwise.
    jobs = [{"name": "a"}, {"name": "b", "seed": 9}, {"name": "c", "seed": 4, "data_seed": 1}]
    cfg = _config({"jobs": jobs}, data=data)
    assert [j.seed for j in cfg.jobs] == [5, 9, 4]
    assert [j.data_seed for j in cfg.jobs] == want
    again = RunConfig.from_dict(cfg.to_dict(), source="sweep.toml")  # config.json
    assert again.jobs == cfg.jobs


def test_a_run_directory_from_before_data_seeds_keeps_its_data_order(tmp_path: Path) -> None:
    # Such config.json files list jobs without data_seed; their data followed each seed.
    cfg = _config({"jobs": [{"name": "a", "seed": 1}, {"name": "b", "seed": 2}]}, data={"seed": 3})
    assert [j.data_seed for j in cfg.jobs] == [3, 3]
    old = cfg.to_dict()
    for job in old["sweep"]["jobs"]:
        del job["data_seed"]
    run = RunDir(tmp_path)
    run.config_json.write_text(json.dumps(old))
    assert [j.data_seed for j in run.read_config().jobs] == [1, 2]


@pytest.mark.parametrize(
    ("sweep", "over", "message"),
    [
        ({"grid": {"lrr": [0.1]}}, {}, "[sweep.grid].lrr is not a field (allowed: lr, batch_size"),
        ({"grid": {"lr": []}}, {}, "[sweep.grid].lr must be a non-empty list"),
        (
            {"grid": {"lr": [0.1]}, "jobs": [{"lr": 0.1}]},
            {},
            "exactly one of [sweep.grid] or [[sweep.jobs]]",
        ),
        ({}, {}, "exactly one of [sweep.grid] or [[sweep.jobs]]"),
        ({"jobs": []}, {}, "[[sweep.jobs]] must list at least one job"),
        ({"jobs": [{"lr": 0.1}, {"lr": -1.0}]}, {}, "[[sweep.jobs]][1].lr must be > 0 (got -1.0)"),
        ({"jobs": [{"lr": 0.1, "dropout": 0.1}]}, {}, "[[sweep.jobs]][0].dropout is not a field"),
        ({"jobs": [{"name": "x"}, {"name": "x"}]}, {}, "job names repeat (repeated: x)"),
        (
            {"grid": {"lr": [0.1, 0.1]}},
            {},
            "a [sweep.grid] list repeats a value (repeated: lr=0.1)",
        ),
        ({"grid": {"optimizer": ["lion"]}}, {}, "must be one of sgd, adam, adamw (got 'lion')"),
        (
            {"grid": {"lr": [0.1]}, "solver": "magic"},
            {},
            "[sweep].solver must be one of auto, bb, ga",
        ),
        (
            {"grid": {"lr": [0.1]}, "halving_keep": 1.5},
            {},
            "[sweep].halving_keep must be in (0, 1)",
        ),
        (
            {"grid": {"lr": [0.1]}},
            {"data": {"microbatches": 2}},
            "[data].microbatches must be 1 with a [sweep]",
        ),
        ({"grid": {"batch_size": [0]}}, {}, "batch_size must be >= 1"),
        (
            {"grid": {"lr": [0.1]}},
            {"pipeline": {"batch_weight_grads": True}},
            "[pipeline].batch_weight_grads has nothing to batch with a [sweep]",
        ),
        (
            {"grid": {"lr": [0.1]}},
            {"pipeline": {"schedule": "interleaved", "virtual": 2}},
            "[pipeline].virtual must be 1 with a [sweep]",
        ),
        (
            {"grid": {"lr": [0.1]}, "halving_every": -1},
            {},
            "[sweep].halving_every must be >= 0",
        ),
        (
            {"grid": {"lr": [0.1]}, "budget": 2},
            {},
            "[sweep].budget is not a field (allowed: grid, jobs, solver, memory_budget",
        ),
        ({"grid": {}}, {}, "[sweep.grid] is empty"),
        ({"grid": [1]}, {}, "[sweep.grid] must be a table of lists"),
        ({"grid": {"lr": [0.1]}, "memory_budget": -1}, {}, "[sweep].memory_budget must be >= 0"),
        (
            {"grid": {"lr": [0.1]}, "window": 0},
            {},
            '[sweep].window must be "auto" or an integer >= 1 (got 0)',
        ),
        (
            {"grid": {"lr": [0.1]}, "window": "4"},
            {},
            "[sweep].window must be \"auto\" or an integer >= 1 (got '4')",
        ),
        ({"grid": {"lr": [0.1]}, "time_limit_s": 0}, {}, "[sweep].time_limit_s must be > 0"),
        ({"grid": {"seed": [-1]}}, {}, "seed must be >= 0"),
        ({"grid": {"betas": [[0.9, 0.99]]}}, {}, "[sweep.grid].betas is not a field"),
        (
            {"jobs": [{"name": "a"}, {"name": "b", "betas": [0.8, 0.9]}]},
            {},
            "[[sweep.jobs]][1].betas is only for adam, adamw (got [0.8, 0.9] with optimizer = 'sgd')",
        ),
        ({"jobs": [{"eps": 1e-6}]}, {}, "[[sweep.jobs]][0].eps is only for adam, adamw (got 1e-06"),
        (
            {"jobs": [{"optimizer": "adamw", "nesterov": True}]},
            {},
            "[[sweep.jobs]][0].nesterov is only for sgd (got True with optimizer = 'adamw')",
        ),
        (
            {"grid": {"optimizer": ["sgd", "adam"], "momentum": [0.5]}},
            {},
            "[sweep.grid] (optimizer=adam,momentum=0.5).momentum is only for sgd "
            "(got 0.5 with optimizer = 'adam'); a grid crosses every optimizer with every "
            "value: list such jobs in [[sweep.jobs]] instead",
        ),
        (
            {"jobs": [{"momentum": 1.5}]},
            {},
            "[[sweep.jobs]][0].momentum must be in [0, 1) (got 1.5)",
        ),
        (
            {"grid": {"momentum": [0.5, 1.0]}},
            {},
            "[sweep.grid] (momentum=1.0).momentum must be in [0, 1) (got 1.0)",
        ),
        (
            {"jobs": [{"optimizer": "adam", "betas": [0.9, 1.5]}]},
            {},
            "[[sweep.jobs]][0].betas must be two numbers in [0, 1) (got [0.9, 1.5])",
        ),
        (
            {"grid": {"weight_decay": [-0.1]}},
            {},
            "[sweep.grid] (weight_decay=-0.1).weight_decay must be a number >= 0.0 (got -0.1)",
        ),
        (
            {"grid": {"lr": [0.1, 0.2]}, "halving_every": 3},
            {},
            "[sweep].halving_every must be 0 (off) or less than [train].iterations = 3, "
            "or no halving rung is ever reached (got 3)",
        ),
        (
            {"jobs": [{"lr": 0.1, "dropout": 0.1}]},
            {},
            "(allowed: name, lr, batch_size, weight_decay, momentum, optimizer, seed, data_seed, "
            "schedule, warmup, decay_iterations, min_lr_ratio, step_every, gamma, "
            "clip_grad_norm, nesterov, betas, eps)",
        ),
    ],
)
def test_bad_sweeps_name_the_field(
    sweep: dict[str, Any], over: dict[str, Any], message: str
) -> None:
    with pytest.raises(PlanError) as err:
        _config(sweep, **over)
    assert "sweep.toml" in str(err.value)
    assert message in str(err.value)


def test_a_field_the_jobs_optimizer_ignores_passes_only_as_the_value_it_has_anyway() -> None:
    # config.json lists every optimizer field for every job (betas on sgd jobs too), and
    # a run directory must load again; a value the job would not have is refused above.
    cfg = _config(
        {
            "jobs": [
                {"name": "a", "betas": [0.9, 0.999], "eps": 1e-8},
                {"name": "b", "optimizer": "adam", "momentum": 0.0, "nesterov": False},
            ]
        }
    )
    assert [j.optimizer.name for j in cfg.jobs] == ["sgd", "adam"]
    again = RunConfig.from_dict(cfg.to_dict(), source="sweep.toml")
    assert again.jobs == cfg.jobs


def test_halving_every_is_checked_against_iterations_only_when_the_config_gives_them() -> None:
    sweep = {"grid": {"lr": [0.1, 0.2]}, "halving_every": 2}
    cfg = _config(sweep)  # 3 iterations: a rung before iteration 2
    assert cfg.sweep is not None and cfg.sweep.halving_every == 2
    # By epochs the count depends on the dataset; the run itself finds out.
    long = {**sweep, "halving_every": 1000}
    cfg = _config(long, train={"iterations": None, "epochs": 1})
    assert cfg.sweep is not None and cfg.sweep.halving_every == 1000


@pytest.mark.parametrize("installed", [False, True])
def test_the_cpsat_solver_needs_ortools_installed(
    monkeypatch: pytest.MonkeyPatch, installed: bool
) -> None:
    monkeypatch.setattr("adaptipe.runtime.sweep.cpsat_available", lambda: installed)
    sweep = {"grid": {"lr": [0.1, 0.2]}, "solver": "cpsat"}
    if installed:
        cfg = _config(sweep)
        assert cfg.sweep is not None and cfg.sweep.solver == "cpsat"
        return
    with pytest.raises(PlanError) as err:
        _config(sweep)
    assert str(err.value) == (
        "sweep.toml: [sweep].solver 'cpsat' needs OR-Tools, which is not installed "
        "(pip install 'adaptipe[cpsat]'; or use another solver: auto, bb, ga, gpipe, 1f1b, rr)"
    )


def test_sweep_window_is_auto_unless_set_and_follows_the_running_jobs() -> None:
    auto = _config({"grid": {"lr": [0.1, 0.2, 0.3, 0.4]}}).sweep
    assert auto is not None and auto.window == "auto" and auto.to_dict()["window"] == "auto"
    assert auto.rounds(4, 2) == 13 and auto.rounds(2, 2) == 25  # longer as jobs stop
    fixed = _config({"grid": {"lr": [0.1, 0.2]}, "window": 3}).sweep
    assert fixed is not None and fixed.rounds(2, 2) == fixed.rounds(1, 4) == 3
    with pytest.raises(ValueError, match="needs jobs >= 1"):
        auto_window(0, 2)


def test_a_run_directory_written_before_the_stricter_checks_still_loads(tmp_path: Path) -> None:
    # Older versions accepted these; their saved config.json must stay readable (stop,
    # resume, export), while a new TOML with them is refused.
    data = copy.deepcopy(BASE)
    data["optimizer"]["momentum"] = 1.0
    data["sweep"] = {
        "jobs": [{"name": "a"}, {"name": "b", "betas": [0.8, 0.9]}],
        "halving_every": 3,
        "solver": "cpsat",
    }
    with pytest.raises(PlanError):
        RunConfig.from_dict(data, source="new.toml")
    cfg = RunConfig.from_dict(data, source="config.json", strict=False)
    assert cfg.sweep is not None and cfg.sweep.halving_every == 3
    assert cfg.jobs[1].optimizer.betas == (0.8, 0.9)
    run = RunDir(tmp_path / "old")
    run.root.mkdir()
    run.config_json.write_text(json.dumps(data))
    assert run.read_config().jobs == cfg.jobs
