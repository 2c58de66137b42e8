"""Online fine-tuning of the speed predictor (`adaptipe.controllers.online`): it lowers
the error on a run whose iterations take 30% more than the simulator says (a drift the
shipped network never saw), keeps to its CPU budget per round, saves the adapted
weights under the run directory and never over the shipped ones, and a resumed run
serves with them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from adaptipe.controllers.artifacts import SHIPPED
from adaptipe.controllers.live import decider as live_decider
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.online import ADAPTED_DIR, OnlineSettings, OnlineTuner
from adaptipe.controllers.predictor import Predictor, load_predictor
from adaptipe.runtime.adapt_loop import AdaptLoop
from adaptipe.runtime.adapt_state import save_state
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import prepare
from tests.test_chain import QUIET, make_obs, stage_times

OVERHEAD = 1.3  # what the real iterations add to the simulated ones
EVERY = 4  # iterations between decisions
BLOCK = 1000  # iterations at one level of slowdowns: the tests run at one


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """As in the manager (`adaptipe.controllers.live`): torch on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(n: int, seed: int = 0) -> list[list[float]]:
    """Per iteration, per stage: slowdowns that change every BLOCK iterations."""
    rng = np.random.default_rng(seed)
    out: list[list[float]] = []
    while len(out) < n:
        level = [1.0, *rng.choice([1.0, 1.5, 2.0], size=3)]
        out += [level] * BLOCK
    return out[:n]


def _decisions(count: int, rows: list[list[float]]) -> list[Observation]:
    return [make_obs(rows[d * EVERY : d * EVERY + 8], first=d * EVERY, overhead=OVERHEAD)
            for d in range(count)]  # fmt: skip


def _feed(tuner: OnlineTuner, predictor: Predictor, observations: list[Observation]) -> None:
    for obs in observations:
        times = {
            it: float(np.mean(r))
            for it, r in zip(obs.iterations, obs.stage_iteration_s, strict=True)
        }
        seconds, enc = predictor.predict_encoded(obs, [obs.bounds])
        tuner.observed(obs, enc, seconds, [obs.bounds], times)


def _error(predictor: Predictor, obs: Observation, true: float) -> float:
    return abs(predictor.predict(obs, [obs.bounds])[0] / true - 1)


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_tuning_lowers_the_error_of_a_drifted_run_within_its_budget(tmp_path: Path) -> None:
    shipped_files = _digests(SHIPPED)
    rows = _rows(140)
    predictor, shipped = load_predictor(), load_predictor()
    budget = 0.05
    tuner = OnlineTuner(
        predictor,
        OnlineSettings(budget_s=budget, passes=1000, background=False),
        out=tmp_path / "run" / ADAPTED_DIR,
        root=tmp_path / "run",
    )
    _feed(tuner, predictor, _decisions(24, rows))
    summary = tuner.summary()
    assert summary["samples"] >= 15 and summary["rounds"] == summary["samples"]
    # the budget binds (the passes never would) and is kept, but for the step under way
    assert max(tuner.round_cpu_s) >= budget and max(tuner.round_cpu_s) < budget + 0.03
    assert summary["mape_in_service"] < summary["mape_shipped"]
    # later iterations, never tuned on: a window at 110, its next 10 iterations' mean
    obs = make_obs(rows[103:111], first=103, overhead=OVERHEAD)
    true = float(np.mean([max(r) for r in stage_times(rows[111:121], QUIET)])) * OVERHEAD
    before, after = _error(shipped, obs, true), _error(predictor, obs, true)
    assert before > 0.1 and after < before / 2, (before, after)
    saved = tuner.state_dict()
    folder = tmp_path / "run" / saved["path"]
    assert folder.parent == tmp_path / "run" / ADAPTED_DIR and (folder / "artifact.json").exists()
    assert _digests(SHIPPED) == shipped_files  # the shipped artifacts untouched


def test_a_resumed_run_serves_with_the_adapted_weights(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = make_config(
        pipeline={"stages": 4},
        adapt={"controller": "ppo", "online": True, "online_budget_s": 0.05},
    )
    run, _ = prepare(cfg)
    first = live_decider(run, cfg)
    chain = first.controller
    tuner = chain.tuner  # type: ignore[attr-defined]
    assert isinstance(tuner, OnlineTuner)
    tuner.settings = replace(tuner.settings, background=False)
    _feed(tuner, chain.predictor, _decisions(8, _rows(60)))  # type: ignore[attr-defined]
    assert tuner.rounds > 0
    save_state(run.root, 30, controller="ppo", paused=False, last_move=None, decider=first)
    adapted = {k: v.clone() for k, v in chain.predictor.network.state_dict().items()}  # type: ignore[attr-defined]

    second = live_decider(run, cfg)
    fresh = second.controller.predictor.network.state_dict()  # type: ignore[attr-defined]
    assert any(not torch.equal(fresh[k], adapted[k]) for k in adapted)  # shipped, so far
    loop = AdaptLoop(run, cfg.adapt, second, lambda since: [], start=30)
    (restored,) = loop.poll([])
    assert restored["event"] == "adapt_restored" and "error" not in restored
    served = second.controller.predictor.network.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(served[k], adapted[k]) for k in adapted)
    described = second.describe()["artifacts"]
    assert Path(described[1]["path"]).parent == run.root / ADAPTED_DIR


def test_weights_that_changed_after_the_save_are_refused_and_the_shipped_serve(
    tmp_path: Path,
) -> None:
    predictor = load_predictor()
    tuner = OnlineTuner(
        predictor,
        OnlineSettings(budget_s=0.05, background=False),
        out=tmp_path / ADAPTED_DIR,
        root=tmp_path,
    )
    _feed(tuner, predictor, _decisions(8, _rows(60)))
    saved = tuner.state_dict()
    other = OnlineTuner(load_predictor(), root=tmp_path)
    other.load_state_dict(saved | {"sha256": "0" * 64})
    assert "adapted weights not restored" in str(other.summary()["error"])
    shipped = load_predictor().network.state_dict()
    serving = other.predictor.network.state_dict()
    assert all(torch.equal(serving[k], shipped[k]) for k in shipped)


def test_settings_are_checked() -> None:
    from adaptipe.errors import PlanError

    with pytest.raises(PlanError, match="budget_s"):
        OnlineSettings(budget_s=0)
    with pytest.raises(PlanError, match="capacity"):
        OnlineSettings(capacity=0)


def test_a_round_runs_on_its_own_thread_and_the_decision_does_not_wait() -> None:
    predictor = load_predictor()
    tuner = OnlineTuner(predictor, OnlineSettings(budget_s=0.5, passes=10**6))
    serving = predictor.network
    observations = _decisions(5, _rows(40))
    _feed(tuner, predictor, observations[:4])  # labels the first decision: a round starts
    assert tuner._tuning is not None and tuner._tuning.is_alive() and tuner.rounds == 0
    assert predictor.network is serving  # the decision serves with the network it had
    tuner.wait(120)
    assert tuner.rounds == 1 and predictor.network is not serving
    assert 0.5 <= tuner.round_cpu_s[0] < 0.53
