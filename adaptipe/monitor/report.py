"""``adaptipe report``: charts and one self-contained HTML page from a run directory.

:func:`make_report` draws up to five PNGs (matplotlib's Agg canvas, no pyplot and no
display) into ``RUN_DIR/report/``: throughput and loss, per-stage compute / waiting /
communication time, device readings over time, per-layer forward and backward time as
heatmaps, and per-link bandwidth over time (measured from the pipeline's own sends). Injections are shaded from their start to their end and other events
(checkpoints, migrations) drawn as vertical lines on every chart. ``report.html``
embeds the PNGs by relative path next to the run's summary; it loads nothing else.
"""

from __future__ import annotations

import argparse
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptipe.errors import PlanError
from adaptipe.monitor.live import METRICS, TELEMETRY, RunLog, load_run, skipped_note
from adaptipe.monitor.schema import DeviceSample, Event, LinkSample, StageStats

if TYPE_CHECKING:  # matplotlib is imported when drawing, so `adaptipe --help` stays fast
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Mark", "add_report_parser", "make_report", "run_report_command"]

_PARTS = (  # metrics.jsonl stage key, legend, colour
    ("compute_s", "compute", "#4C72B0"),
    ("wait_s", "waiting", "#DD8452"),
    ("comm_s", "communication", "#55A868"),
)
# (field, title, unit, scale): drawn when any sample has the field
_DEVICE_FIELDS = (
    ("util_pct", "Device utilisation", "%", 1.0),
    ("proc_util_pct", "Stage process CPU use", "% of all CPUs", 1.0),
    ("run_queue", "Run queue", "runnable tasks", 1.0),
    ("ctx_switches_per_s", "Context switches (system)", "per second", 1.0),
    ("proc_ctx_involuntary_per_s", "Involuntary context switches (stage)", "per second", 1.0),
    ("rss_bytes", "Stage process memory (RSS)", "GiB", 2.0**-30),
    ("mem_used_bytes", "Memory used (host on CPU, device on GPU)", "GiB", 2.0**-30),
    ("temperature_c", "Temperature", "°C", 1.0),
    ("power_w", "Power", "W", 1.0),
)
_LINK_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")
_INJECTION_COLOURS = ("#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#bcbd22")
_POINT_COLOURS = {"checkpoint": "#555555", "migration": "#1f77b4", "injection-failed": "#000000"}
_DPI = 110


@dataclass(frozen=True, slots=True)
class Mark:
    """An event on the run's time line: a span (injection) or a point (``end_s`` None).

    Times are seconds since the run's first record; ``start_it``/``end_it`` are the same
    moments in iterations (fractional), or None where no stage statistics say when.
    """

    kind: str
    label: str
    start_s: float | None
    end_s: float | None
    start_it: float | None
    end_it: float | None
    detail: str = ""

    @property
    def is_span(self) -> bool:
        return self.end_s is not None or self.end_it is not None


class _Clock:
    """Converts between wall time and iterations using when each iteration ended."""

    def __init__(self, stats: Sequence[StageStats], t0: float) -> None:
        ends: dict[int, float] = {}
        for s in stats:  # the latest report wins, so a resumed run's repeats use their retry
            ends[s.iteration] = max(ends.get(s.iteration, 0.0), s.time_s)
        pairs = sorted((t - t0, it) for it, t in ends.items())
        self.times = np.array([p[0] for p in pairs], dtype=float)
        self.iters = np.array([p[1] for p in pairs], dtype=float)

    def to_iter(self, t: float | None) -> float | None:
        if t is None or self.times.size < 2:
            return None
        # iteration k is drawn at x=k and spans (k-0.5, k+0.5); it ends at times[k]
        return float(np.interp(t, self.times, self.iters)) + 0.5

    def to_time(self, it: float | None) -> float | None:
        if it is None or self.times.size < 2:
            return None
        order = np.argsort(self.iters)
        return float(np.interp(it - 0.5, self.iters[order], self.times[order]))


