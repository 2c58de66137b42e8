"""Numerics under adaptation: a job-array whose layers a controller moves while it
trains ends with every job bitwise equal to the same run with those moves scripted
(``[[adapt.repartition]]``), and every job as trained alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from adaptipe.controllers.live import decider as live_decider
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import train
from tests.test_adapt_loop import _control
from tests.test_jobarray import _alone, _job_params

GRID = {"lr": [0.002, 0.005]}


def _array(make_config: Callable[..., RunConfig], run_dir: Path, adapt: dict) -> RunConfig:
    cfg = make_config(
        model={"config": {"hidden": 192, "num_samples": 4096}},
        data={"microbatches": 1, "batch_size": 32},
        train={"iterations": 40, "run_dir": str(run_dir)},
        adapt=adapt,
    )
    data = cfg.to_dict()
    data["sweep"] = {"grid": GRID, "window": 2}
    return RunConfig.from_dict(data, source="test.toml")


def test_controller_moves_in_a_job_array_equal_the_same_moves_scripted_and_each_job_alone(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    scenario = tmp_path / "slow.toml"
    scenario.write_text(
        '[[inject]]\nkind = "slowdown"\nat_iteration = 8\nstage = 1\nfactor = 4.0\n'
    )
    adaptive = _array(
        make_config,
        tmp_path / "adaptive",
        {"controller": "threshold", "check_every": 2, "window": 2, "patience": 1, "cooldown": 6},
    )
    train(adaptive, inject=scenario, decider=live_decider)
    events = _control(tmp_path / "adaptive")
    moves = [(e["iteration"], e["bounds"]) for e in events if e["event"] == "migration"]
    assert moves and all(e["ok"] for e in events if e["event"] == "migration"), events

    scripted = _array(
        make_config,
        tmp_path / "scripted",
        {"repartition": [{"iteration": it, "bounds": bounds} for it, bounds in moves]},
    )
    train(scripted)
    done = _control(tmp_path / "scripted")
    assert [(e["iteration"], e["bounds"]) for e in done if e["event"] == "migration"] == moves

    for job in adaptive.jobs:
        got = _job_params(str(tmp_path / "adaptive"), job.index)
        same = _job_params(str(tmp_path / "scripted"), job.index)
        assert got.keys() == same.keys() and got
        assert all(torch.isfinite(t).all() for t in got.values()), job.name
        for name in got:
            assert torch.equal(got[name], same[name]), f"{job.name} {name}"
        want = _alone(adaptive, job)
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{job.name} {name}"
            )


def test_a_job_array_decider_divides_each_layer_by_its_blocks_not_the_data_microbatches(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    """One block per job a round: a 4-job array of 16-sample jobs, profiled at 16, runs
    each layer 4 times an iteration (it divided by ``[data].microbatches``, 1, and every
    slowdown read about 4x); one job keeps ``[data].microbatches``."""
    from adaptipe.controllers.live import blocks_per_iteration

    single = make_config(data={"microbatches": 4, "batch_size": 64})
    assert blocks_per_iteration(single, None) == 4
    data = make_config(data={"microbatches": 1, "batch_size": 16}).to_dict()
    data["sweep"] = {"grid": {"lr": [0.01, 0.02, 0.03, 0.04]}}
    array = RunConfig.from_dict(data, source="test.toml")
    assert array.sweep is not None and len(array.sweep.jobs) == 4
    assert blocks_per_iteration(array, None) == 4
    data["sweep"] = {"grid": {"lr": [0.01, 0.02], "batch_size": [16, 32]}}  # 96 samples
    mixed = RunConfig.from_dict(data, source="test.toml")
    assert blocks_per_iteration(mixed, None) == 6
    assert mixed.sweep is not None
    small = [j for j, job in enumerate(mixed.sweep.jobs) if job.batch_size == 16]
    large = [j for j, job in enumerate(mixed.sweep.jobs) if job.batch_size == 32]
    assert blocks_per_iteration(mixed, None, jobs=small) == 2  # the jobs left: 32 samples
    assert blocks_per_iteration(mixed, None, jobs=large) == 4


def test_after_a_rung_the_live_decider_counts_the_jobs_left_and_their_iterations() -> None:
    """Successive halving stops jobs: per-layer sums of the iterations after a rung are
    divided by the blocks the jobs left run, and iterations of either side are never
    mixed in one window (the first checks after the rung wait for a whole iteration)."""
    from adaptipe.controllers.base import Keep
    from adaptipe.controllers.live import LiveDecider
    from adaptipe.monitor.schema import StageStats
    from adaptipe.plan.partition import Partition

    def stats(it: int, stage: int, version: int) -> StageStats:
        return StageStats(
            run_id="r", stage=stage, iteration=it, time_s=float(it), first_layer=3 * stage,
            forward_s=(0.01,) * 3, backward_s=(0.02,) * 3, compute_s=0.09, wait_s=0.0,
            comm_s=0.0, iteration_s=0.09, plan_version=version,
        )  # fmt: skip

    blocks = {0: 4, 1: 2}  # version 1 stopped half the jobs
    asked: list[int] = []

    def blocks_of(version: int) -> int:
        asked.append(version)
        return blocks[version]

    decider = LiveDecider(Keep(), None, window=2, workers=2, microbatches=4, blocks_of=blocks_of)
    partition = Partition(model="m", num_layers=6, bounds=(0, 3, 6))
    before = [stats(it, s, 0) for it in range(6) for s in (0, 1)]
    decider(before, partition)
    assert decider.microbatches == 4
    torn = [*before, stats(6, 0, 1)]  # stage 1 has not reported the rung's iteration yet
    verdict = decider(torn, partition)
    assert verdict.bounds is None and "active jobs changed" in verdict.decision["reason"]
    assert decider.microbatches == 2
    after = [*torn, stats(6, 1, 1)]
    assert decider._same_blocks(after, blocks_of) == [stats(6, 0, 1), stats(6, 1, 1)]
