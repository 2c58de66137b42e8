"""``adaptipe report``: charts and one self-contained HTML page from a run directory.

:func:`make_report` reads the run directory (`adaptipe.monitor.runlog`), places its
events on the run's time line (`adaptipe.monitor.timeline`) and draws up to five PNGs
into ``RUN_DIR/report/`` (`adaptipe.monitor.charts`): throughput and loss, per-stage
compute / waiting / communication time, device readings over time, per-layer forward and
backward time as heatmaps, and per-link bandwidth over time (measured from the
pipeline's own sends). Injections are shaded from their start to their end and other
events (checkpoints, migrations) drawn as vertical lines on every chart. ``report.html``
embeds the PNGs by relative path next to the run's summary; it loads nothing else.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from adaptipe.errors import PlanError
from adaptipe.monitor.charts import STAGE_PARTS, as_float, by_link, draw_charts
from adaptipe.monitor.runlog import (
    METRICS,
    TELEMETRY,
    RunLog,
    control_events,
    load_run,
    skipped_note,
)
from adaptipe.monitor.schema import DeviceSample, LinkSample, StageStats
from adaptipe.monitor.timeline import Mark, run_marks

__all__ = ["Mark", "make_report"]


# --------------------------------------------------------------------------- the page
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.7em; text-align: right; }
th { background: #f2f2f2; } td.text, th.text { text-align: left; }
img { max-width: 100%; border: 1px solid #ddd; }
figure { margin: 1em 0 2em; } figcaption { color: #555; font-size: 0.9em; }
.note { color: #8a4b00; }
"""
_CHARTS = {
    "throughput": "Throughput (samples/s) and training loss per iteration.",
    "stage_times": "Per stage: compute, waiting and communication time per iteration, stacked.",
    "device": "Device readings per stage over time.",
    "layers": "Per-layer forward and backward time per iteration (log colour scale).",
    "links": (
        "Per link (sender → receiver): bandwidth of the pipeline's own sends, timed from "
        "post to completion, and the time per iteration the link had a send in flight."
    ),
}


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = (
            "-"
            if not math.isfinite(value)
            else f"{value:,.2f}"
            if abs(value) >= 1
            else f"{value:.4g}"
        )
    else:
        text = "-" if value is None else str(value)
    cls = "" if isinstance(value, int | float) else ' class="text"'
    return f"<td{cls}>{html.escape(text)}</td>"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>\n" for row in rows)
    return f"<table><tr>{head}</tr>\n{body}</table>"


def _summary_html(log: RunLog) -> str:
    out: list[str] = []
    summary = log.summary
    metrics = log.metrics
    if summary is None:
        out.append(f'<p class="note">No summary.json: figures below come from {METRICS}.</p>')
        sps = [v for v in (as_float(m.get("samples_per_s")) for m in metrics) if math.isfinite(v)]
        summary = {
            "iterations": len(metrics),
            "final_loss": as_float(metrics[-1].get("loss")),
            "samples_per_s": float(np.mean(sps)) if sps else None,
        }
    names = {
        "iterations": "iterations",
        "start_iteration": "first iteration",
        "final_loss": "final loss",
        "samples_per_s": "samples/s",
        "wall_s": "wall time (s)",
    }
    rows = [(name, summary[k]) for k, name in names.items() if k in summary]
    out.append(_table(("", "value"), rows))
    stage_rows = []
    means = summary.get("stages") or [
        {
            k: float(
                np.nanmean(
                    [as_float(m["stages"][s].get(k)) for m in metrics if s < len(m["stages"])]
                )
            )
            for k, _, _ in STAGE_PARTS
        }
        for s in range(max(len(m["stages"]) for m in metrics))
    ]
    for s, stage in enumerate(means):
        c, w, m = (as_float(stage.get(k)) for k, _, _ in STAGE_PARTS)
        share = c / (c + w + m) if c + w + m > 0 else math.nan
        stage_rows.append((s, c * 1e3, w * 1e3, m * 1e3, 100 * share))
    out.append("<h2>Stages (mean per iteration)</h2>")
    out.append(
        _table(("stage", "compute ms", "waiting ms", "communication ms", "computing %"), stage_rows)
    )
    jobs = summary.get("jobs") or []
    if jobs and all(isinstance(j, dict) for j in jobs):
        order = ["rank", "job", "name", "val_loss", "train_loss"]
        cols = [k for k in order if any(k in j for j in jobs)]
        cols += sorted({k for j in jobs for k in j} - set(cols))
        out.append("<h2>Jobs, best first</h2>")
        out.append(
            _table([c.replace("_", " ") for c in cols], [[j.get(c) for c in cols] for j in jobs])
        )
    return "\n".join(out)


