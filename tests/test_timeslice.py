"""``adaptipe cluster run``: the spec's checks, and (slow, root only) real runs
time-sliced over two CPU-quota device types, each ending bitwise equal to training
alone with its rounds per type matching the allocation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adaptipe.errors import PlanError
from adaptipe.timeslice import cgroup_root, load_spec, run_sliced

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cluster-run.toml"


def test_the_example_spec_reads() -> None:
    spec = load_spec(EXAMPLE)
    assert [d[0] for d in spec.devices] == ["full", "slow"]
    assert [j.name for j in spec.jobs] == ["mlp-a", "mlp-b", "mlp-c"]
    assert spec.cluster().workers == (1, 1)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('policy = "lottery"', r"policy 'lottery' \(allowed: max_min_fairness, min_makespan"),
        ("colour = 1", r"unknown field 'colour' \(allowed: policy,"),
        ('round_s = "long"', r"round_s must be a int or float"),
        ("[[device]]\ntype = 'x'\ncpus = 0.0", r"device\[0\]: cpus must be in \[0.05,"),
        (
            "[[device]]\ntype = 'x'\n[[job]]\nconfig = 'none.toml'",
            r"job\[0\]: config .* not a file",
        ),
        ("", "at least one"),
    ],
)
def test_a_bad_spec_names_the_file_and_field(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(text + "\n")
    with pytest.raises(PlanError, match=match) as info:
        load_spec(path)
    assert str(path) in str(info.value)


def _cgroups() -> str | None:
    try:
        cgroup_root()
    except PlanError as exc:
        return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.skipif(_cgroups() is not None, reason=str(_cgroups()))
def test_time_sliced_jobs_end_as_trained_alone_with_the_allocated_shares(tmp_path: Path) -> None:
    folder = tmp_path / "examples"
    shutil.copytree(ROOT / "examples" / "cluster", folder / "cluster")
    for config in (folder / "cluster").glob("*.toml"):  # shorter jobs: fewer rounds
        text = config.read_text().replace("iterations = 600", "iterations = 60")
        config.write_text(text.replace("batch_size = 512", "batch_size = 64"))
    spec_text = EXAMPLE.read_text().replace("checkpoint_every = 20", "checkpoint_every = 2")
    (folder / "spec.toml").write_text(spec_text)
    spec = load_spec(folder / "spec.toml")
    result = run_sliced(spec, tmp_path / "out", say=lambda _: None)
    assert set(result["completion_s"]) == {"mlp-a", "mlp-b", "mlp-c"}
    for name, alone in result["alone"].items():
        assert alone["equal"], name
    for name, share in result["shares"].items():
        assert share["largest_gap_rounds"] <= 1.5, (name, share)
    full, slow = (result["throughputs"]["mlp-c"][t] for t in ("full", "slow"))
    assert slow < 0.8 * full  # the quota makes the types really differ
    assert json.loads((tmp_path / "out" / "cluster-run.json").read_text())["rounds"]
