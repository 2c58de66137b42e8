"""The adaptive demo (`make demo`): its phase table, the report's comparison line, and
(slow) the whole demo: a controller moves layers off the slowed stage, throughput comes
back, and every job trains exactly what the static run trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptipe.adaptive_demo import adaptive_demo, phase_table
from adaptipe.monitor.report import make_report


def _metrics(spans: list[float], samples: int = 64) -> list[dict[str, float]]:
    return [
        {"iteration": i, "iteration_s": s, "samples": samples, "samples_per_s": samples / s}
        for i, s in enumerate(spans)
    ]


def test_phases_split_at_the_move_and_count_its_stall_before_it() -> None:
    static = _metrics([0.5] * 10 + [1.5] * 20)
    adaptive = _metrics([0.5] * 10 + [1.5] * 4 + [0.75] * 16)
    phases = phase_table(static, adaptive, onset=10, switched=13, iterations=30)
    assert [(p.name, p.first, p.last) for p in phases] == [
        ("before the slowdown", 0, 9),
        ("slowed, until the move", 10, 13),
        ("slowed, after the move", 14, 29),
    ]
    assert phases[0].ratio == pytest.approx(1.0)
    assert phases[1].ratio == pytest.approx(1.0)
    assert phases[2].static == pytest.approx(64 / 1.5)
    assert phases[2].ratio == pytest.approx(2.0)


def test_without_a_move_the_slowed_iterations_are_one_phase() -> None:
    m = _metrics([0.5] * 30)
    phases = phase_table(m, m, onset=10, switched=None, iterations=30)
    assert [(p.name, p.first, p.last) for p in phases] == [
        ("before the slowdown", 0, 9),
        ("slowed", 10, 29),
    ]
    # a move in the last iteration leaves no "after" to measure
    assert len(phase_table(m, m, onset=10, switched=29, iterations=30)) == 2


def _run_dir(root: Path, spans: list[float]) -> Path:
    root.mkdir()
    metrics = [
        m | {"loss": 1.0, "stages": [{"compute_s": 0.1, "wait_s": 0.0, "comm_s": 0.0}]}
        for m in _metrics(spans)
    ]
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return root


def test_the_report_draws_a_compared_run_and_names_it(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "adaptive", [0.5] * 20)
    other = _run_dir(tmp_path / "static", [1.0] * 20)
    page = make_report(run, tmp_path / "out", compare={"static plan": other})
    text = page.read_text()
    assert "static plan" in text and str(other.resolve()) in text
    plain = make_report(run, tmp_path / "plain")
    assert "also draws" not in plain.read_text()
    # the extra line makes a different picture
    assert (tmp_path / "out" / "throughput.png").read_bytes() != (
        tmp_path / "plain" / "throughput.png"
    ).read_bytes()


@pytest.mark.slow  # two job-array runs of 4 jobs: about a minute on 2 idle cores
def test_the_demo_moves_layers_recovers_and_keeps_every_job_exact(tmp_path: Path) -> None:
    result = adaptive_demo(tmp_path / "demo", iterations=45, factor=4.0)
    assert result.report.exists() and (tmp_path / "demo" / "demo.json").exists()
    assert result.moves and all(m["ok"] for m in result.moves)
    after = result.phases[-1]
    assert after.name == "slowed, after the move", result.phases
    assert after.ratio is not None and after.ratio > 1.3, result.phases
    # live migration changes where layers run, never what they compute
    static = [json.loads(x) for x in (result.static_dir / "metrics.jsonl").read_text().splitlines()]
    moved = [
        json.loads(x) for x in (result.adaptive_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["losses"] for m in static] == [m["losses"] for m in moved]