def _links_html(samples: list[LinkSample]) -> str:
    rows = []
    for (src, dst), ss in by_link(samples).items():
        nbytes = sum(s.nbytes for s in ss)
        busy = sum(s.seconds for s in ss)
        per_it = [s.nbytes / s.seconds / 1e6 for s in ss if s.seconds > 0]
        rows.append(
            (
                f"{src} → {dst}",
                len(ss),
                nbytes / 1e6,
                nbytes / busy / 1e6 if busy > 0 else math.nan,
                min(per_it, default=math.nan),
                max(per_it, default=math.nan),
                ss[-1].bandwidth_Bps / 1e6,
            )
        )
    header = ("link", "samples", "MB sent", "mean MB/s", "slowest", "fastest", "last reported")
    return _table(header, rows)


def _events_html(marks: Sequence[Mark]) -> str:
    if not marks:
        return "<p>No events were recorded.</p>"
    rows = []
    for m in marks:
        when = (
            "-"
            if m.start_s is None
            else f"{m.start_s:.2f}" + ("" if m.end_s is None else f" to {m.end_s:.2f}")
        )
        its = (
            "-"
            if m.start_it is None
            else f"{m.start_it:.1f}" + ("" if m.end_it is None else f" to {m.end_it:.1f}")
        )
        rows.append((m.label, when, its, m.detail))
    return _table(("event", "seconds since start", "iteration", "detail"), rows)


_KEEPS_LISTED = 30  # more decisions than this: only the moves and errors get a row


def _decisions_html(root: Path) -> str:
    """The controller's decisions (``control.jsonl``): iteration, controller, action,
    predicted and realised gain, the stage slowdowns decided on, reason; '' when the run
    logged none."""
    decisions, realised = [], {}
    for event in control_events(root):
        if event.get("event") == "decision":
            decisions.append(event)
        elif event.get("event") == "decision_outcome":
            realised[event.get("iteration")] = event.get("realised_gain_s")
    if not decisions:
        return ""
    rows = [
        _decision_row(e, realised)
        for e in decisions
        if len(decisions) <= _KEEPS_LISTED or _decision_action(e) != "keep"
    ]
    note = (
        f"<p>{len(decisions) - len(rows)} more checks kept the partition (every one is in "
        "control.jsonl).</p>"
        if len(rows) < len(decisions)
        else ""
    )
    header = ("iteration", "controller", "action", "predicted gain (ms)", "realised gain (ms)")
    return _table((*header, "stage slowdowns", "reason"), rows) + note


def _decision_action(e: dict[str, Any]) -> str:
    bounds = (e.get("decision") or {}).get("bounds")
    if e.get("error"):
        return "error"
    if bounds is None:
        return "keep"
    return f"move to {bounds}" if e.get("acted") else f"would move to {bounds} (not acted on)"


def _decision_row(e: dict[str, Any], realised: dict[Any, Any]) -> tuple[Any, ...]:
    decision = e.get("decision") or {}
    gain = decision.get("predicted_gain_s")
    got = realised.get(e.get("iteration")) if e.get("acted") else None
    return (
        e.get("iteration"),
        str(e.get("controller", "")),
        _decision_action(e),
        gain * 1e3 if isinstance(gain, int | float) else None,
        got * 1e3 if isinstance(got, int | float) else None,
        _slowdowns(e.get("inputs") or {}),
        str(e.get("error") or decision.get("reason", "")),
    )


def _slowdowns(inputs: dict[str, Any]) -> str:
    """The per-stage slowdowns a decision was made on (the chain's where it logged them)
    and, where a stage's place was calibrated, its factors: "1.02, 3.10 (place 0.97,
    2.80)"; '' for none."""
    chain = inputs.get("chain")
    slow = chain.get("slowdowns") if isinstance(chain, dict) else None
    slow = slow if isinstance(slow, list) else inputs.get("slowdowns")
    if not isinstance(slow, list):
        return ""

    def listed(values: list[Any]) -> str:
        return ", ".join(f"{v:.2f}" if isinstance(v, int | float) else "-" for v in values)

    factors = inputs.get("position_factors")
    place = f" (place {listed(factors)})" if isinstance(factors, list) else ""
    return listed(slow) + place


