"""Scenario files: examples load, bad files fail before anything runs, Poisson levels expand."""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from adaptipe.cli.inject import add_parser as add_inject_parser
from adaptipe.cli.inject import run as run_inject_command
from adaptipe.errors import PlanError
from adaptipe.inject import ScenarioRunner, expand
from adaptipe.inject.arrivals import arrival_times
from adaptipe.inject.scenario import (
    CpuHog,
    Injection,
    Kill,
    LinkThrottle,
    MemoryPressure,
    Scenario,
    Slowdown,
    load_scenario,
    parse_scenario,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return json.dumps(v) if isinstance(v, str) else repr(v)


def _toml(data: dict[str, Any]) -> str:
    """Just enough TOML for these tests: arrays of flat tables, sub-tables, plain tables."""
    lines: list[str] = []
    for section, body in data.items():
        tables = body if isinstance(body, list) else [body]
        for table in tables:
            lines.append(f"[[{section}]]" if isinstance(body, list) else f"[{section}]")
            subs = {k: v for k, v in table.items() if isinstance(v, dict)}
            lines += [f"{k} = {_value(v)}" for k, v in table.items() if k not in subs]
            for name, sub in subs.items():
                lines.append(f"[{section}.{name}]")
                lines += [f"{k} = {_value(v)}" for k, v in sub.items()]
    return "\n".join(lines) + "\n"


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "scenario.toml"
    path.write_text(_toml(data))
    return path


def test_examples_load() -> None:
    hog = load_scenario(EXAMPLES / "interference-cpu-hog.toml", num_stages=2, num_cores=2)
    assert hog.injections == (
        Injection(spec=CpuHog(cores=(1,)), origin="inject[0]", at_s=5.0, duration_s=10.0),
    )
    heavy = load_scenario(EXAMPLES / "interference-heavy.toml", num_stages=2, num_cores=2)
    (level,) = heavy.poisson
    assert (level.level, level.arrivals_per_min, level.end_s) == ("heavy", 3.0, 600.0)
    assert [s.kind for s in level.specs] == ["cpu_hog", "memory", "slowdown"]
    assert level.specs[1] == MemoryPressure(gib=0.5)


def test_every_kind_and_clock_parses() -> None:
    scenario = parse_scenario(
        {
            "inject": [
                {"kind": "memory", "at_s": 1, "gib": 0.25, "touch": False},
                {"kind": "link_throttle", "at_s": 0, "stage": 1, "bandwidth": "100MB/s"},
                {"kind": "slowdown", "at_iteration": 5, "iterations": 10, "stage": 0},
                {"kind": "kill", "at_s": 0, "stage": 1, "p": 0.1, "period_s": 300},
                {"kind": "kill", "at_iteration": 3, "stage": 0},
            ]
        },
        source="s.toml",
        num_stages=2,
    )
    memory, throttle, slow, periodic, once = scenario.injections
    assert memory.spec == MemoryPressure(gib=0.25, touch=False) and memory.duration_s is None
    assert throttle.spec == LinkThrottle(stage=1, bandwidth="100MB/s")
    assert throttle.spec.bandwidth_Bps == 1e8
    assert (slow.by_iteration, slow.at_iteration, slow.iterations) == (True, 5, 10)
    assert slow.spec == Slowdown(stage=0, factor=2.0)
    assert periodic.spec == Kill(stage=1, p=0.1, period_s=300.0)
    assert once.spec == Kill(stage=0) and once.stage == 0


ALL_KINDS = "cpu_hog, gpu_hog, memory, link_throttle, slowdown, kill, link_shape"
HOG_FIELDS = "kind, at_s, duration_s, at_iteration, iterations, threads, cores, intensity, method"
BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"inject": [{"kind": "cpu", "at_s": 0}]},
        f"inject[0].kind must be one of {ALL_KINDS} (got 'cpu')",
    ),
    (
        {
            "inject": [
                {"kind": "cpu_hog", "at_s": 0},
                {"kind": "memory", "at_s": 1, "duration_s": -2},
            ]
        },
        "inject[1].duration_s must be a number > 0 (got -2)",
    ),
    (
        {"inject": [{"kind": "slowdown", "at_s": 0, "stage": 3}]},
        "inject[0].stage must name a stage: stage 3 does not exist (the run has 2 stages: 0..1)",
    ),
    (
        {"inject": [{"kind": "cpu_hog", "at_s": 0, "iterations": 3}]},
        "inject[0] mixes seconds (at_s) and iterations (iterations)",
    ),
    (
        {"inject": [{"kind": "cpu_hog", "at_s": 0, "treads": 2}]},
        f"inject[0].treads is not a field of cpu_hog (allowed: {HOG_FIELDS})",
    ),
    (
        {"inject": [{"kind": "cpu_hog", "duration_s": 3}]},
        "inject[0] needs a start: at_s (seconds) or at_iteration (iterations)",
    ),
    (
        {"inject": [{"kind": "cpu_hog", "at_s": 0, "intensity": 1.5}]},
        "inject[0].intensity must be a number in (0, 1] (got 1.5)",
    ),
    (
        {"inject": [{"kind": "cpu_hog", "at_s": 0, "cores": [0, 2]}]},
        "inject[0].cores must list core ids in 0..1 (got 2)",
    ),
    (
        {"inject": [{"kind": "cpu_hog", "at_s": 0, "method": "gpu"}]},
        "inject[0].method must be one of spin, matmul (got 'gpu')",
    ),
    (
        {"inject": [{"kind": "cpu_hog", "at_s": 0, "threads": 0}]},
        "inject[0].threads must be >= 1 (got 0)",
    ),
    (
        {"inject": [{"kind": "memory", "at_s": 0, "gib": 0}]},
        "inject[0].gib must be a number > 0 (got 0)",
    ),
    (
        {"inject": [{"kind": "link_throttle", "at_s": 0, "stage": 0, "bandwidth": "fast"}]},
        "inject[0].bandwidth 'fast' is not a bandwidth",
    ),
    (
        {"inject": [{"kind": "link_throttle", "at_s": 0, "stage": 0}]},
        "inject[0] throttles nothing: give bandwidth",
    ),
    (
        {"inject": [{"kind": "slowdown", "at_s": 0, "stage": 0, "factor": 0.5}]},
        "inject[0].factor must be a number >= 1.0 (got 0.5)",
    ),
    ({"inject": [{"kind": "slowdown", "at_s": 0}]}, "inject[0].stage is missing"),
    (
        {"inject": [{"kind": "kill", "at_s": 0, "stage": 0, "p": 0}]},
        "inject[0].p must be a number in (0, 1] (got 0)",
    ),
    (
        {"inject": [{"kind": "kill", "at_s": 0, "stage": 0, "duration_s": 5}]},
        "inject[0].duration_s applies only to a kill with a period",
    ),
    (
        {"inject": [{"kind": "kill", "at_s": 0, "stage": 0, "period_iterations": 5}]},
        "inject[0] mixes seconds (at_s) and iterations (period_iterations)",
    ),
    (
        {"injections": [{"kind": "kill"}]},
        "injections is not a section or key (allowed: inject, levels, poisson, bed, state_dir)",
    ),
    ({"levels": {"heavy": -3}}, "[levels].heavy must be a number > 0 (got -3)"),
    (
        {"poisson": [{"rate_per_min": 1, "mean_duration_s": 5, "kinds": ["kill"]}]},
        "poisson[0].kinds must list distinct kinds from cpu_hog, gpu_hog, memory, link_throttle, slowdown (got ['kill'])",
    ),
    (
        {
            "poisson": [
                {"level": "extreme", "rate_per_min": 1, "mean_duration_s": 5, "kinds": ["memory"]}
            ]
        },
        "poisson[0].level must be one of light, heavy (got 'extreme')",
    ),
    (
        {
            "poisson": [
                {
                    "rate_per_min": 1,
                    "mean_duration_s": 5,
                    "kinds": ["memory"],
                    "memory": {"size": 1},
                }
            ]
        },
        "poisson[0].memory.size is not a field of memory (allowed: gib, touch)",
    ),
    (
        {"poisson": [{"rate_per_min": 0, "mean_duration_s": 5, "kinds": ["memory"]}]},
        "poisson[0].rate_per_min must be a number > 0 (got 0)",
    ),
    (
        {"poisson": [{"rate_per_min": 1, "kinds": ["memory"]}]},
        "poisson[0].mean_duration_s is missing",
    ),
    (
        {
            "poisson": [
                {"rate_per_min": 1, "mean_duration_s": 5, "kinds": ["slowdown"], "stages": [2]}
            ]
        },
        "poisson[0].stages must name a stage: stage 2 does not exist (the run has 2 stages: 0..1)",
    ),
]


