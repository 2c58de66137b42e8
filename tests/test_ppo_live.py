"""(slow) The shipped 2-stage switch policy decides live: ``[adapt] controller = "ppo"``
on a real two-stage run builds it through `load_switch(stages=2)`, and under a 4x
slowdown of stage 1 it moves layers off that stage."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from adaptipe.controllers.live import decider as live_decider
from adaptipe.runtime import train
from adaptipe.runtime.config import RunConfig
from tests.test_adapt_loop import slowed_config


@pytest.mark.slow
def test_the_2_stage_policy_moves_layers_off_a_slowed_stage_in_a_real_run(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    cfg, scenario = slowed_config(
        make_config,
        tmp_path,
        train={"iterations": 50},
        adapt={"controller": "ppo", "check_every": 2, "window": 4},
    )
    train(cfg, inject=scenario, decider=live_decider)
    lines = (Path(cfg.train.run_dir) / "control.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    decisions = [e for e in events if e["event"] == "decision" and e.get("decision")]
    assert decisions and all(e["controller"] == "ppo" for e in decisions)
    # before the policy, the decider measures its baseline (no profile in this run)
    policy = [e for e in decisions if not e["decision"]["reason"].startswith("measuring")]
    assert policy and all(e["decision"]["reason"].startswith("ppo ") for e in policy)
    late = [e for e in policy if e["acted"] and e["iteration"] >= 10]
    assert any(e["decision"]["bounds"][1] > e["bounds"][1] for e in late)  # off stage 1
    assert any(e["event"] == "migration" and e["ok"] for e in events)
