"""The data stream and the single-process reference the pipeline runtime is checked against.

The reference is itself checked against training written out independently here: plain
full-batch SGD for synchronous schedules, and hand-computed updates with explicitly
stale weights for PipeDream (weight stashing, vertical sync) and PipeDream-2BW.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from functools import partial
from itertools import islice

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaptipe.errors import PlanError, ScheduleError
from adaptipe.models import ModelSpec, get_model
from adaptipe.models.data import Dataset
from adaptipe.models.spec import LayerSpec, Split
from adaptipe.plan.partition import Partition
from adaptipe.runtime.data import BatchStream, RoundFeed, loss_scale, split_microbatches
from adaptipe.runtime.reference import (
    ReferenceResult,
    _forward_versions,
    reference_param_names,
    train_reference,
)
from adaptipe.schedule.build import build_schedule
from adaptipe.schedule.types import Forward, Schedule

MLP = {"in_features": 8, "hidden": 16, "depth": 4, "out_features": 3, "num_samples": 96}
LR = 0.05
SEED = 3
DATA_SEED = 11


def mlp() -> ModelSpec:
    return get_model("mlp", **MLP)


def sgd(lr: float = LR) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr)


def run(
    spec: ModelSpec,
    schedule: Schedule,
    *,
    batch_size: int = 8,
    iterations: int = 3,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> ReferenceResult:
    partition = Partition.even(
        model=spec.name, num_layers=spec.num_layers, num_stages=schedule.num_virtual_stages
    )
    return train_reference(
        spec=spec,
        schedule=schedule,
        partition=partition,
        make_optimizer=make_optimizer or sgd(),
        batch_size=batch_size,
        iterations=iterations,
        seed=SEED,
        data_seed=DATA_SEED,
    )


def layer_params(model: nn.Sequential) -> dict[str, Tensor]:
    """``build_all``'s parameters under the reference's ``layers.{i}.{name}`` keys."""
    return {
        f"layers.{i}.{name}": p.detach()
        for i, layer in enumerate(model)
        for name, p in layer.named_parameters()
    }


def assert_params_close(got: dict[str, Tensor], want: dict[str, Tensor], **tol: float) -> None:
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m, k=key: f"{k}: {m}", **tol)


# ---- BatchStream, split_microbatches, loss_scale ----------------------------------------


def test_stream_reads_epochs_of_dataset_batches_in_order() -> None:
    dataset = mlp().dataset()
    stream = BatchStream(dataset, batch_size=10, seed=DATA_SEED)
    assert stream.batches_per_epoch == 9  # 96 // 10, the last 6 samples dropped
    for epoch in range(3):
        assert stream.epoch == epoch and stream.iteration == 9 * epoch
        for x, y in dataset.batches(10, seed=DATA_SEED, epoch=epoch, drop_last=True):
            got_x, got_y = next(stream)
            assert torch.equal(got_x, x) and torch.equal(got_y, y)


def test_stream_is_deterministic_and_reshuffles_every_epoch() -> None:
    dataset = mlp().dataset()
    first = [x for x, _ in islice(BatchStream(dataset, batch_size=12, seed=1), 16)]
    again = [x for x, _ in islice(BatchStream(dataset, batch_size=12, seed=1), 16)]
    other = [x for x, _ in islice(BatchStream(dataset, batch_size=12, seed=2), 16)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    epoch0, epoch1 = torch.cat(first[:8]), torch.cat(first[8:])
    assert not torch.equal(epoch0, epoch1)  # a new order...
    assert rows(epoch0) == rows(epoch1) == rows(dataset.inputs)  # ...of the same samples


def rows(t: Tensor) -> list[tuple[float, ...]]:
    return sorted(tuple(row) for row in t.tolist())


@pytest.mark.parametrize("start", [0, 1, 5, 8, 9, 17, 30])
def test_stream_resumed_at_iteration_equals_tail_of_fresh_stream(start: int) -> None:
    dataset = mlp().dataset()
    fresh = list(islice(BatchStream(dataset, batch_size=12, seed=4), start + 10))
    resumed = BatchStream(dataset, batch_size=12, seed=4, start_iteration=start)
    assert resumed.iteration == start and resumed.epoch == start // 8
    for want_x, want_y in fresh[start:]:
        x, y = next(resumed)
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert resumed.iteration == start + 10


def test_stream_rejects_bad_arguments() -> None:
    dataset = mlp().dataset()
    with pytest.raises(ValueError, match="96 samples, fewer than one batch of batch_size=97"):
        BatchStream(dataset, batch_size=97, seed=0)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        BatchStream(dataset, batch_size=0, seed=0)
    with pytest.raises(ValueError, match="start_iteration must be an int >= 0"):
        BatchStream(dataset, batch_size=8, seed=0, start_iteration=-1)


def test_split_microbatches_cuts_equal_contiguous_chunks() -> None:
    x, y = torch.arange(24.0).reshape(12, 2), torch.arange(12)
    parts = split_microbatches(x, y, 4)
    assert [tuple(p[0].shape) for p in parts] == [(3, 2)] * 4
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(ValueError, match="12 samples cannot be split into 5"):
        split_microbatches(x, y, 5)
    with pytest.raises(ValueError, match="differ in batch size"):
        split_microbatches(x, y[:6], 2)


def test_round_feed_reads_each_round_when_first_needed_and_holds_two() -> None:
    dataset = mlp().dataset()
    want = [
        split_microbatches(x, y, 2)
        for x, y in islice(BatchStream(dataset, batch_size=12, seed=3), 4)
    ]
    stream = BatchStream(dataset, batch_size=12, seed=3)
    feed = RoundFeed(stream, rounds=4, per_round=2)
    assert len(feed) == 8 and stream.iteration == 0  # nothing read yet
    for index in range(8):
        r, i = divmod(index, 2)
        x, y = feed[index]
        assert x is not None and y is not None
        assert torch.equal(x, want[r][i][0]) and torch.equal(y, want[r][i][1])
        assert stream.iteration == r + 1  # round r read on its first use, not before
        assert feed.held_rounds <= 2
    with pytest.raises(IndexError, match="round 1 was asked for after round 3"):
        feed[2]
    with pytest.raises(IndexError, match=r"outside 0\.\.7"):
        feed[8]
    feed.finish()
    assert feed.held_rounds == 0 and stream.iteration == 4


def test_round_feed_finish_keeps_the_stream_aligned_and_drops_unneeded_sides() -> None:
    dataset = mlp().dataset()
    stream = BatchStream(dataset, batch_size=12, seed=3)
    feed = RoundFeed(stream, rounds=3, per_round=1, keep_input=False)
    x, y = feed[1]  # round 0 is read on the way (streams are read in order)
    assert x is None and y is not None and stream.iteration == 2
    feed.finish()  # round 2 was never asked for: still read
    assert stream.iteration == 3
    later = next(stream)
    assert torch.equal(later[0], list(islice(BatchStream(dataset, batch_size=12, seed=3), 4))[3][0])


def test_a_window_cut_short_reads_only_the_rounds_that_ran() -> None:
    dataset = mlp().dataset()
    stream = BatchStream(dataset, batch_size=12, seed=3)
    feed = RoundFeed(stream, rounds=5, per_round=1)
    feed[0]
    feed.finish(upto=2)  # the window ended before round 2: round 1 is still read
    assert stream.iteration == 2
    feed = RoundFeed(stream, rounds=5, per_round=1)
    feed[1]
    with pytest.raises(ValueError, match=r"finish\(upto=1\): 2 of 5 rounds read"):
        feed.finish(upto=1)


def test_loss_scale_makes_each_step_a_sample_mean() -> None:
    assert loss_scale(build_schedule("gpipe", stages=2, microbatches=4)) == 0.25
    assert loss_scale(build_schedule("interleaved", stages=2, microbatches=4, chunks=2)) == 0.25
    assert loss_scale(build_schedule("pipedream", stages=3, microbatches=6)) == 1.0
    assert loss_scale(build_schedule("2bw", stages=2, microbatches=6, update_every=3)) == 1 / 3
    assert loss_scale(8) == 0.125
    with pytest.raises(ValueError, match="update_every must be an int >= 1"):
        loss_scale(0)


# ---- synchronous schedules -----------------------------------------------------------------


def test_reference_param_names_match_build_all() -> None:
    spec = mlp()
    assert reference_param_names(spec) == list(layer_params(spec.build_all(seed=0)))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sync_one_microbatch_equals_plain_full_batch_training(optimizer: str) -> None:
    spec, iterations, batch_size = mlp(), 14, 8  # 12 batches per epoch: crosses an epoch
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = (
        sgd() if optimizer == "sgd" else lambda ps: torch.optim.Adam(ps, lr=1e-2)
    )
    got = run(
        spec,
        build_schedule("1f1b", stages=2, microbatches=1),
        batch_size=batch_size,
        iterations=iterations,
        make_optimizer=make,
    )
    model = spec.build_all(seed=SEED)
    opt = make(list(model.parameters()))  # one optimizer over every layer
    dataset, losses = spec.dataset(), []
    batches = [b for e in range(2) for b in dataset.batches(batch_size, seed=DATA_SEED, epoch=e)][
        :iterations
    ]
    for x, y in batches:
        loss = spec.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert_params_close(got.params, layer_params(model), rtol=1e-6, atol=1e-7)
    assert got.losses == pytest.approx(losses, rel=1e-6)
    assert got.versions == [[i, i] for i in range(iterations)]


@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        ("gpipe", {"stages": 2}),
        ("gpipe", {"stages": 3, "recompute": True}),
        ("1f1b", {"stages": 4}),
        ("interleaved", {"stages": 2, "chunks": 2, "recompute": True}),
    ],
)
def test_sync_microbatches_equal_one_microbatch(name: str, knobs: dict[str, int]) -> None:
    """The mean of equal micro-batches' mean gradients is the full-batch mean gradient."""
    spec = mlp()
    whole = run(spec, build_schedule("gpipe", stages=1, microbatches=1), iterations=4)
    split = run(spec, build_schedule(name, microbatches=4, **knobs), iterations=4)
    assert_params_close(split.params, whole.params, rtol=1e-5, atol=1e-6)
    assert split.losses == pytest.approx(whole.losses, rel=1e-5)


