"""The CLI is thin: it parses, calls the library, prints; bad input is a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaptipe import Partition, Profile
from adaptipe.cli import main
from adaptipe.serial import write_json


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_uniform_1f1b_prints_closed_form_bubble(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(
        capsys, "simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json"
    )
    assert code == 0
    result = json.loads(out)
    assert result["bubble_ratio"] == pytest.approx(3 / 11)
    assert result["makespan"] == pytest.approx(11 * 3)
    assert result["throughput"] == pytest.approx(8 / 33)


def test_simulate_interleaved_reduces_the_bubble_by_v(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "simulate",
        "--schedule",
        "interleaved",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--virtual",
        "2",
        "--json",
    ]
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert json.loads(out)["bubble_ratio"] == pytest.approx(3 / (2 * 8 + 3))


def test_simulate_writes_a_gantt_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "g.png"
    code, _, _ = _run(
        capsys,
        "simulate",
        "--schedule",
        "gpipe",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--gantt",
        str(png),
    )
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interleaved_with_microbatches_not_a_multiple_of_stages_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "simulate",
        "--schedule",
        "interleaved",
        "--stages",
        "4",
        "--microbatches",
        "6",
        "--virtual",
        "2",
    ]
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert "multiple" in err and "M=6" in err and "S=4" in err


def test_unknown_schedule_lists_the_allowed_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--schedule", "zigzag", "--stages", "2", "--microbatches", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "zigzag" in err and "gpipe" in err and "interleaved" in err and "2bw" in err


def test_plan_then_simulate_from_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = Profile.uniform(8, forward_s=1e-3, backward_s=2e-3, activation_bytes=1 << 20)
    write_json(tmp_path / "p.json", prof.to_json())
    part_path = tmp_path / "x.json"
    code, out, _ = _run(
        capsys,
        "plan",
        "--profile",
        str(tmp_path / "p.json"),
        "--stages",
        "2",
        "--planner",
        "dynpipe",
        "--bandwidth",
        "1GB/s",
        "--out",
        str(part_path),
        "--json",
    )
    assert code == 0
    assert json.loads(out)["bounds"] == [0, 4, 8]
    code, out, _ = _run(
        capsys,
        "simulate",
        "--schedule",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--profile",
        str(tmp_path / "p.json"),
        "--partition",
        str(part_path),
        "--bandwidth",
        "1GB/s",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    assert result["makespan"] > (4 + 1) * 4 * 3e-3  # communication adds to the compute-only bound


def test_partition_that_does_not_match_the_profile_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_json(tmp_path / "p.json", Profile.uniform(8).to_json())
    write_json(
        tmp_path / "x.json", Partition.even(model="uniform", num_layers=6, num_stages=2).to_json()
    )
    code, _, err = _run(
        capsys,
        "simulate",
        "--schedule",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--profile",
        str(tmp_path / "p.json"),
        "--partition",
        str(tmp_path / "x.json"),
    )
    assert code == 2
    assert "6" in err and "8" in err


def test_malformed_profile_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "profile", "version": 1, "model": "m"}))
    code, _, err = _run(capsys, "plan", "--profile", str(bad), "--stages", "2")
    assert code == 2
    assert str(bad) in err and "missing" in err


def test_profile_command_writes_a_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mlp.json"
    code, _, _ = _run(
        capsys,
        "profile",
        "--model",
        "mlp",
        "--microbatch",
        "4",
        "--repeats",
        "2",
        "--warmup",
        "0",
        "--set",
        "depth=3",
        "--set",
        "hidden=16",
        "--out",
        str(out),
    )
    assert code == 0
    prof = Profile.from_json(json.loads(out.read_text()))
    assert prof.model == "mlp" and prof.num_layers == 3 and prof.microbatch == 4
    assert not prof.has_batched_wgrad


def test_batched_weight_gradients_from_profile_to_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof_path, part_path = tmp_path / "p.json", tmp_path / "part.json"
    model = ("--model", "mlp", "--set", "depth=4", "--set", "hidden=64")
    args = ("--microbatch", "8", "--repeats", "2", "--warmup", "0", "--out", str(prof_path))
    code, _, _ = _run(capsys, "profile", *model, *args, "--wgrad-microbatches", "4")
    assert code == 0
    prof = Profile.from_json(json.loads(prof_path.read_text()))
    assert prof.has_batched_wgrad and prof.wgrad_microbatches == 4
    part = Partition.even(model="mlp", num_layers=4, num_stages=2)
    part_path.write_text(json.dumps(part.to_json()))
    sim = ("simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--json")
    files = ("--profile", str(prof_path), "--partition", str(part_path))
    code, plain, _ = _run(capsys, *sim, *files)
    assert code == 0
    code, batched, _ = _run(capsys, *sim, *files, "--batch-weight-grads")
    assert code == 0
    # The runs differ in how backward work is costed, so the makespans differ.
    assert json.loads(batched)["makespan"] != json.loads(plain)["makespan"]
    code, _, err = _run(capsys, *sim, "--batch-weight-grads")
    assert code == 2 and "--batch-weight-grads needs --profile" in err


def test_installed_entry_point_runs(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "adaptipe"
    if not exe.exists():
        pytest.skip("adaptipe entry point not installed in this environment")
    proc = subprocess.run(
        [
            str(exe),
            "simulate",
            "--schedule",
            "gpipe",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bubble_ratio"] == pytest.approx(1 / 3)
