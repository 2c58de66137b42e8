"""The migration cost model against the benchmark's own figures: `MigrationCost` fitted
on what ``bench/bench_migration.py`` measured (kept in ``bench/results/``) explains
those moves, and its defaults are that fit, so the controllers and ``[adapt] transfer =
"auto"`` price a move the way the runtime paid it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from adaptipe.sim.migration import MigrationCost

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "bench_migration.json"


def _figures() -> dict[str, Any]:
    data = json.loads(RESULTS.read_text())
    return dict(data["cost_model"])


def test_the_fit_is_the_one_the_benchmark_reports() -> None:
    figures = _figures()
    cost = MigrationCost.fit([(int(b), bw, s) for b, bw, s in figures["stop_and_copy"]])
    cost = cost.fit_streamed([(int(b), s) for b, s in figures["streamed"]])
    for key, value in figures["cost"].items():
        assert cost.to_json()[key] == pytest.approx(value), key


def test_the_fit_explains_each_size_moved() -> None:
    figures = _figures()
    cost = MigrationCost(**figures["cost"])
    copied = figures["stop_and_copy"]
    for size in sorted({int(b) for b, _, _ in copied}):
        mine = [(bw, s) for b, bw, s in copied if int(b) == size]
        measured = statistics.median(s for _, s in mine)
        bandwidth = statistics.median(bw for bw, _ in mine)
        assert cost.stall_s(size, bandwidth) == pytest.approx(measured, rel=0.35, abs=0.01)
    streamed = figures["streamed"]
    for size in sorted({int(b) for b, _ in streamed}):
        measured = statistics.median(s for b, s in streamed if int(b) == size)
        assert cost.streamed_s(size, 0) == pytest.approx(measured, rel=0.35, abs=0.01)


def test_the_defaults_are_the_benchmarks_fit() -> None:
    fitted, default = _figures()["cost"], MigrationCost().to_json()
    for key in ("fixed_s", "efficiency", "stream_fixed_s", "stream_s_per_byte", "log_share"):
        assert default[key] == pytest.approx(fitted[key], rel=0.05), key
