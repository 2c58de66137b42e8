"""The report's charts: matplotlib figures (Agg canvas, no pyplot, no display) as PNGs.

:func:`draw_charts` draws throughput and loss, per-stage compute / waiting /
communication time, device readings over time, per-layer forward and backward time as
heatmaps, and per-link bandwidth over time, each where the logs hold its data. The
run's marks (`adaptipe.monitor.timeline`) are drawn on every chart: injections shaded
from their start to their end, other events as vertical lines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptipe.monitor.schema import DeviceSample, LinkSample, StageStats
from adaptipe.monitor.timeline import Mark

if TYPE_CHECKING:  # matplotlib is imported when drawing, so `adaptipe --help` stays fast
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["STAGE_PARTS", "as_float", "by_link", "draw_charts"]

STAGE_PARTS = (  # metrics.jsonl stage key, legend, colour
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
_POINT_COLOURS = {
    "checkpoint": "#555555",
    "migration": "#1f77b4",
    "decision": "#2ca02c",
    "injection-failed": "#000000",
}
_DPI = 110


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
        fig.legend(
            entries.values(),
            entries.keys(),
            loc="outside upper center",
            ncols=_legend_columns(list(entries), fig.get_figwidth()),
        )
    fig.savefig(path, dpi=_DPI)


def _legend_columns(labels: Sequence[str], width_in: float, *, most: int = 6) -> int:
    """As many legend columns as fit the figure's width: a legend wider than its figure
    runs off both edges (the job names of a big sweep are long)."""
    chars = width_in * 72 / (0.62 * 10)  # characters of 10 pt text across the figure
    per_entry = max(len(label) for label in labels) + 7  # the handle, the padding
    return max(1, min(most, len(labels), int(chars // per_entry)))


def _rolling(values: np.ndarray, n: int) -> np.ndarray:
    """Trailing mean over up to n points, ignoring NaN."""
    valid = ~np.isnan(values)
    sums = np.concatenate(([0.0], np.cumsum(np.where(valid, values, 0.0))))
    counts = np.concatenate(([0], np.cumsum(valid)))
    end = np.arange(1, values.size + 1)
    start = np.maximum(0, end - n)
    got = counts[end] - counts[start]
    return np.where(got > 0, (sums[end] - sums[start]) / np.maximum(got, 1), np.nan)


def as_float(value: Any) -> float:
    """A logged value as a float: NaN when it is missing, not a number, or not finite."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else math.nan


def _throughput_line(metrics: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    its = np.array([m["iteration"] for m in metrics], dtype=float)
    return its, np.array([as_float(m.get("samples_per_s")) for m in metrics])


def _plot_throughput(
    metrics: list[dict[str, Any]],
    marks: list[Mark],
    path: Path,
    names: dict[str, str],
    compare: dict[str, list[dict[str, Any]]] | None = None,
) -> None:
    its, sps = _throughput_line(metrics)
    fig = _new_figure(10, 6.5)
    top, bottom = fig.subplots(2, 1, sharex=True)
    # Drawn as steps: each iteration holds its value over its own width, so a job-array's
    # windows (whose iterations share one time) show no ramps between them.
    step = {"drawstyle": "steps-mid"}
    top.plot(its, sps, color="#4C72B0", lw=0.8, alpha=0.45, label="per iteration", **step)
    top.plot(its, _rolling(sps, 10), color="#4C72B0", lw=2.0, label="mean of last 10", **step)
    greys = ("#7f7f7f", "#bcbd22", "#17becf")
    for k, (label, other) in enumerate((compare or {}).items()):
        x, y = _throughput_line(other)
        top.plot(x, _rolling(y, 10), color=greys[k % 3], lw=1.6, ls="-.", label=label, **step)
    top.set(title="Throughput", ylabel="samples/s")
    top.set_ylim(bottom=0)
    jobs = sorted({j for m in metrics for j in (m.get("losses") or {})}, key=_job_order)
    if len(jobs) > 1:
        for job in jobs:
            ys = [as_float((m.get("losses") or {}).get(job)) for m in metrics]
            label = f"{names[job]} (#{job})" if job in names else f"job {job}"
            bottom.plot(its, ys, lw=1.2, label=label)
    else:
        bottom.plot(
            its, [as_float(m.get("loss")) for m in metrics], color="#C44E52", lw=1.2, label="loss"
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
                as_float(m["stages"][s].get(key)) * 1e3 if s < len(m["stages"]) else math.nan
                for m in metrics
            ]
            for key, _, _ in STAGE_PARTS
        ]
        ax.stackplot(
            its,
            *parts,
            labels=[p[1] for p in STAGE_PARTS],
            colors=[p[2] for p in STAGE_PARTS],
            lw=0,
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


def by_link(samples: list[LinkSample]) -> dict[tuple[int, int], list[LinkSample]]:
    """Link samples per (sender, receiver), links sorted and each link's samples in time order."""
    out: dict[tuple[int, int], list[LinkSample]] = {}
    for s in sorted(samples, key=lambda s: s.time_s):
        out.setdefault((s.src, s.dst), []).append(s)
    return dict(sorted(out.items()))


def _plot_links(samples: list[LinkSample], t0: float, marks: list[Mark], path: Path) -> bool:
    """Per link: bytes over busy time per iteration (thin) and the bandwidth the sender
    reported (thick), and busy time."""
    links = by_link(samples)
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
        title="Link bandwidth: bytes over busy time (thin) and reported (thick)",
        ylabel="MB/s (1e6 B/s)",
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


def draw_charts(
    out_dir: Path,
    *,
    metrics: list[dict[str, Any]],
    stats: list[StageStats],
    samples: list[DeviceSample],
    links: list[LinkSample],
    t0: float,
    marks: list[Mark],
    job_names: dict[str, str] | None = None,
    compare: dict[str, list[dict[str, Any]]] | None = None,
) -> list[str]:
    """Draw every chart the logs have data for into ``out_dir`` as ``NAME.png``.

    ``job_names``: a job-array's job names by index (as the metrics key them), for the
    loss curves' legend. ``compare``: other runs' metrics by label, whose smoothed
    throughput is drawn beside this run's.

    Returns:
        The names drawn, in page order: throughput and stage_times always, then device,
        layers and links where there is data for them.
    """
    drawn = ["throughput", "stage_times"]
    _plot_throughput(metrics, marks, out_dir / "throughput.png", job_names or {}, compare or {})
    _plot_stage_times(metrics, marks, out_dir / "stage_times.png")
    if _plot_device(samples, t0, marks, out_dir / "device.png"):
        drawn.append("device")
    if _plot_layers(stats, marks, out_dir / "layers.png"):
        drawn.append("layers")
    if _plot_links(links, t0, marks, out_dir / "links.png"):
        drawn.append("links")
    return drawn
