"""The profiler measures every layer: times, and bytes that match the tensors' shapes."""

from __future__ import annotations

import pytest
import torch

from adaptipe import PlanError, Profile
from adaptipe.models import get_model
from adaptipe.profile import profile_model
from adaptipe.profile.types import mean_profile


def _small_mlp():  # type: ignore[no-untyped-def]
    return get_model("mlp", in_features=16, hidden=32, depth=4, out_features=4, num_samples=64)


def test_mlp_profile_has_one_entry_per_layer_with_exact_bytes() -> None:
    spec = _small_mlp()
    prof = profile_model(spec, microbatch=8, warmup=1, repeats=3, optimizer="adam")
    assert prof.num_layers == spec.num_layers == 4
    assert [lp.name for lp in prof.layers] == spec.layer_names()
    assert all(lp.forward_s > 0 and lp.backward_s > 0 for lp in prof.layers)
    first, hidden, last = prof.layers[0], prof.layers[1], prof.layers[-1]
    assert first.activation_bytes == 8 * 32 * 4  # (batch, hidden) float32 out
    assert first.gradient_bytes == prof.input_bytes == 8 * 16 * 4
    assert hidden.param_bytes == (32 * 32 + 32) * 4
    assert hidden.num_params == 32 * 32 + 32
    assert hidden.optimizer_bytes == 2 * hidden.param_bytes  # Adam: two moments
    assert last.activation_bytes == 8 * 4 * 4
    # Linear+ReLU saves its input (and the ReLU output): at least the input stays stashed.
    assert hidden.saved_bytes >= 8 * 32 * 4
    # Parameters are not activations: the stash of a layer never counts its weights.
    assert hidden.saved_bytes < hidden.param_bytes + 8 * 32 * 4 * 3


def test_gpt_embedding_takes_token_ids_so_sends_no_input_gradient() -> None:
    spec = get_model("gpt", n_layer=1, d_model=32, n_head=2, block_size=16)
    prof = profile_model(spec, microbatch=2, warmup=0, repeats=1)
    assert prof.layers[0].gradient_bytes == 0
    assert prof.layers[0].activation_bytes == 2 * 16 * 32 * 4
    assert prof.layers[1].gradient_bytes == prof.layers[0].activation_bytes


def test_profile_survives_a_json_round_trip() -> None:
    prof = profile_model(_small_mlp(), microbatch=4, warmup=0, repeats=2)
    assert Profile.from_json(prof.to_json()) == prof
    assert prof.meta["torch"] == torch.__version__


def test_profiler_restores_thread_count_and_reports_progress() -> None:
    before = torch.get_num_threads()
    seen: list[tuple[int, int]] = []
    prof = profile_model(
        _small_mlp(),
        microbatch=4,
        warmup=0,
        repeats=1,
        threads=1,
        progress=lambda d, t, _n: seen.append((d, t)),
    )
    assert prof.threads == 1
    assert torch.get_num_threads() == before
    assert seen == [(i, 4) for i in range(1, 5)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"microbatch": 0}, "microbatch must be >= 1"),
        ({"microbatch": 2, "optimizer": "lion"}, "allowed: sgd, momentum, adam, adamw"),
        ({"microbatch": 2, "device": "tpu"}, "allowed: cpu, cuda, cuda:N"),
        ({"microbatch": 2, "repeats": 0}, "repeats must be >= 1"),
    ],
)
def test_bad_profiler_arguments_are_clear_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("(", r"\(")):
        profile_model(_small_mlp(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_a_gpu_says_so() -> None:
    with pytest.raises(PlanError, match="no CUDA device is available"):
        profile_model(_small_mlp(), microbatch=2, device="cuda")


def test_optimizer_step_time_is_measured_and_reaches_the_cost_model() -> None:
    from adaptipe.plan.partition import Partition
    from adaptipe.sim import CostModel

    prof = profile_model(_small_mlp(), microbatch=4, warmup=0, repeats=2, optimizer="adam")
    assert all(lp.update_s > 0 for lp in prof.layers)
    costs = CostModel.from_profile(prof, Partition(model="mlp", num_layers=4, bounds=(0, 1, 4)))
    assert costs.update_s[0][0] == pytest.approx(prof.layers[0].update_s)
    assert costs.update_s[0][1] == pytest.approx(sum(lp.update_s for lp in prof.layers[1:]))


def test_batched_weight_grad_timings_are_measured_and_survive_json() -> None:
    prof = profile_model(_small_mlp(), microbatch=4, warmup=0, repeats=2, wgrad_microbatches=3)
    assert prof.wgrad_microbatches == 3 and prof.has_batched_wgrad
    for lp in prof.layers:
        assert lp.backward_input_s is not None and lp.backward_input_s > 0
        assert lp.wgrad_s is not None and lp.wgrad_s > 0
    # Each layer is one Linear: a micro-batch keeps its input and its output gradient.
    widths = [(16, 32), (32, 32), (32, 32), (32, 4)]
    assert [lp.wgrad_bytes for lp in prof.layers] == [4 * (i + o) * 4 for i, o in widths]
    assert Profile.from_json(prof.to_json()) == prof


def test_profiles_without_batched_weight_grad_timings_still_load() -> None:
    prof = profile_model(_small_mlp(), microbatch=4, warmup=0, repeats=1)
    assert not prof.has_batched_wgrad
    data = prof.to_json()
    assert "backward_input_s" not in data["layers"][0]  # as written before these fields
    del data["wgrad_microbatches"]
    old = Profile.from_json(data)
    assert old == prof
    assert old.layers[0].wgrad_s is None and old.wgrad_microbatches == 0
    assert old.layers[0].wgrad_bytes is None


def test_mean_profile_averages_times_and_keeps_bytes() -> None:
    a = Profile.uniform(3, forward_s=1.0, backward_s=2.0, activation_bytes=8)
    b = Profile.uniform(3, forward_s=3.0, backward_s=4.0, activation_bytes=8)
    m = mean_profile([a, b])
    assert [lp.forward_s for lp in m.layers] == [2.0] * 3
    assert [lp.backward_s for lp in m.layers] == [3.0] * 3
    assert m.layers[0].activation_bytes == 8 and m.layers[0].wgrad_s is None
    assert mean_profile([a]) == a
    with pytest.raises(PlanError, match="different models"):
        mean_profile([a, Profile.uniform(4, forward_s=1.0, backward_s=2.0)])
    with pytest.raises(PlanError, match="no profiles"):
        mean_profile([])