def _marks(log: RunLog, clock: _Clock, t0: float, t_end: float) -> list[Mark]:
    """Injection start/end pairs become spans (matched by origin, injector and stage)."""
    marks: list[Mark] = []
    open_spans: dict[tuple[Any, ...], Event] = {}

    def detail(e: Event) -> str:
        where = "" if e.stage is None else f"stage {e.stage} "
        return where + " ".join(f"{k}={v}" for k, v in e.detail.items())

    def span(start: Event, end_s: float, note: str = "") -> Mark:
        s0 = start.time_s - t0
        label = f"{start.detail.get('injector', 'injection')} injection"
        its = clock.to_iter(s0), clock.to_iter(end_s)
        return Mark("injection", label, s0, end_s, *its, detail(start) + note)

    for e in sorted((r for r in log.records if isinstance(r, Event)), key=lambda e: e.time_s):
        key = (e.detail.get("origin"), e.detail.get("injector"), e.stage)
        if e.kind == "injection-start":
            open_spans[key] = e
        elif e.kind == "injection-end" and key in open_spans:
            marks.append(span(open_spans.pop(key), e.time_s - t0))
        else:
            s = e.time_s - t0
            marks.append(Mark(e.kind, e.kind, s, None, clock.to_iter(s), None, detail(e)))
    marks += [span(start, t_end, " (no end recorded)") for start in open_spans.values()]
    if not any(m.kind == "checkpoint" for m in marks):  # fall back on the checkpoint folders
        for path in sorted((log.root / "checkpoints").glob("iter-*")):
            if (n := path.name.removeprefix("iter-")).isdigit():
                x = int(n) - 0.5  # iter-N holds the state after N iterations
                marks.append(
                    Mark("checkpoint", "checkpoint", clock.to_time(x), None, x, None, path.name)
                )
    return sorted(marks, key=lambda m: (m.start_it or 0.0, m.start_s or 0.0))


def _draw_marks(
    ax: Axes, marks: Sequence[Mark], *, axis: str, labelled: set[str], outline: bool = False
) -> None:
    """Shade spans (or, with ``outline``, draw their edges) and draw point events as lines.

    Each label is given once per figure (``labelled``), so the legend lists it once.
    """
    colours: dict[str, str] = {}
    for m in marks:
        x0, x1 = (m.start_it, m.end_it) if axis == "iteration" else (m.start_s, m.end_s)
        if x0 is None:
            continue
        text = f"{m.label} (start solid, end dotted)" if outline and m.is_span else m.label
        label = text if text not in labelled else None
        labelled.add(text)
        if m.is_span and x1 is not None:
            colour = colours.setdefault(m.label, _INJECTION_COLOURS[len(colours) % 6])
            if outline:
                ax.axvline(x0, color=colour, lw=1.5, label=label)
                ax.axvline(x1, color=colour, lw=1.5, ls=":")
            else:
                ax.axvspan(x0, x1, color=colour, alpha=0.13, lw=0, label=label, zorder=0)
        else:
            colour = _POINT_COLOURS.get(m.kind, "#333333")
            ax.axvline(x0, color=colour, ls="--", lw=1.0, alpha=0.8, label=label, zorder=1)


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks between lo and hi (every integer mantissa if that gives too few)."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for mantissas in ((1, 2, 5), tuple(range(1, 10))):
        ticks = [m * 10.0**k for k in decades for m in mantissas if lo <= m * 10.0**k <= hi]
        if len(ticks) >= 3:
            return ticks
    return [lo, hi]


def _save(fig: Figure, path: Path) -> None:
    """One legend for the whole figure, above the charts where it hides no data."""
    entries: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if entries:
        ncols = min(len(entries), 6)
        fig.legend(entries.values(), entries.keys(), loc="outside upper center", ncols=ncols)
    fig.savefig(path, dpi=_DPI)


