"""`adaptipe collect-interference`: a tiny collection writes a well-formed, labelled dataset,
a hog on the stage's core shows as slowdown, and no process outlives the collection."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

import pytest

from adaptipe.cli.collect import add_parser as add_collect_parser
from adaptipe.cli.collect import run as run_collect_command
from adaptipe.errors import PlanError
from adaptipe.inject.collect import (
    COLUMNS,
    STAGE_FEATURES,
    DatasetSummary,
    Level,
    collect_interference,
    default_levels,
)
from adaptipe.monitor.features import FEATURES

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists() or not hasattr(os, "sched_setaffinity"),
    reason="needs Linux /proc and CPU affinity",
)

NONE = Level()
HOGS = (
    Level(hog_where="same", hog_threads=2, hog_intensity=1.0, hog_method="spin"),
    Level(hog_where="same", hog_threads=1, hog_intensity=1.0, hog_method="matmul"),
)
_TEXT = {"level", "hog_where", "hog_method", "model", "variant"}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _children() -> set[int]:
    """Live processes whose parent is this test process."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] not in ("Z", "X"):
            out.add(int(stat.parent.name))
    return out


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or ()), list(reader)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[DatasetSummary, set[int]]:
    """One mlp stage under none and two hogs (the first stage is always measured in full)."""
    out = tmp_path_factory.mktemp("collect") / "interference.csv"
    before = _children()
    notes: list[tuple[float, float, int, str]] = []
    summary = collect_interference(
        out,
        minutes=0.1,
        seed=3,
        models=("mlp",),
        levels=(NONE, *HOGS),
        levels_per_stage=3,
        progress=lambda *args: notes.append(args),
    )
    assert [n[2] for n in notes] == list(range(1, summary.rows + 1))
    return summary, _children() - before


def test_tiny_collection_writes_every_column_with_finite_values(
    tiny: tuple[DatasetSummary, set[int]],
) -> None:
    summary, _ = tiny
    header, rows = _rows(summary.path)
    assert header == list(COLUMNS) == list(summary.columns)
    assert header[: len(FEATURES)] == list(FEATURES)
    assert set(STAGE_FEATURES) < set(header) and header[-1] == "slowdown"
    assert len(rows) == summary.rows >= 3
    for row in rows:
        assert row["model"] == "mlp" and row["level"] in {"none", *(h.name for h in HOGS)}
        for name in set(header) - _TEXT:
            assert math.isfinite(float(row[name])), (name, row[name])
        assert int(row["stage_layers"]) == int(row["layer_stop"]) - int(row["layer_start"])
        assert int(row["stage_n_linear"]) == int(row["stage_layers"])  # the mlp is all Linear
        assert int(row["stage_params"]) > 0 and float(row["stage_flops"]) > 0
        ratio = float(row["interfered_step_s"]) / float(row["baseline_step_s"])
        assert float(row["slowdown"]) == pytest.approx(ratio)


def test_hog_on_the_stage_core_slows_it_and_none_does_not(
    tiny: tuple[DatasetSummary, set[int]],
) -> None:
    summary, _ = tiny
    _, rows = _rows(summary.path)
    none = [float(r["slowdown"]) for r in rows if r["level"] == "none"]
    hog = [float(r["slowdown"]) for r in rows if r["level"] != "none"]
    assert none and hog
    # Generous: alone, 2 spinning hogs leave the stage a third of its core, one a half.
    assert 0.6 < statistics.fmean(none) < 1.5
    assert statistics.fmean(hog) > 1.3
    assert statistics.fmean(hog) > statistics.fmean(none) + 0.25
    means = summary.slowdown_by_level
    assert sum(n for _, n in means.values()) == summary.rows


def test_no_process_outlives_the_collection(tiny: tuple[DatasetSummary, set[int]]) -> None:
    summary, new_children = tiny
    assert len(summary.pids) >= 1 + 2  # the stage process and at least the spin hogs
    assert not [pid for pid in summary.pids if _alive(pid)]
    assert not new_children