@pytest.mark.parametrize(("data", "message"), BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_bad_scenario_names_file_injection_and_field(
    tmp_path: Path, data: dict[str, Any], message: str
) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(PlanError) as err:
        load_scenario(path, num_stages=2, num_cores=2)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


def test_poisson_stage_kinds_need_stages_when_the_run_is_unknown(tmp_path: Path) -> None:
    level = {"rate_per_min": 1, "mean_duration_s": 5, "kinds": ["slowdown"]}
    path = _write(tmp_path, {"poisson": [level]})
    with pytest.raises(PlanError, match=r"poisson\[0\].stages is needed to draw slowdown"):
        load_scenario(path)
    assert load_scenario(path, num_stages=3).poisson[0].stages == (0, 1, 2)


def test_gpu_hog_without_cuda_fails_clearly(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = _write(tmp_path, {"inject": [{"kind": "gpu_hog", "at_s": 0}]})
    with pytest.raises(PlanError, match="gpu_hog needs a CUDA device; none is available"):
        load_scenario(path)


def _level(level: str, *, rate: float = 1.0, end_s: float | None = None) -> Scenario:
    table: dict[str, Any] = {"level": level, "rate_per_min": rate, "mean_duration_s": 20}
    table |= {"kinds": ["cpu_hog", "slowdown"], "stages": [0, 1], "min_duration_s": 0}
    if end_s is not None:
        table["end_s"] = end_s
    return parse_scenario({"poisson": [table]}, source="p.toml", num_stages=2)


def test_poisson_expansion_is_deterministic_per_seed() -> None:
    scenario = _level("light", end_s=3600)
    first = expand(scenario, horizon_s=None, seed=7)
    assert first == expand(scenario, horizon_s=None, seed=7)
    assert first != expand(scenario, horizon_s=None, seed=8)
    assert first.poisson == () and len(first.injections) > 20
    starts = [i.at_s or 0.0 for i in first.injections]
    assert starts == sorted(starts) and starts[0] > 0 and starts[-1] < 3600
    for injection in first.injections:
        assert injection.origin == "poisson[0]" and injection.kind in ("cpu_hog", "slowdown")
        assert (injection.duration_s or 0) > 0 and (injection.at_s or 0) + (
            injection.duration_s or 0
        ) <= 3600 + 1e-6
        assert injection.stage in (None, 0, 1)
    assert {i.stage for i in first.injections if i.kind == "slowdown"} == {0, 1}
    # the horizon cuts the same stream: a shorter run sees a prefix of the arrivals
    short = expand(scenario, horizon_s=600, seed=7)
    assert [i.at_s for i in short.injections] == [s for s in starts if s < 600]


def test_heavy_interference_triples_light_arrivals() -> None:
    horizon = 100 * 3600.0  # 6000 light arrivals expected: the ratio is within a few %
    light = len(expand(_level("light"), horizon_s=horizon, seed=1).injections)
    heavy = len(expand(_level("heavy"), horizon_s=horizon, seed=1).injections)
    assert 5400 < light < 6600
    assert 2.7 < heavy / light < 3.3
    durations = [
        i.duration_s or 0 for i in expand(_level("light"), horizon_s=horizon, seed=2).injections
    ]
    assert 18 < sum(durations) / len(durations) < 22  # exponential with mean 20 s


def test_arrival_times_are_a_poisson_process() -> None:
    times = arrival_times(2.0, start_s=10.0, end_s=10_010.0, rng=random.Random(0))
    assert all(10 < a < b < 10_010 for a, b in itertools.pairwise(times))
    assert 19_000 < len(times) < 21_000


def test_expand_needs_an_end_and_the_runner_needs_expansion() -> None:
    scenario = _level("light")
    with pytest.raises(PlanError, match=r"p.toml: poisson\[0\] has no end_s; give a horizon"):
        expand(scenario, horizon_s=None, seed=0)
    with pytest.raises(PlanError, match=r"has \[\[poisson\]\] levels; expand\(\) it first"):
        ScenarioRunner(scenario)


def test_expand_keeps_fixed_injections_in_time_order() -> None:
    data: dict[str, Any] = {
        "inject": [
            {"kind": "slowdown", "at_iteration": 3, "stage": 0},
            {"kind": "memory", "at_s": 90, "duration_s": 5, "gib": 0.1},
        ],
        "poisson": [{"rate_per_min": 2, "mean_duration_s": 5, "kinds": ["memory"], "end_s": 180}],
    }
    out = expand(parse_scenario(data, source="s.toml", num_stages=1), horizon_s=None, seed=3)
    timed = [i for i in out.injections if not i.by_iteration]
    assert [i.at_s for i in timed] == sorted(i.at_s or 0 for i in timed)
    assert any(i.origin == "inject[1]" for i in timed)
    assert out.injections[-1].origin == "inject[0]"


def test_dry_run_prints_the_expanded_timeline(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_inject_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["inject", str(EXAMPLES / "interference-heavy.toml"), "--dry-run", "--seed", "1"]
    )
    assert run_inject_command(args) == 0
    out = capsys.readouterr().out
    assert "interference-heavy.toml:" in out and "(seed 1)" in out
    assert out.count("(poisson[0])") > 10
    again = parser.parse_args(["inject", str(EXAMPLES / "interference-cpu-hog.toml"), "--dry-run"])
    assert run_inject_command(again) == 0
    assert "5 s for 10 s: cpu_hog threads=1 cores=[1]" in capsys.readouterr().out
