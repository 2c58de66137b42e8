"""Batched weight gradients: deferring a Linear's dW to one GEMM per batch changes no
gradient, only when and how it is computed."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from adaptipe.models import get_model
from adaptipe.profile.wgrad import WeightGradStash, defer_weight_grads, deferred_linear
from adaptipe.runtime.data import split_microbatches
from adaptipe.runtime.stage import LayerSlot, StageExecutor
from adaptipe.runtime.transport import P2PTransport
from adaptipe.schedule.build import build_schedule


def _close(got: Tensor | None, want: Tensor | None) -> None:
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_deferred_linear_gradients_equal_autograd_over_microbatches(
    shape: tuple[int, ...], bias: bool
) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(5, 4, bias=bias).double()
    mine = nn.Linear(5, 4, bias=bias).double()
    mine.load_state_dict(ref.state_dict())
    stash = WeightGradStash()
    for _ in range(3):  # three micro-batches, accumulated
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        dy = torch.randn(*shape[:-1], 4, dtype=torch.float64)
        x_ref = x.detach().clone().requires_grad_(True)
        ref(x_ref).backward(dy)
        out = deferred_linear(x, mine.weight, mine.bias, stash)
        torch.testing.assert_close(out, ref(x_ref))
        out.backward(dy)
        _close(x.grad, x_ref.grad)  # the input gradient comes with the micro-batch
        assert mine.weight.grad is None  # the weight gradient waits for the flush
    assert len(stash) == 3 and stash.num_weights == 1
    stash.flush()
    assert len(stash) == 0
    _close(mine.weight.grad, ref.weight.grad)
    if bias:
        _close(mine.bias.grad, ref.bias.grad)


def test_flush_adds_to_existing_grads_and_skips_frozen_weights() -> None:
    torch.manual_seed(1)
    layer = nn.Linear(3, 2)
    layer.weight.requires_grad_(False)
    layer.bias.grad = torch.ones(2)
    stash = WeightGradStash()
    x = torch.randn(4, 3)
    dy = torch.randn(4, 2)
    deferred_linear(x, layer.weight, layer.bias, stash).backward(dy)
    stash.flush()
    assert layer.weight.grad is None
    _close(layer.bias.grad, 1 + dy.sum(0))


def test_a_shared_weight_gets_one_gradient_from_both_layers() -> None:
    torch.manual_seed(2)
    first, second = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    second.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), second)
    x = torch.randn(6, 4)
    model(x).square().sum().backward()
    want = first.weight.grad.clone()  # type: ignore[union-attr]
    first.weight.grad = None
    stash = WeightGradStash()
    with defer_weight_grads([model], stash) as switched:
        model(x).square().sum().backward()
    assert switched == 2
    stash.flush()
    _close(first.weight.grad, want)


def test_gpt_block_defers_only_its_linears_and_is_restored() -> None:
    spec = get_model("gpt", n_layer=1, d_model=16, n_head=2, block_size=8)
    ref = [spec.build_layer(i, seed=0) for i in range(spec.num_layers)]
    mine = [spec.build_layer(i, seed=0) for i in range(spec.num_layers)]
    x, y = spec.dataset(split="train").sample_batch(6, seed=0)
    for layers, defer in ((ref, False), (mine, True)):
        stash = WeightGradStash()
        with defer_weight_grads(layers if defer else [], stash):
            for part_x, part_y in split_microbatches(x, y, 3):
                h = part_x
                for layer in layers:
                    h = layer(h)
                spec.loss(h, part_y).backward()
            if defer:
                # Embedding and LayerNorm weights take ordinary autograd; Linears wait.
                assert mine[1].ln_attn.weight.grad is not None
                assert mine[1].fc.weight.grad is None
                assert len(stash) == 3 * 5  # qkv, proj, fc, fc_out, head.out per micro-batch
                assert stash.num_weights == 5  # one GEMM each over the 3 micro-batches
        stash.flush()
    for a, b in zip(ref, mine, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert all("forward" not in m.__dict__ for layer in mine for m in layer.modules())


def test_functional_call_weights_receive_the_deferred_gradient() -> None:
    layer = nn.Linear(3, 2)
    own = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    stash = WeightGradStash()
    x = torch.randn(5, 3)
    with defer_weight_grads([layer], stash):
        functional_call(layer, own, (x,)).sum().backward()
    stash.flush()
    assert layer.weight.grad is None
    _close(own["weight"].grad, torch.ones(5, 2).t() @ x)


def test_without_grad_mode_nothing_is_stashed() -> None:
    layer = nn.Linear(3, 2)
    stash = WeightGradStash()
    with defer_weight_grads([layer], stash), torch.no_grad():
        out = layer(torch.randn(2, 3))
    assert not out.requires_grad and len(stash) == 0


# ---- the executor, in one process (a one-stage pipeline needs no transport) -------------


def _train_one_stage(*, schedule: str, recompute: bool, batch_wgrad: bool) -> list[Tensor]:
    spec = get_model("gpt", n_layer=2, d_model=16, n_head=2, block_size=8)
    sched = build_schedule(schedule, stages=1, microbatches=4, recompute=recompute)
    slots = []
    for i in range(spec.num_layers):
        module = spec.build_layer(i, seed=0)
        slots.append(LayerSlot(i, module, torch.optim.SGD(module.parameters(), lr=0.1)))
    executor = StageExecutor(
        schedule=sched,
        stage=0,
        chunks=[slots],
        loss_fn=spec.loss,
        loss_scale=0.25,
        transport=P2PTransport(
            rank=0, device=torch.device("cpu"), num_boundaries=1, num_microbatches=4
        ),
        boundary_specs={},
        batch_weight_grads=batch_wgrad,
    )
    data = spec.dataset(split="train")
    for it in range(2):
        x, y = data.sample_batch(8, seed=it)
        stats = executor.run_iteration(it, [split_microbatches(x, y, 4)])
        assert sum(stats.layer_backward_s.values()) > 0
    return [p.detach() for slot in slots for p in slot.module.parameters()]


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_executor_with_batched_weight_grads_trains_like_per_microbatch_grads(
    schedule: str, recompute: bool
) -> None:
    want = _train_one_stage(schedule=schedule, recompute=recompute, batch_wgrad=False)
    got = _train_one_stage(schedule=schedule, recompute=recompute, batch_wgrad=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_executor_rejects_batched_weight_grads_for_asynchronous_schedules() -> None:
    spec = get_model("mlp", depth=2)
    with pytest.raises(ValueError, match="batch_weight_grads needs one job and a synchronous"):
        StageExecutor(
            schedule=build_schedule("pipedream", stages=1, microbatches=2),
            stage=0,
            chunks=[[LayerSlot(i, spec.build_layer(i, seed=0), None) for i in range(2)]],
            loss_fn=spec.loss,
            loss_scale=1.0,
            transport=P2PTransport(
                rank=0, device=torch.device("cpu"), num_boundaries=1, num_microbatches=2
            ),
            boundary_specs={},
            batch_weight_grads=True,
        )
