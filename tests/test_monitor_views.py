"""`adaptipe monitor` and `adaptipe report` read a run directory's logs: the terminal view
shows the right per-stage and per-link numbers, the report draws its charts and page,
events show up, bad lines are skipped and counted, and missing files give an error that
names them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from adaptipe.cli.monitor import add_parser as add_monitor_parser
from adaptipe.cli.report import add_parser as add_report_parser
from adaptipe.errors import PlanError
from adaptipe.monitor.bandwidth import LinkMeter
from adaptipe.monitor.live import MonitorState, render, render_links
from adaptipe.monitor.report import make_report
from adaptipe.monitor.runlog import JsonlTail, load_run
from adaptipe.monitor.schema import DeviceSample, Event, LinkSample, StageStats

T0 = 1.7e9
ITERATIONS = 10
BAD_LINES = [b"not json at all", b'{"v": 1, "type": "stage_stats"}']  # malformed, missing-field


def _stage_stats(stage: int, it: int) -> StageStats:
    slow = stage == 1 and it >= 5  # the injection doubles stage 1's compute
    return StageStats(
        run_id="synthetic",
        stage=stage,
        iteration=it,
        time_s=T0 + 0.1 * (it + 1),
        first_layer=2 * stage,
        forward_s=(0.001, 0.002),
        backward_s=(0.002, 0.004 * (2 if slow else 1)),
        compute_s=0.024 if slow else 0.010 + 0.002 * stage,
        wait_s=0.004,
        comm_s=0.001,
        iteration_s=0.030 if slow else 0.020,
        in_flight=2 - stage,
        memory_allocated_bytes=(64 + stage) << 20,
        memory_reserved_bytes=(64 + stage) << 20,
        loss=2.0 / (it + 1) if stage == 1 else None,
    )


def _link_samples(meters: dict[int, LinkMeter], it: int) -> list[LinkSample]:
    """4 KiB each way per iteration; link 0 -> 1 takes 4 ms instead of 2 from iteration 5."""
    out = []
    for src, seconds in ((0, 0.004 if it >= 5 else 0.002), (1, 0.001)):
        meter = meters.setdefault(src, LinkMeter(src, 1 - src))
        meter.record(4096, seconds)
        sample = meter.sample(4096, seconds)
        out.append(LinkSample.from_dict({**sample.to_dict(), "time_s": T0 + 0.1 * (it + 1)}))
    return out


def _write_run(root: Path) -> Path:
    """A finished two-stage run of 10 iterations with a CPU hog over iterations 4-8."""
    root.mkdir(parents=True)
    records: list[Any] = []
    meters: dict[int, LinkMeter] = {}
    for it in range(ITERATIONS):
        records += [_stage_stats(s, it) for s in (0, 1)]
        records += _link_samples(meters, it)
        records += [
            DeviceSample(
                stage=s,
                time_s=T0 + 0.1 * it + 0.05,
                source="cpu",
                fields={
                    "util_pct": 50.0 + 40 * (4 <= it < 8),
                    "run_queue": 3.0,
                    "num_cpus": 2.0,
                    "ctx_switches_per_s": 900.0,
                    "rss_bytes": 3e8,
                },
            )
            for s in (0, 1)
        ]
    hog = {"injector": "cpu_hog", "origin": "inject[0]"}
    records += [
        Event(kind="injection-start", time_s=T0 + 0.45, detail=hog),
        Event(kind="checkpoint", time_s=T0 + 0.52, stage=0, detail={"iteration": 5}),
        Event(kind="injection-end", time_s=T0 + 0.85, detail={**hog, "reason": "done"}),
    ]
    records.sort(key=lambda r: r.time_s)
    lines = [json.dumps(r.to_dict()).encode() for r in records]
    lines[3:3] = BAD_LINES
    (root / "telemetry.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with (root / "metrics.jsonl").open("w") as fh:
        for it in range(ITERATIONS):
            stages = [_stage_stats(s, it) for s in (0, 1)]
            rec = {
                "iteration": it,
                "loss": 2.0 / (it + 1),
                "losses": {"0": 2.0 / (it + 1), "1": 3.0 / (it + 1)},
                "iteration_s": 0.1,
                "samples_per_s": 320.0,
                "stages": [
                    {
                        k: getattr(s, k)
                        for k in ("compute_s", "wait_s", "comm_s", "iteration_s", "in_flight")
                    }
                    for s in stages
                ],
            }
            fh.write(json.dumps(rec) + "\n")
    summary = {
        "iterations": ITERATIONS,
        "final_loss": 0.2,
        "samples_per_s": 320.0,
        "stages": [{"compute_s": 0.01, "wait_s": 0.004, "comm_s": 0.001}] * 2,
        "jobs": [
            {"job": 1, "name": "lr=0.1", "val_loss": 0.5, "rank": 1},
            {"job": 0, "name": "lr=0.01", "val_loss": 0.9, "rank": 2},
        ],
    }
    (root / "summary.json").write_text(json.dumps(summary))
    return root


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return _write_run(tmp_path / "run")


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="adaptipe")
    sub = parser.add_subparsers(dest="command", required=True)
    add_monitor_parser(sub)
    add_report_parser(sub)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One report, drawn once through the CLI (drawing takes a second or two)."""
    root = _write_run(tmp_path_factory.mktemp("report") / "run")
    args = _cli(["report", str(root), "--out", str(root / "pages")])
    assert args.func(args) == 0
    return root / "pages", (root / "pages" / "report.html").read_text()


