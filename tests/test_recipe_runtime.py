"""Learning-rate schedules through the runtime: a warm-up and cosine decay trains as a
plain PyTorch loop with LambdaLR does; the schedule's step count travels with a
migrated layer (bitwise as without the move); a sweep over warm-up trains each job
bitwise as alone."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptipe.errors import PlanError
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.recipe import STEP_KEY
from tests.conftest import TINY_MLP, final_state

SCHEDULE = {"schedule": "cosine", "warmup": 2, "min_lr_ratio": 0.1}


def _config(tmp_path: Path, name: str, **over: dict[str, Any]) -> RunConfig:
    data = copy.deepcopy(TINY_MLP)
    data["optimizer"].update(SCHEDULE)
    data["train"]["iterations"] = 6
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value}
    data["train"]["run_dir"] = str(tmp_path / name)
    return RunConfig.from_dict(data, source=f"{name}.toml")


def _plain_loop(cfg: RunConfig) -> dict[str, torch.Tensor]:
    spec = cfg.model.spec()
    model = spec.build_all(seed=cfg.train.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.momentum)
    schedule = cfg.optimizer.lr_schedule()
    assert schedule is not None and schedule.total == 6  # cosine lasts the run
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule.factor)
    batches = spec.dataset(split="train").batches(cfg.data.batch_size, seed=cfg.data.seed or 0)
    m = cfg.data.microbatches
    for _, (x, y) in zip(range(6), batches, strict=False):
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            (spec.loss(model(xs), ys) / m).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {
        f"layers.{i}.{n}": p.detach()
        for i, layer in enumerate(model)
        for n, p in layer.named_parameters()
    }


def test_a_scheduled_run_trains_as_lambda_lr_and_counts_its_steps(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "sched")
    got = final_state(train(cfg).run_dir)
    want = _plain_loop(cfg)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=name)
    steps = {k: int(v) for k, v in got.items() if k.endswith("." + STEP_KEY)}
    assert steps and set(steps.values()) == {6}
    constant = final_state(
        train(_config(tmp_path, "const", optimizer={"schedule": "constant", "warmup": 0})).run_dir
    )
    first = next(iter(want))
    assert not torch.equal(constant[first], got[first])


def test_a_migrated_layer_keeps_its_schedule(tmp_path: Path) -> None:
    still = final_state(train(_config(tmp_path, "still")).run_dir, layers=True)
    moved_cfg = _config(
        tmp_path, "moved", pipeline={"partition": [0, 3, 6]},
        adapt={"repartition": [{"iteration": 3, "bounds": [0, 4, 6]}]},
    )  # fmt: skip
    moved = final_state(train(moved_cfg).run_dir, layers=True)
    assert moved.keys() == still.keys()
    for name in still:
        assert torch.equal(moved[name], still[name]), name


def test_a_sweep_over_warmup_trains_each_job_as_alone(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "array", data={"microbatches": 1})
    data = cfg.to_dict()
    data["sweep"] = {"grid": {"warmup": [0, 3]}, "solver": "1f1b"}
    array = RunConfig.from_dict(data, source="array.toml")
    assert [j.optimizer.warmup for j in array.jobs] == [0, 3]
    summary = train(array)
    for job in array.jobs:
        alone_cfg = _config(tmp_path, f"alone-{job.index}", data={"microbatches": 1},
                            optimizer={"warmup": job.optimizer.warmup})  # fmt: skip
        alone = final_state(train(alone_cfg).run_dir, layers=True)
        got = final_state(summary.run_dir, job.index, layers=True)
        for name in alone:
            assert torch.equal(got[name], alone[name]), (job.name, name)


@pytest.mark.parametrize(
    ("optimizer", "match"),
    [
        ({"schedule": "linear"}, r"\[optimizer\]\.schedule"),
        ({"schedule": "step"}, r"\[optimizer\] step schedule: step_every"),
        ({"schedule": "cosine", "warmup": 6}, r"\[optimizer\] cosine schedule: total \(6\)"),
    ],
)
def test_bad_schedules_name_the_config(
    tmp_path: Path, optimizer: dict[str, Any], match: str
) -> None:
    with pytest.raises(PlanError, match=match) as info:
        _config(tmp_path, "bad", optimizer=optimizer)
    assert "bad.toml" in str(info.value)


CLIP = {"clip_grad_norm": 0.05, "schedule": "constant", "warmup": 0}


def _plain_clipped(cfg: RunConfig) -> dict[str, torch.Tensor]:
    spec = cfg.model.spec()
    model = spec.build_all(seed=cfg.train.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.momentum)
    batches = spec.dataset(split="train").batches(cfg.data.batch_size, seed=cfg.data.seed or 0)
    m = cfg.data.microbatches
    for _, (x, y) in zip(range(cfg.train.iterations or 0), batches, strict=False):
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            (spec.loss(model(xs), ys) / m).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad_norm)
        opt.step()
        opt.zero_grad()
    return {
        f"layers.{i}.{n}": p.detach()
        for i, layer in enumerate(model)
        for n, p in layer.named_parameters()
    }


def test_clipping_by_the_global_norm_matches_torch_and_ignores_the_cut(tmp_path: Path) -> None:
    first = _config(tmp_path, "cut3", optimizer=CLIP, pipeline={"partition": [0, 3, 6]})
    got = final_state(train(first).run_dir, layers=True)
    want = _plain_clipped(first)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=name)
    free = _config(
        tmp_path, "free", optimizer={**CLIP, "clip_grad_norm": 0.0},
        pipeline={"partition": [0, 3, 6]},
    )  # fmt: skip
    unclipped = final_state(train(free).run_dir, layers=True)
    assert not torch.equal(unclipped[next(iter(want))], got[next(iter(want))])  # it did clip
    other = _config(tmp_path, "cut2", optimizer=CLIP, pipeline={"partition": [0, 2, 6]})
    _bitwise_same(final_state(train(other).run_dir, layers=True), got)
    moved = _config(
        tmp_path, "moved", optimizer=CLIP, pipeline={"partition": [0, 3, 6]},
        adapt={"repartition": [{"iteration": 3, "bounds": [0, 2, 6]}]},
    )  # fmt: skip
    _bitwise_same(final_state(train(moved).run_dir, layers=True), got)


def _bitwise_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_clipping_is_refused_on_schedules_that_step_per_micro_batch_group(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="needs a synchronous schedule"):
        _config(tmp_path, "y", optimizer=CLIP, pipeline={"schedule": "2bw", "update_every": 2})


def test_a_schedule_and_clipping_together_ignore_the_cut_and_match_a_plain_loop(
    tmp_path: Path,
) -> None:
    both = {**SCHEDULE, "clip_grad_norm": 0.05}
    first = _config(tmp_path, "a", optimizer=both, pipeline={"partition": [0, 3, 6]})
    second = _config(tmp_path, "b", optimizer=both, pipeline={"partition": [0, 1, 6]})
    got = final_state(train(first).run_dir, layers=True)
    _bitwise_same(final_state(train(second).run_dir, layers=True), got)
    spec = first.model.spec()
    model = spec.build_all(seed=first.train.seed)
    opt = torch.optim.SGD(
        model.parameters(), lr=first.optimizer.lr, momentum=first.optimizer.momentum
    )
    schedule = first.optimizer.lr_schedule()
    assert schedule is not None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule.factor)
    batches = spec.dataset(split="train").batches(first.data.batch_size, seed=first.data.seed or 0)
    m = first.data.microbatches
    for _, (x, y) in zip(range(6), batches, strict=False):
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            (spec.loss(model(xs), ys) / m).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        sched.step()
    for i, layer in enumerate(model):
        for n, p in layer.named_parameters():
            torch.testing.assert_close(got[f"layers.{i}.{n}"], p.detach(), rtol=1e-5, atol=1e-7)
