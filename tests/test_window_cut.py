"""A job-array window cut short when a plan is committed mid-window: the instructions of
the rounds before the cut, in their order, are a valid window of that many rounds on
every stage; the stages post no receive of a round before they know it runs; and a run
whose plan arrives mid-window takes it on at the next iteration, every job exact."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.japsp.instance import JapspInstance
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.jobarray import window_for
from adaptipe.runtime.launch import train
from adaptipe.runtime.planversion import adoptions, current_version, read_active
from adaptipe.runtime.repartition import repartition
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.transport import ACTIVATION, TransferKey
from adaptipe.runtime.windowcut import WindowRounds, rounds_of
from adaptipe.schedule.build import build_schedule
from adaptipe.schedule.types import (
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGradient,
    Schedule,
)
from adaptipe.schedule.validate import validate


def _array_window(jobs: int, stages: int, rounds: int, budget: int, seed: int) -> Schedule:
    gen = torch.Generator().manual_seed(seed)
    fwd = (torch.rand(jobs, stages, generator=gen) + 0.5).tolist()
    inst = JapspInstance.build(fwd, [[2 * f for f in row] for row in fwd])
    base = build_schedule("1f1b", stages=stages, microbatches=jobs)  # jobs as micro-batches
    one_round = _jobs_as_one_round(base, jobs)
    return window_for(one_round, inst, rounds, budget=budget)


def _jobs_as_one_round(base: Schedule, jobs: int) -> Schedule:
    """1F1B over ``jobs`` micro-batches, read as one round of ``jobs`` jobs."""
    from adaptipe.japsp.compile import to_schedule

    orders = [
        [("F" if isinstance(i, Forward) else "B", i.microbatch) for i in stage
         if isinstance(i, Forward | Backward)]
        for stage in base.stages
    ]  # fmt: skip
    fwd = [[1.0] * base.num_stages for _ in range(jobs)]
    inst = JapspInstance.build(fwd, [[2.0] * base.num_stages for _ in range(jobs)])
    return to_schedule(inst, orders)


@pytest.mark.parametrize(
    ("jobs", "stages", "rounds", "budget", "seed"),
    [(2, 2, 4, 0, 0), (4, 2, 6, 0, 1), (4, 3, 5, 2, 2), (3, 4, 4, 0, 3), (8, 2, 5, 3, 4)],
)
def test_the_rounds_before_a_cut_are_a_valid_window_of_that_many_rounds(
    jobs: int, stages: int, rounds: int, budget: int, seed: int
) -> None:
    window = _array_window(jobs, stages, rounds, budget, seed)
    validate(window)
    per_stage = [rounds_of(program, 1) for program in window.stages]
    for program, at in zip(window.stages, per_stage, strict=True):
        for ins, r in zip(program, at, strict=True):
            if isinstance(ins, OptimizerStep):
                assert 0 <= r < rounds
            else:
                assert r == ins.microbatch
    for cut in range(1, rounds):
        kept = tuple(
            tuple(ins for ins, r in zip(program, at, strict=True) if r < cut)
            for program, at in zip(window.stages, per_stage, strict=True)
        )
        steps = [sum(isinstance(i, OptimizerStep) for i in p) for p in kept]
        assert steps == [cut * jobs] * stages  # every job stepped once per round kept
        validate(replace(window, stages=kept, num_microbatches=cut))  # complete, no deadlock


class _Gate:
    per_round = 1

    def __init__(self, cut: int) -> None:
        self.cut = cut
        self.asked: list[int] = []

    def enter(self, round_index: int) -> bool:
        self.asked.append(round_index)
        return round_index < self.cut


class _Transport:
    def __init__(self) -> None:
        self.limits: list[int | None] = []
        self.kept: list[TransferKey] | None = None
        self.plan: list[TransferKey] = []

    def hold_posts(self, limit: int | None) -> None:
        self.limits.append(limit)

    def drop_unposted(self, keep: Callable[[TransferKey], bool]) -> None:
        self.kept = [k for k in self.plan if keep(k)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_round_is_asked_for_once_and_no_later_receive_is_posted_before_it(seed: int) -> None:
    window = _array_window(4, 3, 5, 0, seed)
    program = window.stages[1]  # a middle stage: receives both ways
    at = rounds_of(program, 1)
    positions = [
        pos for pos, i in enumerate(program) if isinstance(i, RecvActivation | RecvGradient)
    ]
    transport = _Transport()
    transport.plan = [TransferKey(program[p].job, program[p].microbatch, 1, ACTIVATION)
                      for p in positions]  # fmt: skip
    gate = _Gate(cut=3)
    rounds = WindowRounds(at, positions, gate, transport)  # type: ignore[arg-type]
    rounds.start()
    ran = []
    for pos in range(len(program)):
        if rounds.runs(pos):
            ran.append(pos)
        # whatever may be posted now is of a round that is known to run
        limit = transport.limits[-1]
        assert limit is not None
        known = max([0, *(r for r in gate.asked if r < gate.cut)])  # rounds known to run
        assert all(at[p] <= known for p in positions[:limit])
    assert gate.asked == [1, 2, 3] and rounds.cut == 3
    assert ran == [pos for pos in range(len(program)) if at[pos] < 3]  # nothing else skipped
    assert transport.kept is not None and {k.microbatch for k in transport.kept} == {0, 1, 2}
    assert len(transport.limits) == 3  # round 0, then each round known to run: 1 and 2


# ---------------------------------------------------------------------- end to end
def _array(make_config: Callable[..., RunConfig], run_dir: Path, iterations: int) -> RunConfig:
    cfg = make_config(
        data={"microbatches": 1},
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        train={"iterations": iterations, "checkpoint_every": 0, "run_dir": str(run_dir)},
    )
    data = cfg.to_dict()
    data["sweep"] = {
        "grid": {"lr": [0.05, 0.2], "batch_size": [8, 16]},
        "solver": "1f1b",
        "window": 16,
    }
    return RunConfig.from_dict(data, source="test.toml")


def _commit_after_iteration_1(
    make_config: Callable[..., RunConfig], live: Path, iterations: int
) -> int:
    """Train, committing a move as the manager merges iteration 1; where it came in."""
    asked: list[int] = []

    def on_iteration(record: dict[str, Any], total: int) -> None:
        if not asked and record["iteration"] >= 1:
            asked.append(repartition(live, [0, 4, 6]).version)

    train(_array(make_config, live, iterations), on_iteration=on_iteration)
    adopted = adoptions(RunDir(live))
    assert list(adopted) == asked == [1]
    return adopted[1]


def _stage_events(run_dir: Path, kind: str) -> list[list[dict[str, Any]]]:
    run = RunDir(run_dir)
    return [
        [r for r in map(json.loads, run.stage_metrics(s).read_text().splitlines())
         if r.get("event") == kind]
        for s in range(2)
    ]  # fmt: skip


# The manager commits the plan when it merges iteration 1; on a loaded machine the
# stages may be at a window's end by then (two full fresh-clone runs of session 15 cut
# no window). That landing is legal and takes no cut; the test then tries again, up to
# three runs, for a landing inside a window, which is what it is about. Slow: 30-90 s.
@pytest.mark.slow
def test_a_plan_committed_mid_window_comes_in_at_the_next_iteration(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    iterations = 160  # windows of 16: the request lands inside one
    train(_array(make_config, tmp_path / "still", iterations))
    for attempt in range(3):
        live = tmp_path / f"live-{attempt}"
        came_in = _commit_after_iteration_1(make_config, live, iterations)
        if came_in % 16:
            break
        assert _stage_events(live, "window_cut") == [[], []]  # at a window's end: no cut
    else:
        pytest.fail("three runs in a row took the plan at a window's end")
    run = RunDir(live)
    adopted = adoptions(run)
    cuts = _stage_events(live, "window_cut")
    # every stage ended the same window at the same iteration, before its planned end,
    # and that is where the new partition came in
    assert [[(c["iteration"], c["planned"]) for c in s] for s in cuts] == [
        [(adopted[1], cuts[0][0]["planned"])]
    ] * 2
    assert adopted[1] < cuts[0][0]["planned"] and cuts[0][0]["planned"] % 16 == 0
    migrations = _stage_events(live, "migration")
    assert [[(m["iteration"], m["ok"]) for m in s] for s in migrations] == [
        [(adopted[1], True)]
    ] * 2
    assert read_active(run, current_version(run)).partition is not None
    got = ckpt.load(ckpt.latest(live / "checkpoints"))[0]  # type: ignore[arg-type]
    want = ckpt.load(ckpt.latest(tmp_path / "still" / "checkpoints"))[0]  # type: ignore[arg-type]
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    # the metrics still hold one record per iteration, in order
    records = [
        json.loads(line)
        for line in (live / "metrics.jsonl").read_text().splitlines()
        if '"iteration"' in line
    ]
    its = [r["iteration"] for r in records if "loss" in r and r.get("event") is None]
    assert sorted(set(its)) == list(range(iterations))


def test_a_window_of_two_rounds_cut_before_its_second_leaves_no_receive_posted(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    """Round 1's receives used to be posted with round 0's when the window began; a cut
    before round 1 then left them posted and the next iteration refused to start."""
    live = tmp_path / "live"
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 32},
        model={"config": {"hidden": 192, "num_samples": 4096}},
        train={"iterations": 60, "checkpoint_every": 0, "run_dir": str(live)},
    )
    data = cfg.to_dict()
    data["sweep"] = {"grid": {"lr": [0.002, 0.005]}, "solver": "1f1b", "window": 2}
    cfg = RunConfig.from_dict(data, source="test.toml")
    asked: list[int] = []

    def on_iteration(record: dict[str, Any], total: int) -> None:
        # four moves back and forth: each lands inside a window of two rounds or not,
        # and one inside is enough to show the bug
        settled = not asked or asked[-1] in adoptions(RunDir(live))
        if len(asked) < 4 and record["iteration"] >= 3 + 8 * len(asked) and settled:
            bounds = [0, 4, 6] if len(asked) % 2 == 0 else [0, 3, 6]
            asked.append(repartition(live, bounds).version)

    train(cfg, on_iteration=on_iteration)
    migrations = _stage_events(live, "migration")
    assert len(asked) >= 2
    assert [[m["ok"] for m in s] for s in migrations] == [[True] * len(asked)] * 2