def test_report_writes_pngs_and_a_page_that_embeds_them(report: tuple[Path, str]) -> None:
    out, text = report
    for chart in ("throughput", "stage_times", "device", "layers", "links"):
        data = (out / f"{chart}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", chart
        assert len(data) > 20_000, (chart, len(data))
        assert f'src="{chart}.png"' in text
    # self-contained: nothing fetched, nothing run
    assert "<script" not in text and "http" not in text
    assert "lr=0.1" in text and "final loss" in text  # the summary and the jobs ranking


def test_report_has_a_link_section_with_each_links_totals(report: tuple[Path, str]) -> None:
    _, text = report
    assert "Links (bandwidth per iteration)" in text
    # 10 iterations of 4 KiB: link 0 -> 1 busy 5 x 2 ms + 5 x 4 ms, link 1 -> 0 10 x 1 ms
    row_01 = text[text.index(">0 → 1</td>") :].split("</tr>")[0]
    row_10 = text[text.index(">1 → 0</td>") :].split("</tr>")[0]
    # samples, MB sent, mean MB/s (40960 B / 30 ms), slowest and fastest iteration, smoothed
    assert "<td>10</td><td>0.04096</td><td>1.37</td><td>1.02</td><td>2.05</td>" in row_01
    assert (
        "<td>10</td><td>0.04096</td><td>4.10</td><td>4.10</td><td>4.10</td><td>4.10</td>" in row_10
    )


def test_report_lists_the_injection_as_a_span_and_other_events_as_points(
    report: tuple[Path, str],
) -> None:
    _, text = report
    assert "cpu_hog injection" in text
    # the run starts at its first record (0.05 s): the hog runs from the middle of iteration
    # 4 to the middle of iteration 8
    assert "0.40 to 0.80" in text and "4.0 to 8.0" in text
    assert "checkpoint" in text and "iteration=5" in text


def test_bad_telemetry_lines_are_skipped_and_counted(
    run_dir: Path, report: tuple[Path, str]
) -> None:
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('{"iteration": "ten"}\n{"iteration": 10, "stages": [')  # the last is cut off
    log = load_run(run_dir)
    assert dict(log.skipped["telemetry.jsonl"]) == {"malformed": 1, "missing-field": 1}
    assert dict(log.skipped["metrics.jsonl"]) == {"malformed": 2}
    assert len(log.records) == 6 * ITERATIONS + 3 and len(log.metrics) == ITERATIONS
    assert "Skipped 2 bad line(s): telemetry.jsonl 1 malformed, 1 missing-field" in report[1]


def test_make_report_without_telemetry_draws_the_metrics_charts_only(run_dir: Path) -> None:
    assert make_report(run_dir) == run_dir / "report" / "report.html"  # the default folder
    assert (run_dir / "report" / "device.png").exists()
    (run_dir / "telemetry.jsonl").unlink()
    text = make_report(run_dir).read_text()
    assert 'src="throughput.png"' in text and 'src="stage_times.png"' in text
    assert 'src="device.png"' not in text and "No telemetry.jsonl" in text
    assert not (run_dir / "report" / "device.png").exists()  # no stale chart left behind


def test_render_shows_one_row_per_stage_with_means_over_the_window(run_dir: Path) -> None:
    state = MonitorState(window=4, source=str(run_dir))
    for record in load_run(run_dir).records:
        state.add(record)
    table = render(state)
    assert table.row_count == 2
    cols = {str(c.header): [str(cell) for cell in c.cells] for c in table.columns}
    assert cols["stage"] == ["0", "1"]
    assert cols["iter"] == ["9", "9"]
    # the last 4 iterations: stage 0 is steady, stage 1 runs under the hog
    assert cols["compute ms"] == ["10.00", "24.00"]
    assert cols["wait ms"] == ["4.00", "4.00"]
    assert cols["compute %"] == ["50%", "80%"]
    assert cols["in flight"] == ["2", "1"]
    assert cols["memory"] == ["64.0 MiB", "65.0 MiB"]
    assert cols["device"] == ["cpu 50% rq 3/2"] * 2
    assert "run synthetic" in str(table.title) and "iteration 9" in str(table.title)
    assert "injection-end" in str(table.caption)


def test_render_links_shows_one_row_per_link_over_the_window(run_dir: Path) -> None:
    state = MonitorState(window=4, source=str(run_dir))
    assert render_links(state) is None  # nothing measured yet: no table
    for record in load_run(run_dir).records:
        state.add(record)
    table = render_links(state)
    assert table is not None and table.row_count == 2
    cols = {str(c.header): [str(cell) for cell in c.cells] for c in table.columns}
    assert cols["link"] == ["0 → 1", "1 → 0"]
    # the last 4 iterations: 4 KiB per iteration, 4 ms on 0 -> 1 and 1 ms on 1 -> 0
    assert cols["window mean"] == ["1000.0 KiB/s", "3.9 MiB/s"]
    assert cols["bytes/iter"] == ["4.0 KiB", "4.0 KiB"]
    assert cols["busy ms"] == ["4.00", "1.00"]
    assert cols["busy %"] == ["20%", "3%"]  # of stage 0's 20 ms and stage 1's 30 ms iterations
    # the smoothed estimate of 0 -> 1 is still coming down from 2 MB/s towards 1 MB/s
    smoothed = state.links[(0, 1)][-1].bandwidth_Bps
    assert 1_024_000 < smoothed < 2_048_000


def test_monitor_once_prints_the_stage_rows_and_the_skipped_count(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _cli(["monitor", str(run_dir), "--once", "--window", "4"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "MiB" in line and "→" not in line]
    assert len(rows) == 2 and "24.00" in rows[1]
    links = [line for line in out.splitlines() if "→" in line]
    assert len(links) == 2 and "4.00" in links[0] and "1.00" in links[1]
    assert "loss 0.2000" in out and "320 samples/s" in out and "finished" in out
    assert "injection-end" in out and "Skipped 2 bad line(s)" in out


def test_monitor_replay_once_ends_where_the_run_ended(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _cli(["monitor", str(run_dir), "--once", "--replay", "--window", "4"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if "MiB" in line and "→" not in line]
    assert len(rows) == 2 and "24.00" in rows[1]
    assert len([line for line in out if "→" in line]) == 2


def test_monitor_on_an_address_binds_a_collector(capsys: pytest.CaptureFixture[str]) -> None:
    args = _cli(["monitor", "tcp://127.0.0.1:*", "--once", "--refresh-s", "0.05"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "collector bound at tcp://127.0.0.1:" in out and "waiting for workers" in out


def test_tail_reads_complete_lines_only_and_restarts_on_a_new_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # not there yet
    path.write_bytes(b'{"a": 1}\n{"b"')
    assert tail.read() == [b'{"a": 1}']
    with path.open("ab") as fh:
        fh.write(b": 2}\n")
    assert tail.read() == [b'{"b": 2}']
    path.write_bytes(b'{"c": 3}\n')  # replaced by a shorter file
    assert tail.read() == [b'{"c": 3}']
    with path.open("ab") as fh:  # a runaway line is dropped, not buffered without end
        fh.write(b"x" * (1 << 20))
    assert tail.read() == [] and tail.oversized == 1
    with path.open("ab") as fh:
        fh.write(b'xxx\n{"d": 4}\n')
    assert tail.read() == [b'{"d": 4}']


@pytest.mark.parametrize(
    ("command", "damage", "named"),
    [
        ("monitor", "no-dir", "run"),
        ("monitor", "rm telemetry.jsonl", "telemetry.jsonl"),
        ("monitor", "empty telemetry.jsonl", "telemetry.jsonl"),
        ("monitor", "garbage telemetry.jsonl", "telemetry.jsonl"),
        ("report", "no-dir", "run"),
        ("report", "rm metrics.jsonl", "metrics.jsonl"),
        ("report", "empty metrics.jsonl", "metrics.jsonl"),
    ],
)
def test_missing_or_empty_files_raise_a_plan_error_naming_the_path(
    tmp_path: Path, command: str, damage: str, named: str
) -> None:
    root = tmp_path / "run"
    if damage != "no-dir":
        _write_run(root)
        action, name = damage.split()
        if action == "rm":
            (root / name).unlink()
        else:
            (root / name).write_text("" if action == "empty" else "nonsense\n[1, 2]\n")
    argv = [command, str(root)] + (["--once"] if command == "monitor" else [])
    args = _cli(argv)
    with pytest.raises(PlanError) as info:
        args.func(args)
    assert str(root / named) in str(info.value) if named != "run" else str(root) in str(info.value)


def test_loss_curves_are_labelled_with_the_job_names(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adaptipe.monitor import charts
    from adaptipe.monitor.report import _job_names

    (run_dir / "config.json").write_text(
        json.dumps({"sweep": {"jobs": [{"name": "lr=0.01"}, {"name": "lr=0.1"}]}})
    )
    names = _job_names(run_dir)
    assert names == {"0": "lr=0.01", "1": "lr=0.1"}
    assert _job_names(run_dir / "nowhere") == {}
    figures: list[Any] = []
    monkeypatch.setattr(charts, "_save", lambda fig, path: figures.append(fig))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    charts._plot_throughput(metrics, [], run_dir / "t.png", names)
    labels = figures[0].axes[1].get_legend_handles_labels()[1]
    assert labels[:2] == ["lr=0.01 (#0)", "lr=0.1 (#1)"]


def test_the_live_view_shows_each_iteration_once_across_a_resume() -> None:
    state = MonitorState(window=20)
    for it in range(6):
        state.add_metrics({"iteration": it, "loss": 1.0})
    for it in range(4):  # the resumed run rewrote metrics.jsonl: read again from the top
        state.add_metrics({"iteration": it, "loss": 2.0})
    state.add_metrics({"iteration": 4, "loss": 3.0})
    assert [m["iteration"] for m in state.metrics] == [0, 1, 2, 3, 4]
    assert state.metrics[-1]["loss"] == 3.0


def test_a_legend_of_long_job_names_gets_fewer_columns_so_it_fits() -> None:
    from adaptipe.monitor.charts import _legend_columns

    short = ["per iteration", "decision", "lr=0.1 (#0)"]
    assert _legend_columns(short, 10.0) == 3
    long = [f"lr=0.00{k},batch_size=16,momentum=0.9 (#{k})" for k in range(8)]
    cols = _legend_columns(long, 10.0)
    assert 1 <= cols <= 3  # 6 columns of these ran off both edges of a 10-inch figure
    assert cols * (max(map(len, long)) + 7) * 0.62 * 10 <= 10.0 * 72