def test_sidecar_describes_columns_machine_and_run(
    tiny: tuple[DatasetSummary, set[int]],
) -> None:
    summary, _ = tiny
    assert summary.sidecar == summary.path.with_suffix(".json")
    meta = json.loads(summary.sidecar.read_text())
    assert meta["kind"] == "adaptipe-interference-dataset" and meta["version"] == 1
    assert meta["data"] == summary.path.name and meta["label"] == "slowdown"
    assert [c["name"] for c in meta["columns"]] == list(COLUMNS)
    roles = {c["name"]: c["role"] for c in meta["columns"]}
    assert {roles[f] for f in FEATURES} == {"device"}
    assert {roles[f] for f in STAGE_FEATURES} == {"stage"} and roles["slowdown"] == "label"
    assert all(c["description"] for c in meta["columns"])
    assert meta["features"] == [*FEATURES, *STAGE_FEATURES]
    machine, run = meta["machine"], meta["run"]
    assert machine["num_cpus"] == os.cpu_count() and machine["stage_threads"] == 1
    assert machine["stage_core"] in machine["affinity"] and machine["torch"]
    assert run["status"] == "complete" and run["rows"] == summary.rows and run["seed"] == 3
    assert run["levels"] == ["none", *(h.name for h in HOGS)]


def test_interrupted_collection_keeps_its_rows_and_processes_end(tmp_path: Path) -> None:
    out = tmp_path / "cut.csv"
    before = _children()

    def stop_after_two(elapsed_s: float, total_s: float, rows: int, note: str) -> None:
        if rows == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect_interference(out, minutes=5, seed=0, models=("mlp",), progress=stop_after_two)
    _, rows = _rows(out)
    assert len(rows) == 2
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["run"]["status"] == "interrupted" and meta["run"]["rows"] == 2
    assert not _children() - before
    # The default sweep: hogs on another core too when this process may use two.
    other = len(os.sched_getaffinity(0)) > 1
    assert meta["run"]["levels"] == [lv.name for lv in default_levels(other_core=other)]
    assert any(name.startswith("cpu-other-") for name in meta["run"]["levels"]) == other


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"minutes": -1.0}, ["minutes", "-1.0"]),
        ({"minutes": 0}, ["minutes", "> 0"]),
        ({"models": ("mlp", "resnet")}, ["'resnet'", "mlp, gpt, cnn"]),
        ({"models": ()}, ["models", "mlp, gpt, cnn"]),
        ({"out": "x.parquet"}, ["x.parquet", ".csv"]),
        ({"levels_per_stage": 0}, ["levels_per_stage", "0"]),
    ],
)
def test_bad_arguments_are_named_with_what_is_allowed(
    tmp_path: Path, kwargs: dict[str, Any], words: list[str]
) -> None:
    args: dict[str, Any] = {"minutes": 1.0, "seed": 0, "models": ("mlp",)} | kwargs
    out = tmp_path / args.pop("out", "x.csv")
    with pytest.raises(PlanError) as info:
        collect_interference(out, **args)
    for word in words:
        assert word in str(info.value)
    assert not out.exists()  # nothing starts before the arguments are checked


def test_levels_check_their_fields_and_default_sweep_covers_the_brief() -> None:
    with pytest.raises(PlanError, match="intensity"):
        Level(hog_where="same", hog_threads=1, hog_intensity=1.5, hog_method="spin")
    with pytest.raises(PlanError, match="hog fields"):
        Level(hog_threads=2)
    names = [lv.name for lv in default_levels()]
    assert names[0] == "none" and len(set(names)) == len(names)
    assert "cpu-same-matmul-2x0.25" in names and "cpu-other-spin-1x1.00" in names
    assert "mem-0.5GiB" in names and any("+mem-" in n for n in names)
    assert not any(lv.hog_where == "other" for lv in default_levels(other_core=False))


def test_cli_parses_defaults_and_reports_an_unknown_model() -> None:
    parser = argparse.ArgumentParser(prog="adaptipe")
    add_collect_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["collect-interference"])
    assert (args.out, args.minutes, args.seed) == ("data/interference.csv", 10.0, 0)
    assert args.models == "mlp,gpt,cnn" and args.func is run_collect_command
    args = parser.parse_args(["collect-interference", "--models", "mlp,vgg", "--no-progress"])
    with pytest.raises(PlanError, match=r"unknown model 'vgg' \(allowed: mlp, gpt, cnn\)"):
        run_collect_command(args)
