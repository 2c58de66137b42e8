"""How many updates asynchronous 1F1B needs to converge with S stages (DynPipe §IV-B).

Weight stashing gives stage i a staleness of S - i updates (DynPipe Eq. 1). Under
L-smoothness and a bounded second moment xi^2 of the stochastic gradient, Theorem 1
(Eq. 2) bounds the average squared gradient norm by

    2 (f(w0) - f(wT)) / (T eta) + 2 eta^2 S^3 L^2 xi^2 + 2 sigma^2 / B,

and asking it (without the batch-noise term, with f(wT) ~ 0) to fall below epsilon
gives the iteration count of Eq. 3, T(S) >= 2 f0 / (eta (epsilon - 2 eta^2 S^3 L^2 xi^2)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError

__all__ = ["StalenessModel", "estimate_staleness_model"]


@dataclass(frozen=True, slots=True)
class StalenessModel:
    """The constants of DynPipe's convergence bound (Eq. 2).

    Attributes:
        f0: loss at the initial weights, f(w^(0)) (> 0).
        lr: learning rate eta (> 0).
        epsilon: target bound on the average squared gradient norm (> 0).
        smoothness: L of Assumption 1 (>= 0).
        grad_second_moment: xi^2 of Assumption 2 (>= 0).
    """

    f0: float
    lr: float
    epsilon: float
    smoothness: float
    grad_second_moment: float

    def __post_init__(self) -> None:
        for name in ("f0", "lr", "epsilon"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PlanError(f"StalenessModel.{name} must be a finite number > 0 (got {value})")
        for name in ("smoothness", "grad_second_moment"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise PlanError(f"StalenessModel.{name} must be a finite number >= 0 (got {value})")

    @property
    def theorem_applies(self) -> bool:
        """Theorem 1 is proven for eta L <= 1; outside it Eq. 3 is only a heuristic."""
        return self.lr * self.smoothness <= 1.0

    def iterations(self, num_stages: int) -> float:
        """Updates needed with ``num_stages`` stages (DynPipe Eq. 3); inf if epsilon is
        out of reach because the staleness term 2 eta^2 S^3 L^2 xi^2 alone exceeds it."""
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise PlanError(f"num_stages must be an integer >= 1 (got {num_stages!r})")
        staleness = 2.0 * self.lr**2 * num_stages**3 * self.smoothness**2 * self.grad_second_moment
        room = self.epsilon - staleness
        if room <= 0:
            return math.inf
        return 2.0 * self.f0 / (self.lr * room)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _flat(values: Sequence[npt.ArrayLike], name: str) -> list[npt.NDArray[np.float64]]:
    out = [np.asarray(v, dtype=np.float64).ravel() for v in values]
    for t, v in enumerate(out):
        if v.shape != out[0].shape:
            raise PlanError(f"{name}[{t}] has {v.size} elements but {name}[0] has {out[0].size}")
        if not np.all(np.isfinite(v)):
            raise PlanError(f"{name}[{t}] holds a non-finite value")
    return out


def estimate_staleness_model(
    weights: Sequence[npt.ArrayLike],
    grads: Sequence[npt.ArrayLike],
    *,
    f0: float,
    lr: float,
    epsilon: float,
) -> StalenessModel:
    """Estimate L and xi^2 from a few training iterations (DynPipe §IV-B, after Eq. 3).

    ``weights[t]`` and ``grads[t]`` are the (flattened) model weights and the stochastic
    gradient at iteration t. L is the median over t >= 1 of
    ||g_t - g_{t-1}|| / ||w_t - w_{t-1}|| (the median resists the noise of single
    stochastic-gradient samples); xi^2 is the mean of ||g_t||^2 over all samples.
    """
    if len(weights) != len(grads):
        raise PlanError(
            f"estimate_staleness_model: got {len(weights)} weight samples but {len(grads)} gradient samples "
            "(need one gradient per weight sample)"
        )
    if len(weights) < 2:
        raise PlanError(
            f"estimate_staleness_model: needs at least 2 (weights, gradient) samples to measure "
            f"smoothness (got {len(weights)})"
        )
    w = _flat(weights, "weights")
    g = _flat(grads, "grads")
    if w[0].shape != g[0].shape:
        raise PlanError(f"weights have {w[0].size} elements but grads have {g[0].size}")
    ratios = []
    for t in range(1, len(w)):
        step = float(np.linalg.norm(w[t] - w[t - 1]))
        if step == 0.0:
            raise PlanError(
                f"estimate_staleness_model: weights[{t}] equals weights[{t - 1}]; the smoothness "
                "estimate ||g_t - g_(t-1)|| / ||w_t - w_(t-1)|| needs the weights to change between samples"
            )
        ratios.append(float(np.linalg.norm(g[t] - g[t - 1])) / step)
    smoothness = float(np.median(ratios))
    second_moment = float(np.mean([float(np.dot(gt, gt)) for gt in g]))
    return StalenessModel(
        f0=f0, lr=lr, epsilon=epsilon, smoothness=smoothness, grad_second_moment=second_moment
    )
