"""The learned chain live (`adaptipe.controllers.chain`): forest, candidates, predictor,
policy on constructed observations of the zoo GPT (16 layers, 4 stages, the shipped
models' pipeline): a slowed stage loses layers, a quiet pipeline keeps, the inputs
name what every model said, each model's fallback is stated, and ``describe`` names
the three artifacts by hash."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from adaptipe.controllers.chain import RISE, Chain, combine
from adaptipe.controllers.live import LiveDecider, from_settings
from adaptipe.controllers.live import decider as live_decider
from adaptipe.controllers.model_lag import ModelLag
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.recall import Recall
from adaptipe.monitor.features import FEATURES
from adaptipe.monitor.schema import Record, StageStats
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.runtime.adapt_config import AdaptSection
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import prepare
from adaptipe.serial import load_json_file

QUIET = (0, 4, 8, 12, 16)
ROOT = Path(__file__).resolve().parent.parent
PROFILE = load_json_file(ROOT / "envs" / "profiles" / "gpt.json", Profile.from_json)
MB = 8  # micro-batches an iteration


def stage_times(rows: Sequence[Sequence[float]], bounds: Sequence[int]) -> list[list[float]]:
    """Per iteration, per stage: its compute seconds an iteration at ``rows``' slowdowns."""
    out = []
    for row in rows:
        out.append(
            [
                row[s] * MB * sum(x.forward_s + x.backward_s for x in PROFILE.layers[a:b])
                for s, (a, b) in enumerate(itertools.pairwise(bounds))
            ]
        )
    return out