def test_sync_reference_matches_for_gpt() -> None:
    spec = get_model("gpt", block_size=8, d_model=16, n_head=2, n_layer=2)
    whole = run(spec, build_schedule("gpipe", stages=1, microbatches=1), iterations=2)
    split = run(spec, build_schedule("1f1b", stages=2, microbatches=2), iterations=2)
    assert_params_close(split.params, whole.params, rtol=1e-5, atol=1e-6)


# ---- asynchronous schedules on an mlp ------------------------------------------------------


def test_pipedream_single_stage_is_sgd_per_microbatch() -> None:
    spec, iterations, m_count = mlp(), 3, 4
    got = run(spec, build_schedule("pipedream", stages=1, microbatches=m_count), iterations=3)
    model = spec.build_all(seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = islice(spec.dataset().batches(8, seed=DATA_SEED, epoch=0), iterations)
    for x, y in batches:
        for k in range(m_count):  # two samples per micro-batch, one update each
            spec.loss(model(x[2 * k : 2 * k + 2]), y[2 * k : 2 * k + 2]).backward()
            opt.step()
            opt.zero_grad()
    assert_params_close(got.params, layer_params(model), rtol=1e-6, atol=1e-7)
    assert got.versions == [[k] for k in range(iterations * m_count)]


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipedream_stage_s_uses_weights_s_minus_last_updates_old(stages: int) -> None:
    """Weight stashing in 1F1B: stage ``s`` of ``S`` forwards micro-batch ``m`` with the
    version made after ``m - (S - 1 - s)`` updates (the last stage sees the newest)."""
    m_count = 6
    stash = run(
        mlp(), build_schedule("pipedream", stages=stages, microbatches=m_count), batch_size=12
    )
    vertical = run(
        mlp(),
        build_schedule("pipedream", stages=stages, microbatches=m_count, vertical_sync=True),
        batch_size=12,
    )
    for k, used in enumerate(stash.versions):
        base, m = divmod(k, m_count)
        assert used == [base * m_count + max(m - (stages - 1 - s), 0) for s in range(stages)]
        assert vertical.versions[k] == [base * m_count + max(m - stages + 1, 0)] * stages
    assert not torch.equal(
        stash.params["layers.3.linear.weight"], vertical.params["layers.3.linear.weight"]
    )


def test_pipedream_mlp_matches_training_with_explicitly_stale_modules() -> None:
    """Brute force: each stage runs deep copies of its layers loaded with the stale version,
    chained by autograd; their gradients are added into the live model before each step."""
    spec, stages, m_count, iterations = mlp(), 3, 4, 2
    got = run(spec, build_schedule("pipedream", stages=stages, microbatches=m_count), iterations=2)
    cut = Partition.even(model="mlp", num_layers=spec.num_layers, num_stages=stages)
    model = spec.build_all(seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = [copy.deepcopy(model)]  # history[v]: the whole model after v updates
    batches = islice(spec.dataset().batches(8, seed=DATA_SEED, epoch=0), iterations)
    for it, (x, y) in enumerate(batches):
        for m in range(m_count):
            h = x[2 * m : 2 * m + 2]
            pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
            for s in range(stages):
                version = it * m_count + max(m - (stages - 1 - s), 0)
                for i in cut.layers(s):
                    stale = copy.deepcopy(history[version][i])
                    h = stale(h)
                    pairs += zip(model[i].parameters(), stale.parameters(), strict=True)
            spec.loss(h, y[2 * m : 2 * m + 2]).backward()
            for live, stale_p in pairs:
                live.grad = stale_p.grad
            opt.step()
            opt.zero_grad()
            history.append(copy.deepcopy(model))
    assert_params_close(got.params, layer_params(model), rtol=1e-5, atol=1e-6)


# ---- hand-computed updates on y = w1 * (w0 * x) ---------------------------------------------


class Scale(nn.Module):
    """``y = w * x`` with one scalar weight."""

    def __init__(self, init: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(init))

    def forward(self, x: Tensor) -> Tensor:
        return self.w * x


def _scalar_data(split: Split) -> Dataset:
    x = torch.linspace(-1.0, 1.0, 16)
    return Dataset(x, 1.5 * x + 0.1 * torch.sin(7 * x), name=f"scalar/{split}")


SCALAR = ModelSpec(
    name="scalar",
    config={},
    layers=(
        LayerSpec(name="w0", kind="Scale", make=partial(Scale, 0.8)),
        LayerSpec(name="w1", kind="Scale", make=partial(Scale, 1.2)),
    ),
    loss_fn=F.mse_loss,
    dataset_fn=_scalar_data,
)
SCALAR_LR = 0.3


def stale_scalar_training(
    *,
    m_count: int,
    iterations: int,
    batch_size: int,
    update_every: int,
    version: Callable[[int, int], int],
) -> tuple[float, float]:
    """By hand: micro-batch ``k`` uses ``w_s`` of update ``version(k, s)`` on stage ``s``.

    With ``a = w0``, ``b = w1`` of those versions, ``r_i = 2 (b a x_i - y_i) / n``:
    ``dL/dw1 = sum r_i a x_i`` and ``dL/dw0 = sum r_i b x_i`` (the gradient stage 1 sends
    back is computed with *its* version of ``w1``). Updates apply to the newest weights.
    """
    history = [(0.8, 1.2)]
    grad = [0.0, 0.0]
    stream = BatchStream(SCALAR.dataset(), batch_size=batch_size, seed=DATA_SEED)
    micro = batch_size // m_count
    k = 0
    for _ in range(iterations):
        x, y = next(stream)
        for m in range(m_count):
            xs, ys = (
                x[m * micro : (m + 1) * micro].tolist(),
                y[m * micro : (m + 1) * micro].tolist(),
            )
            a, b = history[version(k, 0)][0], history[version(k, 1)][1]
            r = [2 * (b * a * xi - yi) / len(xs) for xi, yi in zip(xs, ys, strict=True)]
            grad[0] += sum(ri * b * xi for ri, xi in zip(r, xs, strict=True)) / update_every
            grad[1] += sum(ri * a * xi for ri, xi in zip(r, xs, strict=True)) / update_every
            k += 1
            if k % update_every == 0:
                w0, w1 = history[-1]
                history.append((w0 - SCALAR_LR * grad[0], w1 - SCALAR_LR * grad[1]))
                grad = [0.0, 0.0]
    return history[-1]


def scalar_reference(
    schedule: Schedule, *, iterations: int, batch_size: int
) -> tuple[float, float]:
    got = train_reference(
        spec=SCALAR,
        schedule=schedule,
        partition=Partition(model="scalar", num_layers=2, bounds=(0, 1, 2)),
        make_optimizer=sgd(SCALAR_LR),
        batch_size=batch_size,
        iterations=iterations,
        seed=0,
        data_seed=DATA_SEED,
    )
    return got.params["layers.0.w"].item(), got.params["layers.1.w"].item()


def test_pipedream_two_stages_matches_hand_computed_stashed_weights() -> None:
    """Stage 1 uses the newest weights; stage 0 is one update behind (1F1B, NOAM 2)."""
    m_count, iterations = 4, 3

    def stash(k: int, s: int) -> int:
        it, m = divmod(k, m_count)
        return it * m_count + (m if s == 1 else max(m - 1, 0))

    want = stale_scalar_training(
        m_count=m_count, iterations=iterations, batch_size=8, update_every=1, version=stash
    )
    got = scalar_reference(
        build_schedule("pipedream", stages=2, microbatches=m_count),
        iterations=iterations,
        batch_size=8,
    )
    assert got == pytest.approx(want, rel=1e-5)
    fresh = stale_scalar_training(
        m_count=m_count, iterations=iterations, batch_size=8, update_every=1, version=lambda k, s: k
    )
    assert not math.isclose(got[0], fresh[0], rel_tol=1e-4)  # staleness is visible


def test_vertical_sync_matches_hand_computed_and_differs_from_stashing() -> None:
    """Vertical sync: stage 1 uses the version stage 0 used for the micro-batch."""
    m_count, iterations = 4, 3

    def vertical(k: int, s: int) -> int:
        it, m = divmod(k, m_count)
        return it * m_count + max(m - 1, 0)

    want = stale_scalar_training(
        m_count=m_count, iterations=iterations, batch_size=8, update_every=1, version=vertical
    )
    schedule = build_schedule("pipedream", stages=2, microbatches=m_count, vertical_sync=True)
    got = scalar_reference(schedule, iterations=iterations, batch_size=8)
    assert got == pytest.approx(want, rel=1e-5)
    stash = scalar_reference(
        build_schedule("pipedream", stages=2, microbatches=m_count),
        iterations=iterations,
        batch_size=8,
    )
    assert not math.isclose(got[1], stash[1], rel_tol=1e-4)


def test_2bw_batch_b_uses_version_b_minus_one() -> None:
    """2BW (§3.2.1): ``W(t+1) = W(t) - lr * grad f(W(t-1))``, batches of ``m`` micro-batches."""
    m, m_count, iterations = 2, 6, 2

    def two_bw(k: int, s: int) -> int:
        it, mb = divmod(k, m_count)
        return it * (m_count // m) + max(mb // m - 1, 0)

    want = stale_scalar_training(
        m_count=m_count, iterations=iterations, batch_size=12, update_every=m, version=two_bw
    )
    schedule = build_schedule("2bw", stages=2, microbatches=m_count, update_every=m)
    got = scalar_reference(schedule, iterations=iterations, batch_size=12)
    assert got == pytest.approx(want, rel=1e-5)


# ---- errors -------------------------------------------------------------------------------


def test_reference_rejects_mismatched_arguments() -> None:
    spec = mlp()
    schedule = build_schedule("gpipe", stages=2, microbatches=4)
    three = Partition.even(model="mlp", num_layers=4, num_stages=3)
    with pytest.raises(PlanError, match="partition has 3 stages but schedule 'gpipe' has 2"):
        train_reference(
            spec=spec,
            schedule=schedule,
            partition=three,
            make_optimizer=sgd(),
            batch_size=8,
            iterations=1,
            seed=0,
            data_seed=0,
        )
    with pytest.raises(ValueError, match="batch_size=6 must be a multiple"):
        run(spec, schedule, batch_size=6)


def test_versions_made_by_later_microbatches_are_rejected() -> None:
    schedule = build_schedule("pipedream", stages=2, microbatches=4)
    program = list(schedule.stages[0])
    i = next(i for i, ins in enumerate(program) if isinstance(ins, Forward) and ins.microbatch == 1)
    program[i] = dataclasses.replace(program[i], version=2)  # made after micro-batch 1
    bad = dataclasses.replace(schedule, stages=(tuple(program), schedule.stages[1]))
    with pytest.raises(ScheduleError, match="micro-batch 1 would use weight version 2"):
        _forward_versions(bad)


def test_a_sync_window_of_several_flushes_steps_between_them() -> None:
    # A job-array window of 3 rounds for one job: micro-batch r is a whole mini-batch,
    # stepped before the next one's forward. 2 windows of 3 x 8 samples must train as
    # 6 plain iterations of 8 (96 samples: one epoch, so the data order is the same).
    from adaptipe.japsp import JapspInstance
    from adaptipe.japsp.baselines import one_f_one_b_orders
    from adaptipe.japsp.window import unroll, window_schedule

    inst = JapspInstance.build([[1.0, 1.0]], [[2.0, 2.0]])
    window = window_schedule(inst, unroll(inst, one_f_one_b_orders(inst).orders, 3))
    got = run(mlp(), window, batch_size=24, iterations=2)
    want = run(mlp(), build_schedule("gpipe", stages=1, microbatches=1), iterations=6)
    assert got.versions == [[v, v] for v in range(6)]
    for key, value in want.params.items():
        torch.testing.assert_close(got.params[key], value, rtol=1e-6, atol=1e-7, msg=key)
