"""The fast candidate scoring (one walk of the schedule for all candidates, issue 21)
decides exactly as the slow one did: `top_k` and `score` against the implementation
they replaced, kept here as the reference, on many random conditions; and
`first_iteration_times` against `iteration_times`, bit for bit."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

import numpy as np
import pytest

from adaptipe.controllers.candidates import (
    Bounds,
    candidates,
    layer_costs,
    link_bandwidths,
    score,
    top_k,
)
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.replan import predicted_time
from adaptipe.envs.episode import load_profile
from adaptipe.errors import PlanError
from adaptipe.sim.conditions import LayerCosts, first_iteration_times, iteration_times


def _reference_score(
    obs: Observation, cands: Iterable[Sequence[int]], slowdowns: Sequence[float]
) -> list[tuple[Bounds, float]]:
    """`score` before issue 21: the simulator once per candidate."""
    costs = layer_costs(obs)
    slow = np.asarray([list(slowdowns)], dtype=np.float64)
    out: list[tuple[Bounds, float]] = []
    seen: set[Bounds] = set()
    for cand in cands:
        bounds = tuple(int(b) for b in cand)
        if bounds in seen:
            continue
        seen.add(bounds)
        bws = np.asarray([link_bandwidths(obs, len(bounds) - 1)], dtype=np.float64)
        out.append((bounds, float(iteration_times(costs, bounds, slow, bws)[0])))
    out.sort(key=lambda bs: (bs[1], bs[0]))
    return out


def _reference_top_k(
    obs: Observation,
    slow: tuple[float, ...],
    k: int,
    *,
    include: Sequence[str] = ("autopipe", "dynpipe"),
    blocks: int = 8,
    screen: int | None = 8,
) -> list[tuple[Bounds, float]]:
    """`top_k` before issue 21: screened by `replan.predicted_time`, then the simulator."""
    found = set(candidates(obs, slow, include=include, blocks=blocks))
    found.discard(tuple(obs.bounds))
    ranked = sorted(found)
    if screen is not None and len(ranked) > k + screen:
        ranked.sort(key=lambda b: (predicted_time(obs, b, slow), b))
        ranked = ranked[: k + screen]
    return _reference_score(obs, ranked, slow)[:k]


def _random_case(rng: random.Random) -> tuple[Observation, tuple[float, ...]]:
    """A random observation: the reference GPT or a random model, its bounds, links,
    micro-batches and slowdowns; a quarter have equal layers and slowdowns (many ties)."""
    flat = rng.random() < 0.25
    if rng.random() < 0.5 and not flat:
        profile = load_profile("gpt")
        fwd = [x.forward_s for x in profile.layers]
        bwd = [x.backward_s for x in profile.layers]
        nbytes = [int(x.activation_bytes + x.gradient_bytes) for x in profile.layers]
    else:
        n = rng.randint(3, 20)
        work = [1e-3] * n if flat else [rng.uniform(1e-4, 5e-3) for _ in range(n)]
        fwd, bwd = [w / 3 for w in work], [2 * w / 3 for w in work]
        nbytes = [rng.choice([0, 1 << 20]) if not flat else 1 << 20] * n
    n = len(fwd)
    stages = rng.randint(2, min(6, n))
    bounds = (0, *sorted(rng.sample(range(1, n), stages - 1)), n)
    links = {
        f"{s}-{s + 1}": rng.choice([1e8, 1e9, 5e9, 2e10])
        for s in range(stages - 1)
        if rng.random() < 0.7
    }
    obs = Observation(
        iteration=0,
        bounds=bounds,
        layer_forward_s=tuple(fwd),
        layer_backward_s=tuple(bwd),
        boundary_bytes=tuple(nbytes),
        state_bytes=(0,) * n,
        link_bandwidth_Bps=links,
        microbatches=rng.choice([1, 2, 4, 8, 12, 16]),
    )
    levels = [1.0] if flat else [1.0, 1.0, 1.1, 1.8, 2.5, 3.2, rng.uniform(1.0, 4.0)]
    return obs, tuple(rng.choice(levels) for _ in range(stages))


@pytest.mark.parametrize("seed", range(4))
def test_top_k_decides_as_the_per_candidate_simulator_did(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        obs, slow = _random_case(rng)
        k = rng.choice([1, 2, 4, 6])
        kw = {
            "include": rng.choice([("autopipe", "dynpipe"), ("autopipe",), ("dynpipe",)]),
            "blocks": rng.choice([4, 8, 12]),
            "screen": rng.choice([0, 4, 8, None]),
        }
        want = _reference_top_k(obs, slow, k, **kw)  # type: ignore[arg-type]
        got = top_k(obs, slow, k, **kw)  # type: ignore[arg-type]
        assert [b for b, _ in got] == [b for b, _ in want]
        assert got == want  # the very same seconds: the sums are added in the same order
        every = set(candidates(obs, slow)) | {obs.bounds}
        assert score(obs, every, slow) == _reference_score(obs, every, slow)


def test_first_iteration_times_are_iteration_times_bit_for_bit() -> None:
    rng = random.Random(7)
    for schedule in ("1f1b", "gpipe", "pipedream", "2bw"):
        for _ in range(10):
            n, stages = rng.randint(2, 12), rng.randint(1, 5)
            stages = min(stages, n)
            costs = LayerCosts(
                forward_s=tuple(rng.uniform(0.1, 2.0) for _ in range(n)),
                backward_s=tuple(rng.uniform(0.1, 4.0) for _ in range(n)),
                activation_bytes=tuple(rng.choice([0, 100, 5000]) for _ in range(n)),
                gradient_bytes=tuple(rng.choice([0, 100, 5000]) for _ in range(n)),
                update_s=tuple(rng.uniform(0, 0.5) for _ in range(n)) if rng.random() < 0.5 else (),
                microbatches=stages * rng.randint(1, 3) if schedule == "2bw" else rng.randint(1, 9),
                schedule=schedule,
            )
            parts = [
                (0, *sorted(rng.sample(range(1, n), stages - 1)), n)
                for _ in range(rng.randint(1, 6))
            ]
            slow = np.asarray([[rng.uniform(0.5, 3.0) for _ in range(stages)] for _ in parts])
            bws = np.asarray(
                [[rng.choice([math.inf, 1e3, 1e5]) for _ in range(stages - 1)] for _ in parts]
            ).reshape(len(parts), stages - 1)
            got = first_iteration_times(costs, parts, slow, bws)
            want = [
                iteration_times(costs, b, slow[p : p + 1], bws[p : p + 1])[0]
                for p, b in enumerate(parts)
            ]
            assert got.tolist() == want


def test_first_iteration_times_refuse_what_iteration_times_refuses() -> None:
    costs = LayerCosts(
        forward_s=(1.0,) * 4, backward_s=(2.0,) * 4, activation_bytes=(0,) * 4,
        gradient_bytes=(0,) * 4,
    )  # fmt: skip
    with pytest.raises(PlanError, match="not a partition"):
        first_iteration_times(costs, [(0, 2, 2, 4)], np.ones((1, 3)), np.ones((1, 2)))
    with pytest.raises(PlanError, match="has not the 2 stages"):
        first_iteration_times(costs, [(0, 2, 4), (0, 1, 2, 4)], np.ones((2, 2)), np.ones((2, 1)))
    with pytest.raises(PlanError, match="finite and > 0"):
        first_iteration_times(costs, [(0, 2, 4)], np.zeros((1, 2)), np.ones((1, 1)))
