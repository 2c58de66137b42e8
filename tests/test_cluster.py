"""Gavel's policies against hand-solved linear programs, the round-based mechanism's
shares, the simulation's aware-against-agnostic ordering and the trace checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adaptipe.cli import main
from adaptipe.cluster.mechanism import place_round
from adaptipe.cluster.policies import allocate, effective_throughput
from adaptipe.cluster.simulate import simulate
from adaptipe.cluster.spec import Cluster, ClusterJob, throughput_matrix
from adaptipe.cluster.trace import generate, load_trace, save_trace
from adaptipe.errors import PlanError


def _jobs(rows: list[list[float]], types: tuple[str, ...], **kw: float) -> list[ClusterJob]:
    return [
        ClusterJob(name=f"j{i}", throughputs=dict(zip(types, row, strict=True)), steps=kw.get("steps", 100.0))
        for i, row in enumerate(rows)
    ]  # fmt: skip


def test_las_reproduces_gavels_worked_example() -> None:
    """Seed 002 §5.4.1: T = [[40, 10], [12, 4], [100, 50]] on one V100 and one K80 gives
    X_het = [[0.45, 0], [0.45, 0.09], [0.09, 0.91]], about 10% over an isolated 1/n."""
    cluster = Cluster(types=("v100", "k80"), workers=(1, 1))
    jobs = _jobs([[40, 10], [12, 4], [100, 50]], cluster.types)
    aware = allocate(jobs, cluster, policy="max_min_fairness")
    np.testing.assert_allclose(
        aware.x, [[5 / 11, 0], [5 / 11, 1 / 11], [1 / 11, 10 / 11]], atol=1e-6
    )
    agnostic = allocate(jobs, cluster, policy="max_min_fairness", aware=False)
    np.testing.assert_allclose(agnostic.x, np.full((3, 2), 1 / 3), atol=1e-6)  # isolated
    assert aware.objective / agnostic.objective == pytest.approx(1.0909, abs=1e-3)


def test_min_makespan_matches_the_hand_solution() -> None:
    """One worker, throughputs 1 and 2, 10 steps each: x0 = 2/3, x1 = 1/3, makespan 15."""
    cluster = Cluster(types=("a",), workers=(1,))
    alloc = allocate(_jobs([[1.0], [2.0]], ("a",), steps=10.0), cluster, policy="min_makespan")
    np.testing.assert_allclose(alloc.x[:, 0], [2 / 3, 1 / 3], atol=1e-6)
    assert alloc.objective == pytest.approx(15.0)


def test_fifo_gives_the_first_job_its_fastest_type() -> None:
    cluster = Cluster(types=("fast", "slow"), workers=(1, 1))
    alloc = allocate(_jobs([[4, 1], [8, 1]], cluster.types), cluster, policy="fifo")
    np.testing.assert_allclose(alloc.x, [[1, 0], [0, 1]], atol=1e-6)


def test_min_cost_takes_the_cheapest_steps_unless_an_slo_needs_speed() -> None:
    """Steps per dollar: type a 2/1, type b 3/3, so a alone; with 250 steps due in 100 s
    (2.5 steps/s), half on each: 2 * 0.5 + 3 * 0.5 = 2.5."""
    cluster = Cluster(types=("a", "b"), workers=(1, 1), prices=(1.0, 3.0))
    (job,) = _jobs([[2, 3]], cluster.types, steps=250.0)
    assert allocate([job], cluster, policy="min_cost").x.tolist() == [[1.0, 0.0]]
    slo = ClusterJob(name="slo", throughputs=job.throughputs, steps=250.0, slo_s=100.0)
    x = allocate([slo], cluster, policy="min_cost").x
    np.testing.assert_allclose(x, [[0.5, 0.5]], atol=1e-6)
    with pytest.raises(PlanError, match="price_per_hour"):
        allocate([job], Cluster(types=("a", "b"), workers=(1, 1)), policy="min_cost")


@pytest.mark.parametrize("policy", ["max_min_fairness", "min_makespan", "fifo", "min_cost"])
def test_every_allocation_is_valid_and_aware_is_never_worse_on_its_objective(policy: str) -> None:
    rng = np.random.default_rng(3)
    cluster = Cluster(types=("x", "y", "z"), workers=(3, 2, 4), prices=(3.0, 1.5, 0.5))
    rows = rng.uniform(0.5, 10, size=(12, 3))
    rows[2, 1] = 0.0  # job 2 cannot run on y
    jobs = [
        ClusterJob(name=f"j{i}", throughputs=dict(zip(cluster.types, map(float, r), strict=True)),
                   steps=float(rng.uniform(100, 1000)), scale=int(rng.choice([1, 2])))
        for i, r in enumerate(rows)
    ]  # fmt: skip
    aware = allocate(jobs, cluster, policy=policy)  # type: ignore[arg-type]
    agnostic = allocate(jobs, cluster, policy=policy, aware=False)  # type: ignore[arg-type]
    scale = np.array([j.scale for j in jobs])
    for alloc in (aware, agnostic):
        assert alloc.x.min() >= 0 and alloc.x.sum(axis=1).max() <= 1 + 1e-6
        assert np.all(alloc.x.T @ scale <= np.array(cluster.workers) + 1e-6)
        assert alloc.x[2, 1] == 0
    better = aware.objective <= agnostic.objective + 1e-9
    assert better if policy == "min_makespan" else aware.objective >= agnostic.objective - 1e-9
    t = throughput_matrix(jobs, cluster)
    assert effective_throughput(t, aware.x).shape == (12,)


def test_the_mechanism_realises_the_allocation_within_a_round() -> None:
    x = np.array([[5 / 11, 0], [5 / 11, 1 / 11], [1 / 11, 10 / 11]])
    received = np.zeros_like(x)
    rounds = 220
    for _ in range(rounds):
        placed = place_round(x, received, [1, 1, 1], [1, 1])
        assert sum(1 for k in placed if k == 0) <= 1 and sum(1 for k in placed if k == 1) <= 1
        assert len({i for i, k in enumerate(placed) if k is not None}) == sum(
            1 for k in placed if k is not None
        )
        for i, k in enumerate(placed):
            if k is not None:
                received[i, k] += 1
    assert np.abs(received - x * rounds).max() <= 1.5


def test_aware_policies_beat_agnostic_ones_in_simulation() -> None:
    trace = generate(jobs=24, rate_per_hour=3.0, workers_per_type=2, seed=4)
    got = {}
    for policy in ("max_min_fairness", "min_makespan"):
        for aware in (True, False):
            r = simulate(trace.jobs, trace.cluster, policy=policy, aware=aware)  # type: ignore[arg-type]
            assert not r.unfinished and len(r.completion_s) == 24
            got[policy, aware] = r
    las, las_agn = got["max_min_fairness", True], got["max_min_fairness", False]
    assert las.mean_jct_s < las_agn.mean_jct_s
    assert got["min_makespan", True].makespan_s < got["min_makespan", False].makespan_s


def test_a_trace_round_trips_and_bad_files_name_the_field(tmp_path: Path) -> None:
    trace = generate(jobs=5, rate_per_hour=None, slos=True, multi_worker=True, seed=1)
    path = tmp_path / "trace.json"
    save_trace(trace, path)
    again = load_trace(path)
    assert [j.to_json() for j in again.jobs] == [j.to_json() for j in trace.jobs]
    data = json.loads(path.read_text())
    cases = [
        (lambda d: d.update(version=2), "version must be 1"),
        (lambda d: d["jobs"][1]["throughputs"].update(h100=3.0), r"jobs\[1\].*unknown device type 'h100' \(allowed: k80, p100, v100\)"),
        (lambda d: d["jobs"][0].update(steps=-1), r"jobs\[0\].*steps must be a finite number > 0"),
        (lambda d: d["jobs"][0].update(color="red"), r"unknown field 'color' \(allowed: name,"),
        (lambda d: d["cluster"]["devices"][0].update(count=1.5), r"devices\[0\]: count must be an int"),
        (lambda d: d["jobs"].append(dict(d["jobs"][0])), "given twice"),
    ]  # fmt: skip
    for change, match in cases:
        bad = json.loads(json.dumps(data))
        change(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(PlanError, match=match) as info:
            load_trace(path)
        assert str(path) in str(info.value)


def test_the_cli_writes_a_trace_and_simulates_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.json"
    assert (
        main(["cluster", "trace", str(trace), "--jobs", "8", "--rate", "4", "--workers", "1"]) == 0
    )
    capsys.readouterr()
    png = tmp_path / "cdf.png"
    args = ["cluster", "simulate", str(trace), "--policies", "fifo", "--json", "--png", str(png)]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["aware"]) for r in out["results"]] == [("fifo", True), ("fifo", False)]
    assert png.stat().st_size > 0
    assert main(["cluster", "allocate", str(trace), "--json"]) == 0
    alloc = json.loads(capsys.readouterr().out)
    assert len(alloc["allocation"]) == 8 and alloc["types"] == ["k80", "p100", "v100"]
