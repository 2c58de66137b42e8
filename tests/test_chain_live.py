"""The learned chain in a real run: ``[adapt] controller = "ppo"`` on four stages of
the tiny MLP with stage 1 slowed 4x from iteration 10. The predictor knows only the
zoo GPT's 16 layers, so the simulator ranks the candidates (a stated fallback); the
forest reads the stages' device samples; the policy decides. Every decision is an event
with what each model said, and a move takes layers off stage 1."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from adaptipe.controllers.live import decider as live_decider
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import train
from tests.test_adapt_loop import _control, slowed_config


@pytest.mark.slow
def test_the_chain_decides_live_and_moves_layers_off_a_slowed_stage(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    cfg, scenario = slowed_config(
        make_config,
        tmp_path,
        train={"iterations": 60},
        adapt={"controller": "ppo", "check_every": 2, "window": 4, "cooldown": 1000},
        pipeline={"stages": 4},
    )
    started = time.monotonic()
    train(cfg, inject=scenario, decider=live_decider)
    events = _control(Path(cfg.train.run_dir))
    decisions = [e for e in events if e["event"] == "decision"]
    assert decisions and all(e["controller"] == "ppo" and "error" not in e for e in decisions)
    measuring = [e for e in decisions if "chain" not in e.get("inputs", {})]
    assert all("measuring the baseline" in e["decision"]["reason"] for e in measuring)
    decisions = [e for e in decisions if e not in measuring]
    said = [e["inputs"]["chain"] for e in decisions]
    assert all(s["ranked_by"] == "simulator" for s in said)
    assert said and all(any("trained for 16 layers" in f for f in s["fallbacks"]) for s in said)
    assert all(len(s["forest_slowdowns"]) == 4 for s in said)
    moves = [e for e in decisions if e["acted"]]
    assert len(moves) == 1 and moves[0]["iteration"] >= 10, [s.get("chosen") for s in said]
    before, after = moves[0]["bounds"], moves[0]["decision"]["bounds"]
    assert after[2] - after[1] < before[2] - before[1]  # layers off stage 1
    assert moves[0]["inputs"]["chain"]["chosen"] == after
    assert any(e["event"] == "migration" and e["ok"] for e in events)
    latency = sorted(e["seconds"] for e in decisions)
    print(f"{len(decisions)} decisions, median {latency[len(latency) // 2] * 1e3:.1f} ms, "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