def _rolling(values: np.ndarray, n: int) -> np.ndarray:
    """Trailing mean over up to n points, ignoring NaN."""
    valid = ~np.isnan(values)
    sums = np.concatenate(([0.0], np.cumsum(np.where(valid, values, 0.0))))
    counts = np.concatenate(([0], np.cumsum(valid)))
    end = np.arange(1, values.size + 1)
    start = np.maximum(0, end - n)
    got = counts[end] - counts[start]
    return np.where(got > 0, (sums[end] - sums[start]) / np.maximum(got, 1), np.nan)


def _f(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else math.nan


def _plot_throughput(metrics: list[dict[str, Any]], marks: list[Mark], path: Path) -> None:
    its = np.array([m["iteration"] for m in metrics], dtype=float)
    sps = np.array([_f(m.get("samples_per_s")) for m in metrics])
    fig = _new_figure(10, 6.5)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(its, sps, color="#4C72B0", lw=0.8, alpha=0.45, label="per iteration")
    top.plot(its, _rolling(sps, 10), color="#4C72B0", lw=2.0, label="mean of last 10")
    top.set(title="Throughput", ylabel="samples/s")
    top.set_ylim(bottom=0)
    jobs = sorted({j for m in metrics for j in (m.get("losses") or {})}, key=_job_order)
    if len(jobs) > 1:
        for job in jobs:
            ys = [_f((m.get("losses") or {}).get(job)) for m in metrics]
            bottom.plot(its, ys, lw=1.2, label=f"job {job}")
    else:
        bottom.plot(
            its, [_f(m.get("loss")) for m in metrics], color="#C44E52", lw=1.2, label="loss"
        )
    losses = [y for line in bottom.get_lines() for y in np.asarray(line.get_ydata(), float)]
    finite = [y for y in losses if math.isfinite(y)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        bottom.set_yscale("log")
    bottom.set(title="Training loss", xlabel="iteration", ylabel="loss")
    labelled: set[str] = set()
    for ax in (top, bottom):
        _draw_marks(ax, marks, axis="iteration", labelled=labelled)
        ax.grid(alpha=0.3)
    _save(fig, path)


def _job_order(job: str) -> tuple[int, str]:
    return (int(job), "") if job.isdigit() else (1 << 30, job)


def _plot_stage_times(metrics: list[dict[str, Any]], marks: list[Mark], path: Path) -> None:
    its = np.array([m["iteration"] for m in metrics], dtype=float)
    stages = max(len(m["stages"]) for m in metrics)
    fig = _new_figure(10, 1.0 + 2.2 * stages)
    axes = np.atleast_1d(fig.subplots(stages, 1, sharex=True, sharey=True))
    labelled: set[str] = set()
    for s, ax in enumerate(axes):
        parts = [
            [
                _f(m["stages"][s].get(key)) * 1e3 if s < len(m["stages"]) else math.nan
                for m in metrics
            ]
            for key, _, _ in _PARTS
        ]
        ax.stackplot(
            its, *parts, labels=[p[1] for p in _PARTS], colors=[p[2] for p in _PARTS], lw=0
        )
        ax.set(title=f"Stage {s}: time per iteration", ylabel="ms")
        _draw_marks(ax, marks, axis="iteration", labelled=labelled)
        ax.grid(alpha=0.3)
        ax.margins(x=0)
    axes[-1].set_xlabel("iteration")
    _save(fig, path)


def _plot_device(samples: list[DeviceSample], t0: float, marks: list[Mark], path: Path) -> bool:
    present = [f for f in _DEVICE_FIELDS if any(f[0] in s.fields for s in samples)]
    if not present:
        return False
    cols = 2 if len(present) > 1 else 1
    rows = math.ceil(len(present) / cols)
    fig = _new_figure(11, 0.6 + 2.6 * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, squeeze=False)).ravel()
    stages = sorted({s.stage for s in samples})
    labelled: set[str] = set()
    for ax, (name, title, unit, scale) in zip(axes, present, strict=False):
        for stage in stages:
            got = [
                (s.time_s - t0, s.fields[name] * scale)
                for s in samples
                if s.stage == stage and name in s.fields
            ]
            if got:
                xs, ys = zip(*sorted(got), strict=True)
                ax.plot(xs, ys, lw=1.2, marker="." if len(xs) < 40 else "", label=f"stage {stage}")
        ax.set(title=title, ylabel=unit)
        _draw_marks(ax, marks, axis="time", labelled=labelled)
        ax.grid(alpha=0.3)
    for ax in axes[len(present) :]:
        ax.set_visible(False)
    for ax in axes[max(0, len(present) - cols) : len(present)]:
        ax.set_xlabel("seconds since the run's first record")
        ax.xaxis.set_tick_params(labelbottom=True)
    _save(fig, path)
    return True


def _plot_layers(stats: list[StageStats], marks: list[Mark], path: Path) -> bool:
    latest: dict[tuple[int, int], StageStats] = {}
    for s in stats:
        if s.forward_s:
            latest[(s.stage, s.iteration)] = s
    if not latest:
        return False
    stages = sorted({stage for stage, _ in latest})
    lo_it = min(it for _, it in latest)
    hi_it = max(it for _, it in latest)
    grids: dict[tuple[int, str], tuple[np.ndarray, int]] = {}
    for stage in stages:
        mine = [s for (st, _), s in latest.items() if st == stage]
        first = min(s.first_layer for s in mine)
        last = max(s.first_layer + len(s.forward_s) for s in mine)
        for kind in ("forward_s", "backward_s"):
            grid = np.full((last - first, hi_it - lo_it + 1), np.nan)
            for s in mine:
                values = np.asarray(getattr(s, kind), dtype=float) * 1e3
                grid[
                    s.first_layer - first : s.first_layer - first + values.size, s.iteration - lo_it
                ] = values
            grids[(stage, kind)] = (grid, first)
    positive = np.concatenate([g[g > 0] for g, _ in grids.values()])
    if positive.size == 0:
        return False
    lo, hi = float(positive.min()), float(positive.max())
    hi = max(hi, lo * 1.01)  # one colour for all cells still needs a range
    from matplotlib.colors import LogNorm

    norm = LogNorm(vmin=lo, vmax=hi)
    heights = [grids[(s, "forward_s")][0].shape[0] + 2 for s in stages]
    fig = _new_figure(12, 1.2 + 0.25 * sum(heights) + 0.6 * len(stages))
    axes = fig.subplots(len(stages), 2, sharex=True, squeeze=False, height_ratios=heights)
    labelled: set[str] = set()
    image = None
    for row, stage in enumerate(stages):
        for col, (kind, name) in enumerate((("forward_s", "forward"), ("backward_s", "backward"))):
            grid, first = grids[(stage, kind)]
            ax = axes[row, col]
            extent = (lo_it - 0.5, hi_it + 0.5, first + grid.shape[0] - 0.5, first - 0.5)
            image = ax.imshow(
                np.ma.masked_invalid(grid),
                aspect="auto",
                interpolation="nearest",
                cmap="viridis",
                norm=norm,
                extent=extent,
            )
            ax.set(title=f"Stage {stage}: {name} time per layer", ylabel="layer")
            ax.yaxis.get_major_locator().set_params(integer=True)
            # shading would change the heatmap's colours: draw the spans' edges instead
            _draw_marks(ax, marks, axis="iteration", labelled=labelled, outline=True)
            ax.set_xlim(lo_it - 0.5, hi_it + 0.5)
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    assert image is not None
    bar = fig.colorbar(image, ax=axes, label="ms per iteration (log scale)", shrink=0.9)
    ticks = _log_ticks(lo, hi)
    bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.minorticks_off()
    _save(fig, path)
    return True


def _by_link(samples: list[LinkSample]) -> dict[tuple[int, int], list[LinkSample]]:
    out: dict[tuple[int, int], list[LinkSample]] = {}
    for s in sorted(samples, key=lambda s: s.time_s):
        out.setdefault((s.src, s.dst), []).append(s)
    return dict(sorted(out.items()))


def _plot_links(samples: list[LinkSample], t0: float, marks: list[Mark], path: Path) -> bool:
    """Per link: bandwidth per iteration (thin) and smoothed (thick), and busy time."""
    links = _by_link(samples)
    if not links:
        return False
    fig = _new_figure(10, 6.5)
    top, bottom = fig.subplots(2, 1, sharex=True)
    rates: list[float] = []
    for k, ((src, dst), ss) in enumerate(links.items()):
        colour = _LINK_COLOURS[k % len(_LINK_COLOURS)]
        xs = [s.time_s - t0 for s in ss]
        per_it = [s.nbytes / s.seconds / 1e6 if s.seconds > 0 else math.nan for s in ss]
        smooth = [s.bandwidth_Bps / 1e6 for s in ss]
        rates += [r for r in per_it + smooth if math.isfinite(r) and r > 0]
        marker = "." if len(xs) < 40 else ""
        top.plot(xs, per_it, color=colour, lw=0.8, alpha=0.45, marker=marker)
        top.plot(xs, smooth, color=colour, lw=2.0, label=f"link {src} → {dst}")
        bottom.plot(xs, [s.seconds * 1e3 for s in ss], color=colour, lw=1.2, marker=marker)
    if rates and max(rates) / min(rates) > 20:
        top.set_yscale("log")
    else:
        top.set_ylim(bottom=0)
    top.set(
        title="Link bandwidth: per iteration (thin) and smoothed (thick)", ylabel="MB/s (1e6 B/s)"
    )
    bottom.set(
        title="Link busy time per iteration (sends in flight, overlaps counted once)",
        xlabel="seconds since the run's first record",
        ylabel="ms",
    )
    bottom.set_ylim(bottom=0)
    labelled: set[str] = set()
    for ax in (top, bottom):
        _draw_marks(ax, marks, axis="time", labelled=labelled)
        ax.grid(alpha=0.3)
    _save(fig, path)
    return True


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
        sps = [v for v in (_f(m.get("samples_per_s")) for m in metrics) if math.isfinite(v)]
        summary = {
            "iterations": len(metrics),
            "final_loss": _f(metrics[-1].get("loss")),
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
                np.nanmean([_f(m["stages"][s].get(k)) for m in metrics if s < len(m["stages"])])
            )
            for k, _, _ in _PARTS
        }
        for s in range(max(len(m["stages"]) for m in metrics))
    ]
    for s, stage in enumerate(means):
        c, w, m = (_f(stage.get(k)) for k, _, _ in _PARTS)
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
    for (src, dst), ss in _by_link(samples).items():
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
    header = ("link", "samples", "MB sent", "mean MB/s", "slowest", "fastest", "last smoothed")
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