def _compared_html(compare: Mapping[str, str | Path]) -> str:
    if not compare:
        return ""
    runs = "; ".join(
        f"{html.escape(label)}: {html.escape(str(Path(d).resolve()))}"
        for label, d in compare.items()
    )
    return f"<p>The throughput chart also draws {runs}.</p>"


def _job_names(root: Path) -> dict[str, str]:
    """A job-array's job names by index, from the run's config.json ({} otherwise)."""
    try:
        jobs = json.loads((root / "config.json").read_text())["sweep"]["jobs"]
        return {str(i): str(job["name"]) for i, job in enumerate(jobs)}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def make_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    compare: Mapping[str, str | Path] | None = None,
) -> Path:
    """Draw the charts and write ``report.html`` into ``out`` (default ``RUN_DIR/report``).

    ``compare``: other run directories by label (the same job under another plan, say),
    whose throughput the throughput chart draws beside this run's.

    Returns:
        The HTML page's path.

    Raises:
        PlanError: the run directory or its metrics.jsonl is missing, or metrics.jsonl
            is empty or has no valid line. A missing telemetry.jsonl only leaves out the
            device, per-layer and link charts.
    """
    log = load_run(run_dir, need=(METRICS,))
    out_dir = Path(out) if out is not None else log.root / "report"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlanError(f"{out_dir}: cannot create the report folder ({exc})") from None
    metrics = sorted(
        {m["iteration"]: m for m in log.metrics}.values(), key=lambda m: m["iteration"]
    )
    stats = [r for r in log.records if isinstance(r, StageStats)]
    samples = [r for r in log.records if isinstance(r, DeviceSample)]
    links = [r for r in log.records if isinstance(r, LinkSample)]
    t0 = min((r.time_s for r in log.records), default=0.0)
    t_end = max((r.time_s for r in log.records), default=t0) - t0
    marks = run_marks(log, stats, t0, t_end)
    others = {
        label: sorted(load_run(other, need=(METRICS,)).metrics, key=lambda m: m["iteration"])
        for label, other in (compare or {}).items()
    }
    drawn = draw_charts(
        out_dir,
        metrics=metrics,
        stats=stats,
        samples=samples,
        links=links,
        t0=t0,
        marks=marks,
        job_names=_job_names(log.root),
        compare=others,
    )
    for chart in set(_CHARTS) - set(drawn):  # a previous report's chart would mislead
        (out_dir / f"{chart}.png").unlink(missing_ok=True)
    name = html.escape(log.root.resolve().name)
    notes = []
    if not (log.root / TELEMETRY).exists():
        notes.append(f"No {TELEMETRY}: device, per-layer and link charts and events are left out.")
    elif not stats and not samples:
        notes.append(f"{TELEMETRY} has no stage statistics or device samples.")
    if skipped := skipped_note(log.skipped):
        notes.append(f"{skipped} (left out of the charts).")
    figures = "\n".join(
        f'<figure><img src="{c}.png" alt="{html.escape(_CHARTS[c])}">'
        f"<figcaption>{html.escape(_CHARTS[c])}</figcaption></figure>"
        for c in drawn
    )
    decisions = _decisions_html(log.root)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>adaptipe report: {name}</title>
<style>{_CSS}</style></head><body>
<h1>Run {name}</h1>
<p>{html.escape(str(log.root.resolve()))} · report written {datetime.now():%Y-%m-%d %H:%M}</p>
{"".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)}
{_compared_html(compare or {})}
<h2>Summary</h2>
{_summary_html(log)}
{"<h2>Links (bandwidth per iteration)</h2>" + _links_html(links) if links else ""}
{"<h2>Decisions</h2>" + decisions if decisions else ""}
<h2>Events</h2>
<p>Injections are shaded from start to end on the charts; other events are dashed lines.</p>
{_events_html(marks)}
<h2>Charts</h2>
{figures}
</body></html>
"""
    page_path = out_dir / "report.html"
    page_path.write_text(page, encoding="utf-8")
    return page_path
