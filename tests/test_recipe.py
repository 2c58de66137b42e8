"""Learning-rate schedules (stateless, exact values) and clipping by a global norm that
does not depend on the partition."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from adaptipe.errors import PlanError
from adaptipe.runtime.recipe import (
    LrSchedule,
    clip_coefficient,
    global_norm,
    layer_sq_norm,
    scale_gradients,
)


def test_warmup_then_cosine_reaches_its_floor_and_stays() -> None:
    s = LrSchedule(kind="cosine", warmup=4, total=14, min_lr_ratio=0.1)
    assert [s.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(4) == 1.0
    assert s.factor(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s.factor(14) == pytest.approx(0.1) and s.factor(100) == pytest.approx(0.1)
    assert s.lr(2e-3, 0) == 2e-3 * 0.25


def test_step_and_constant() -> None:
    s = LrSchedule(kind="step", step_every=3, gamma=0.5)
    assert [s.factor(i) for i in range(7)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]
    assert LrSchedule().factor(10**6) == 1.0
    assert LrSchedule(warmup=2).factor(0) == 0.5


def test_same_schedule_as_torch_lambda_lr() -> None:
    """The stateless factor equals what torch's LambdaLR applies step by step."""
    s = LrSchedule(kind="cosine", warmup=3, total=20)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, s.factor)
    for i in range(25):
        assert opt.param_groups[0]["lr"] == pytest.approx(s.lr(0.1, i), rel=1e-12)
        opt.step()
        sched.step()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "linear"}, "allowed: constant, cosine, step"),
        ({"kind": "cosine", "warmup": 5, "total": 5}, "must exceed warmup"),
        ({"kind": "step"}, "step_every"),
        ({"warmup": -1}, "warmup"),
    ],
)
def test_bad_schedules_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        LrSchedule(**kwargs)  # type: ignore[arg-type]


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(6, 6) for _ in range(5)))
    model(torch.randn(4, 6)).pow(2).sum().backward()
    return model


def test_the_global_norm_is_the_same_for_every_cut_and_matches_torch() -> None:
    model = _model(0)
    layers = list(model)
    reference = float(nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    norms = set()
    for cut in range(1, 5):  # two stages, each computing its own layers' terms
        terms = {i: layer_sq_norm(layers[i]) for i in range(cut)}
        terms.update({i: layer_sq_norm(layers[i]) for i in range(cut, 5)})
        norms.add(global_norm(terms, 5))
    assert len(norms) == 1
    assert norms.pop() == pytest.approx(reference, rel=1e-6)
    with pytest.raises(ValueError, match=r"layers \[4\]"):
        global_norm({i: 1.0 for i in range(4)}, 5)


def test_clipping_scales_like_clip_grad_norm() -> None:
    ours, theirs = _model(1), _model(1)
    norm = global_norm({i: layer_sq_norm(m) for i, m in enumerate(ours)}, 5)
    coef = clip_coefficient(norm, 0.5)
    assert coef is not None and coef < 1
    scale_gradients(ours, coef)
    nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    assert clip_coefficient(norm, math.inf) is None