def make_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the charts and write ``report.html`` into ``out`` (default ``RUN_DIR/report``).

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
    marks = _marks(log, _Clock(stats, t0), t0, t_end)
    drawn = ["throughput", "stage_times"]
    _plot_throughput(metrics, marks, out_dir / "throughput.png")
    _plot_stage_times(metrics, marks, out_dir / "stage_times.png")
    if _plot_device(samples, t0, marks, out_dir / "device.png"):
        drawn.append("device")
    if _plot_layers(stats, marks, out_dir / "layers.png"):
        drawn.append("layers")
    if _plot_links(links, t0, marks, out_dir / "links.png"):
        drawn.append("links")
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
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>adaptipe report: {name}</title>
<style>{_CSS}</style></head><body>
<h1>Run {name}</h1>
<p>{html.escape(str(log.root.resolve()))} · report written {datetime.now():%Y-%m-%d %H:%M}</p>
{"".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)}
<h2>Summary</h2>
{_summary_html(log)}
{"<h2>Links (bandwidth per iteration)</h2>" + _links_html(links) if links else ""}
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


def add_report_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``adaptipe report RUN_DIR`` to the ``adaptipe`` command."""
    p = subparsers.add_parser("report", help="charts and an HTML page from a run directory")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--out", help="folder for the PNGs and report.html (default RUN_DIR/report)")
    p.set_defaults(func=run_report_command)
    return p


def run_report_command(args: argparse.Namespace) -> int:
    page = make_report(args.run_dir, args.out)
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    print(f"wrote {page} ({', '.join(pngs)})")
    return 0
