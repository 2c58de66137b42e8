"""Stages own their layer slots: a layer moved between two running stages (in one
process, between two iterations) leaves training bitwise what it was unmoved."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from adaptipe.errors import PlanError
from adaptipe.japsp.compile import to_schedule
from adaptipe.models import ModelSpec, get_model
from adaptipe.models.spec import LayerSpec
from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.handshake import boundary_specs_in_process
from adaptipe.runtime.local_transport import LocalTransport, Mailbox, run_stages
from adaptipe.runtime.migration import layers_of, plan_moves
from adaptipe.runtime.slots import LayerSlot
from adaptipe.runtime.stagestate import Stage, build_stage, payload_layers
from adaptipe.runtime.transport import TensorSpec
from adaptipe.schedule.build import build_schedule
from adaptipe.schedule.types import Schedule

CPU = torch.device("cpu")
IN, OUT, MB = 8, 4, 4  # TINY_MLP's features; micro-batch size


def _dropout_layer(index: int, last: int) -> nn.Module:
    width_in = IN if index == 0 else 16
    if index == last:
        return nn.Linear(width_in, OUT)
    return nn.Sequential(nn.Linear(width_in, 16), nn.ReLU(), nn.Dropout(0.3))


def _dropout_spec() -> ModelSpec:
    """Six layers, five of them drawing dropout masks while they train."""
    mlp = get_model("mlp", in_features=IN, hidden=16, depth=6, out_features=OUT)
    layers = tuple(
        LayerSpec(name=f"l{i}", kind="dense", make=functools.partial(_dropout_layer, i, 5))
        for i in range(6)
    )
    return ModelSpec(
        name="dropout-mlp",
        config={},
        layers=layers,
        loss_fn=mlp.loss_fn,
        dataset_fn=mlp.dataset_fn,
    )


def _batches(iteration: int, jobs: int, microbatches: int) -> list[list[tuple[Any, Any]]]:
    out = []
    for job in range(jobs):
        gen = torch.Generator().manual_seed(1000 * iteration + job)
        out.append(
            [
                (torch.randn(MB, IN, generator=gen), torch.randn(MB, OUT, generator=gen))
                for _ in range(microbatches)
            ]
        )
    return out


def _connect(stages: list[Stage], schedule: Schedule, mailbox: Mailbox) -> None:
    """(Re)build both executors for ``schedule`` and agree on boundary shapes."""
    executors = [
        s.build_executor(
            schedule=schedule, transport=LocalTransport(mailbox, s.rank), boundary_specs={}
        )
        for s in stages
    ]
    first = {j: TensorSpec((MB, IN), torch.float32) for j in range(schedule.num_jobs)}
    for ex, specs in zip(
        executors, boundary_specs_in_process(executors, schedule, first, CPU), strict=True
    ):
        ex.set_boundary_specs(specs)


def _move_last_layer(stages: list[Stage]) -> None:
    """Layer 2 from stage 0's last end to stage 1's first, as a detached payload."""
    payload = stages[0].detach(end="last")
    assert payload_layers(payload)[0] == [2]
    assert stages[1].attach(payload, end="first") == [2]
    assert (stages[0].layers(), stages[1].layers()) == ([0, 1], [2, 3, 4, 5])


def _train(
    spec: ModelSpec,
    cfg: RunConfig,
    schedule: Schedule,
    *,
    iterations: int,
    move_after: int | None,
    move: Callable[[list[Stage]], None] = _move_last_layer,
    bounds: tuple[int, ...] = (0, 3, 6),
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Train the stages of ``bounds``; after ``move_after`` iterations ``move`` them (by
    default layer 2 from stage 0 to stage 1). Returns every tensor under global keys and
    the steps done."""
    partition = Partition(model=spec.name, num_layers=6, bounds=bounds)
    stages = [
        build_stage(spec, partition, schedule, r, cfg, CPU) for r in range(schedule.num_stages)
    ]
    mailbox = Mailbox()
    _connect(stages, schedule, mailbox)
    for it in range(iterations):
        if it == move_after:
            move(stages)
            _connect(stages, schedule, mailbox)
        data = _batches(it, schedule.num_jobs, schedule.num_microbatches)
        run_stages(
            [
                functools.partial(s.executor.run_iteration, it, data)  # type: ignore[union-attr]
                for s in stages
            ]
        )
    tensors = {k: v for s in stages for k, v in s.tensors().items()}
    return tensors, [s.steps_done for s in stages]