def make_obs(
    rows: Sequence[Sequence[float]],
    *,
    bounds: Sequence[int] = QUIET,
    overhead: float = 1.0,
    first: int = 0,
    device: Sequence[Sequence[float]] = (),
    profile: Profile = PROFILE,
) -> Observation:
    """An observation of ``len(rows)`` iterations from ``first``, stage ``s`` at
    ``rows[i][s]`` times its profiled seconds; each iteration takes the slowest stage's
    seconds times ``overhead``."""
    fwd, bwd = [], []
    for row in rows:
        owner = [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
        fwd.append(tuple(x.forward_s * row[owner[i]] for i, x in enumerate(profile.layers)))
        bwd.append(tuple(x.backward_s * row[owner[i]] for i, x in enumerate(profile.layers)))
    stages = stage_times(rows, bounds) if profile is PROFILE else [[0.1] * 4 for _ in rows]
    per_it = tuple((max(st) * overhead,) * (len(bounds) - 1) for st in stages)
    return replace(
        Observation.from_profile(profile, bounds, microbatches=MB),
        iteration=first + len(rows) - 1,
        iterations=tuple(range(first, first + len(rows))),
        measured_forward_s=tuple(fwd),
        measured_backward_s=tuple(bwd),
        stage_compute_s=per_it,
        stage_iteration_s=per_it,
        device=tuple(tuple(r) for r in device),
    )


@pytest.fixture(scope="module")
def chain() -> Chain:
    built = from_settings(AdaptSection(controller="ppo"), stages=4)
    assert isinstance(built, Chain)
    return built


def test_a_slowed_stage_loses_layers_and_a_quiet_pipeline_keeps(chain: Chain) -> None:
    quiet, said = chain.explain(make_obs([[1.0] * 4] * 8))
    assert not quiet.moves and said["chosen"] is None and said["ranked_by"] == "predictor"
    decision, said = chain.explain(make_obs([[1.0, 3.0, 1.0, 1.0]] * 8))
    assert decision.bounds is not None
    assert decision.bounds[2] - decision.bounds[1] < 4  # layers off stage 1
    assert said["chosen"] == list(decision.bounds) == said["best"]
    assert said["measured_slowdowns"] == [1.0, 3.0, 1.0, 1.0] == said["slowdowns"]
    assert said["policy_action"] == 1 and said["ranked_by"] == "predictor"
    predicted = {tuple(c["bounds"]): c["predicted_ms"] for c in said["candidates"]}
    assert len(predicted) == 4 and min(predicted.values()) == predicted[decision.bounds]
    gain = said["in_force_predicted_ms"] - predicted[decision.bounds]
    assert gain == pytest.approx(said["predicted_gain_ms"], abs=2e-3) and gain > 0
    assert decision.predicted_gain_s == pytest.approx(gain / 1e3, abs=1e-5)


def test_a_partition_held_before_is_ranked_at_what_it_measured(chain: Chain) -> None:
    # (0, 5, 8, 12, 16) predicted within the margin of the quiet cut, and measured 1.5x
    # its prediction; the quiet cut had measured about its own
    near = (0, 5, 8, 12, 16)
    blind = Chain(chain.policy, predictor=chain.predictor)
    assert not blind.explain(make_obs([[1.0] * 4] * 8, bounds=near, overhead=1.5))[0].moves
    recall = Recall(min_checks=1)
    seen = Chain(chain.policy, predictor=chain.predictor, recall=recall)
    seen.explain(make_obs([[1.0] * 4] * 8))
    decision, said = seen.explain(make_obs([[1.0] * 4] * 8, bounds=near, overhead=1.5))
    assert decision.bounds == QUIET
    held = said["recalled_ms"]
    assert held["0,5,8,12,16"] / held["0,4,8,12,16"] == pytest.approx(1.5, rel=0.1)
    assert set(seen.state_dict()["recall"]["seen"]) == {"0,4,8,12,16/8", "0,5,8,12,16/8"}


def test_the_slowdowns_rule_measured_stale_and_anticipated() -> None:
    up = 1 + RISE + 0.1
    slow, source = combine(
        measured=[1.0, 1.0, 1.0, 2.0, 1.0],
        latest=[1.0, up, up, 2.0, 3.0],
        forest=[1.5, up + 1, 1.0, 1.2, None],
        fresh=[True, True, True, False, True],
    )
    # stage 0: the forest alone disagrees; 1: both rose (the smaller taken); 2: only the
    # last iteration rose; 3: stale, the forest's; 4: no forest, measured
    assert slow == [1.0, up, 1.0, 1.2, 1.0]
    assert source == ["measured", "anticipated", "measured", "forest", "measured"]


class _Forest:
    """Stands in for the forest: a fixed slowdown per stage, rows it was asked for."""

    def __init__(self, slow: Sequence[float]) -> None:
        self.slow, self.rows = list(slow), 0

    def predict(self, rows: np.ndarray) -> np.ndarray:
        self.rows += len(rows)
        return np.asarray(self.slow[: len(rows)])


def test_a_load_the_forest_and_the_last_iteration_agree_on_is_anticipated(
    chain: Chain,
) -> None:
    rows = [[1.0] * 4] * 6 + [[1.0, 3.0, 1.0, 1.0]] * 2  # the median still says 1.0
    device = [[0.5] * len(FEATURES)] * 4
    forest = _Forest([1.0, 2.5, 1.0, 1.0])
    seen = Chain(chain.policy, predictor=chain.predictor, interference=forest)  # type: ignore[arg-type,unused-ignore]
    _, said = seen.explain(make_obs(rows, device=device))
    assert forest.rows == 4 and said["forest_slowdowns"] == [1.0, 2.5, 1.0, 1.0]
    assert said["slowdowns"] == [1.0, 2.5, 1.0, 1.0] and said["sources"][1] == "anticipated"
    assert all(c["bounds"][2] - c["bounds"][1] < 4 for c in said["candidates"])
    # one slow iteration alone (a stall) is not a load that arrived, forest or not
    spike = [[1.0] * 4] * 7 + [[1.0, 3.0, 1.0, 1.0]]
    _, once = seen.explain(make_obs(spike, device=device))
    assert once["slowdowns"][1] == pytest.approx(1.0) and once["sources"][1] == "measured"
    _, blind = seen.explain(make_obs(rows))  # no device status: measured only, and said
    assert blind["slowdowns"] == [1.0] * 4 and forest.rows == 8
    assert "interference: no device status on this run" in blind["fallbacks"]


def test_each_model_that_cannot_serve_is_a_stated_fallback(chain: Chain) -> None:
    short = replace(PROFILE, layers=PROFILE.layers[:12])  # a pipeline the predictor never saw
    obs = make_obs([[1.0, 3.0, 1.0, 1.0]] * 8, bounds=(0, 3, 6, 9, 12), profile=short)
    decision, said = chain.explain(obs)
    assert said["ranked_by"] == "simulator"
    assert any("trained for 16 layers on 4 stages" in f for f in said["fallbacks"])
    assert decision.bounds is None or decision.bounds[2] - decision.bounds[1] < 3
    alone = Chain(chain.policy, why=["predictor: not loaded (gone)"])
    _, said = alone.explain(make_obs([[1.0, 3.0, 1.0, 1.0]] * 8))
    assert said["ranked_by"] == "simulator" and said["fallbacks"] == [
        "predictor: not loaded (gone)"
    ]
    assert said["forest_slowdowns"] == [None] * 4 and said["chosen"] is not None


def _records(rows: Sequence[Sequence[float]], bounds: Sequence[int] = QUIET) -> list[Record]:
    out: list[Record] = []
    for it, (row, st) in enumerate(zip(rows, stage_times(rows, bounds), strict=True)):
        for s in range(4):
            lo, hi = bounds[s], bounds[s + 1]
            out.append(
                StageStats(
                    run_id="r", stage=s, iteration=it, time_s=100.0 + it, first_layer=lo,
                    forward_s=tuple(MB * row[s] * x.forward_s for x in PROFILE.layers[lo:hi]),
                    backward_s=tuple(MB * row[s] * x.backward_s for x in PROFILE.layers[lo:hi]),
                    compute_s=st[s], wait_s=0.0, comm_s=0.0, iteration_s=max(st),
                )
            )  # fmt: skip
    return out


def test_the_live_decider_logs_what_each_model_said(chain: Chain) -> None:
    decider = LiveDecider(chain, PROFILE, window=8, workers=4, microbatches=MB)
    partition = Partition(model="gpt", num_layers=16, bounds=QUIET)
    verdict = decider(_records([[1.0, 3.0, 1.0, 1.0]] * 10), partition)
    assert verdict.bounds is not None and verdict.decision["bounds"] == list(verdict.bounds)
    logged = verdict.inputs
    assert logged["slowdowns"] == [1.0, 3.0, 1.0, 1.0] and logged["window"] == [2, 9]
    said = logged["chain"]
    assert said["chosen"] == list(verdict.bounds) and said["measured_slowdowns"][1] == 3.0
    assert {"forest_slowdowns", "candidates", "predicted_gain_ms", "fallbacks"} <= set(said)


def test_describe_names_the_three_artifacts_by_hash(
    make_config: Callable[..., RunConfig],
) -> None:
    run, _ = prepare(make_config(pipeline={"stages": 4}, adapt={"controller": "ppo"}))
    described = live_decider(run, run.read_config()).describe()
    assert described["controller"] == "ppo"
    artifacts = described["artifacts"]
    assert [a["model"] for a in artifacts] == ["switch", "predictor", "interference"]
    for artifact in artifacts:
        manifest = (Path(artifact["path"]) / "artifact.json").read_bytes()
        assert artifact["sha256"] == hashlib.sha256(manifest).hexdigest()


def test_the_online_fields_are_read_and_checked(make_config: Callable[..., RunConfig]) -> None:
    from adaptipe.errors import PlanError

    cfg = make_config(adapt={"controller": "ppo", "online": True, "online_budget_s": 0.5})
    assert (cfg.adapt.online, cfg.adapt.online_budget_s) == (True, 0.5)
    assert AdaptSection().online is False
    with pytest.raises(PlanError, match=r"test.toml: \[adapt\].online_budget_s must be > 0"):
        make_config(adapt={"online_budget_s": 0})
    with pytest.raises(PlanError, match=r"\[adapt\].online"):
        make_config(adapt={"online": "yes"})


def test_a_check_its_model_cannot_explain_waits_once(chain: Chain) -> None:
    """A link's first readings after a step come a check after its slow iterations:
    a check measured far beyond the model's usual figure keeps, once."""
    fresh = Chain(chain.policy, predictor=chain.predictor)
    for _ in range(3):
        assert not fresh.explain(make_obs([[1.0] * 4] * 8))[0].moves
    # stage 1 slowed as measured, and the iteration 3x longer than that explains
    unexplained = make_obs([[1.0, 3.0, 1.0, 1.0]] * 8, overhead=3.0)
    waited, said = fresh.explain(unexplained)
    assert not waited.moves and "ppo waits a check" in waited.reason
    assert said["chosen"] is None and not fresh.settled()
    assert fresh.explain(unexplained)[0].moves  # once: the factors start afresh
    assert len(fresh.state_dict()["lag"]["factors"]) == 1
    never = Chain(chain.policy, predictor=chain.predictor, lag=ModelLag(0))
    for _ in range(3):
        never.explain(make_obs([[1.0] * 4] * 8))
    assert never.explain(unexplained)[0].moves