def _one_job(make_config: Callable[..., RunConfig]) -> RunConfig:
    return make_config(
        data={"batch_size": 16, "microbatches": 4},
        optimizer={"name": "adam", "lr": 0.01, "momentum": 0.0},
    )


def _array(make_config: Callable[..., RunConfig]) -> RunConfig:
    cfg = make_config(
        data={"batch_size": MB, "microbatches": 1},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
    )
    data = cfg.to_dict()
    data["sweep"] = {"grid": {"lr": [0.05, 0.2]}, "solver": "1f1b"}
    return RunConfig.from_dict(data, source="test.toml")


CASES = {
    "one-job-1f1b-adam": (_one_job, "mlp", "1f1b"),
    "one-job-gpipe-dropout": (_one_job, "dropout", "gpipe"),
    "two-job-array": (_array, "mlp", "array"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moving_a_layer_between_iterations_keeps_training_bitwise_equal(
    make_config: Callable[..., RunConfig], case: str
) -> None:
    configure, model, kind = CASES[case]
    cfg = configure(make_config)
    spec = _dropout_spec() if model == "dropout" else cfg.model.spec()
    if kind == "array":
        orders = [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]]
        schedule = to_schedule(2, orders)
    else:
        schedule = build_schedule(kind, stages=2, microbatches=4)
    want, want_steps = _train(spec, cfg, schedule, iterations=6, move_after=None)
    got, got_steps = _train(spec, cfg, schedule, iterations=6, move_after=3)
    assert got.keys() == want.keys()
    # optimizer state (with its step count) is part of what must match
    assert any(".step" in k for k in want) or kind == "array"
    assert any(k.startswith(("optim.", "jobs.")) and ".exp_avg" in k for k in want) or (
        kind == "array" and any("momentum_buffer" in k for k in want)
    )
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs after the move"
    assert got_steps == want_steps


def test_a_move_that_loses_the_optimizer_state_is_caught(
    make_config: Callable[..., RunConfig],
) -> None:
    """The comparison above can fail: a layer that arrives without its Adam moments (what
    DynPipe's public code does) ends elsewhere."""
    cfg = _one_job(make_config)
    spec = cfg.model.spec()
    schedule = build_schedule("1f1b", stages=2, microbatches=4)

    def move_without_state(stages: list[Stage]) -> None:
        _move_last_layer(stages)
        optimizer = stages[1].chunks[0][0].optimizer
        assert optimizer is not None
        optimizer.state.clear()

    want, _ = _train(spec, cfg, schedule, iterations=6, move_after=None)
    got, _ = _train(spec, cfg, schedule, iterations=6, move_after=3, move=move_without_state)
    assert not torch.equal(got["layers.2.linear.weight"], want["layers.2.linear.weight"])


def _split_mlp(make_config: Callable[..., RunConfig]) -> tuple[Stage, Stage]:
    """The two stages of the 6-layer MLP (layers 0-2 | 3-5, 1F1B, Adam), untrained."""
    cfg = _one_job(make_config)
    spec = cfg.model.spec()
    schedule = build_schedule("1f1b", stages=2, microbatches=4)
    partition = Partition(model=spec.name, num_layers=6, bounds=(0, 3, 6))
    s0, s1 = (build_stage(spec, partition, schedule, r, cfg, CPU) for r in range(2))
    return s0, s1


def _reshape(stages: list[Stage], schedule: Schedule, old: Partition, new: Partition) -> None:
    """What a live migration does, in one process: payloads from old to new owners,
    then every stage takes on its new layers (`adaptipe.runtime.migration`)."""
    received: list[dict[str, torch.Tensor]] = [{} for _ in stages]
    for move in plan_moves(old, new, schedule):
        payload = stages[move.src].pack(move.layers)
        received[move.dst].update(safetensors.torch.load(payload))
    for stage in stages:
        stage.reshape(layers_of(new, schedule, stage.rank), received[stage.rank])


def test_a_middle_stage_losing_both_ends_and_disjoint_ranges_train_on_bitwise(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = _one_job(make_config)
    spec = cfg.model.spec()
    schedule = build_schedule("1f1b", stages=3, microbatches=3)
    old = Partition(model=spec.name, num_layers=6, bounds=(0, 1, 5, 6))
    both_ends = Partition(model=spec.name, num_layers=6, bounds=(0, 2, 4, 6))
    disjoint = Partition(model=spec.name, num_layers=6, bounds=(0, 4, 5, 6))

    def twice(stages: list[Stage]) -> None:
        _reshape(stages, schedule, old, both_ends)
        assert [s.layers() for s in stages] == [[0, 1], [2, 3], [4, 5]]
        _reshape(stages, schedule, both_ends, disjoint)  # stage 1: 2-3 -> 4
        assert [s.layers() for s in stages] == [[0, 1, 2, 3], [4], [5]]

    want, want_steps = _train(spec, cfg, schedule, iterations=5, move_after=None, bounds=old.bounds)
    got, got_steps = _train(
        spec, cfg, schedule, iterations=5, move_after=2, move=twice, bounds=old.bounds
    )
    assert got.keys() == want.keys() and got_steps == want_steps
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_layer_draws_depend_on_step_job_and_microbatch_only() -> None:
    module = nn.Dropout(0.5)
    slot = LayerSlot.build(3, module, None, seed=7)
    assert slot.random
    x = torch.ones(64)

    def mask(step: int, job: int, mb: int) -> torch.Tensor:
        with slot.draws(step, job, mb, CPU):
            return module(x)

    before = torch.get_rng_state()
    first = mask(1, 0, 2)
    torch.rand(5)  # the process-wide stream moves on; the layer's does not care
    assert torch.equal(mask(1, 0, 2), first)
    assert not torch.equal(mask(2, 0, 2), first)
    assert not torch.equal(mask(1, 1, 2), first)
    assert not torch.equal(mask(1, 0, 3), first)
    other = LayerSlot.build(4, nn.Dropout(0.5), None, seed=7)
    with other.draws(1, 0, 2, CPU):
        assert not torch.equal(other.module(x), first)  # another layer, another stream
    torch.set_rng_state(before)
    torch.rand(5)
    after_one = torch.get_rng_state()
    torch.set_rng_state(before)
    with slot.draws(1, 0, 2, CPU):
        module(x)
    torch.rand(5)
    assert torch.equal(torch.get_rng_state(), after_one)  # the global stream is untouched
    assert not LayerSlot.build(0, nn.Linear(2, 2), None, seed=7).random


def test_a_recomputed_forward_draws_the_mask_the_first_one_drew(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = _one_job(make_config)
    spec = _dropout_spec()
    plain = build_schedule("gpipe", stages=2, microbatches=4)
    recomputed = build_schedule("gpipe", stages=2, microbatches=4, recompute=True)
    want, _ = _train(spec, cfg, plain, iterations=4, move_after=None)
    got, _ = _train(spec, cfg, recomputed, iterations=4, move_after=None)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_detach_refuses_to_empty_a_stage_and_attach_checks_the_end(
    make_config: Callable[..., RunConfig],
) -> None:
    s0, s1 = _split_mlp(make_config)
    with pytest.raises(PlanError, match="keeps at least one layer"):
        s0.detach(end="last", count=3)
    payload = s0.detach(end="first")  # layer 0 does not join stage 1's first end (layer 3)
    with pytest.raises(PlanError, match=r"do not join its first end"):
        s1.attach(payload, end="first")
    with pytest.raises(PlanError, match="not a layer-slot payload"):
        s1.attach(b"garbage!" * 4, end="first")
    assert s1.layers() == [3, 4, 5]  # refused attaches changed nothing


def test_a_detached_payload_shares_no_storage_with_the_stage(
    make_config: Callable[..., RunConfig],
) -> None:
    s0, _ = _split_mlp(make_config)
    weight = s0.chunks[0][-1].module.linear.weight
    before = weight.detach().clone()
    payload = s0.detach(end="last")
    with torch.no_grad():
        weight.add_(1.0)  # the stage's old tensor changes; the payload must not
    assert torch.equal(safetensors.torch.load(payload)["layers.2.linear.weight"], before)


def test_the_invariants_check_catches_a_broken_stage(
    make_config: Callable[..., RunConfig],
) -> None:
    s0, _ = _split_mlp(make_config)
    s0.check([[0, 1, 2]])
    with pytest.raises(RuntimeError, match=r"holds layers \[\[0, 1, 2\]\], the partition says"):
        s0.check([[0, 1]])
    s0.chunks[0].reverse()
    with pytest.raises(RuntimeError, match=r"layers \[2, 1, 0\] are not a contiguous range"):
        s0.check([[2, 1, 0]])
    s0.chunks[0].reverse()
    optimizer = s0.chunks[0][1].optimizer
    assert optimizer is not None
    optimizer.param_groups[0]["params"] = optimizer.param_groups[0]["params"][:1]
    with pytest.raises(RuntimeError, match="layer 1: its parameters and its optimizer's differ"):
        s0.check([[0, 1, 2]])
