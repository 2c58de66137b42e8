"""`plot_gantt`: draw a simulated timeline as a PNG Gantt chart (one row per worker);
`plot_timeline` draws any list of events, e.g. a real run's trace.

Uses matplotlib's Agg canvas directly (no pyplot, no display, no global backend
change). Forwards, backwards, recomputes and optimizer steps get distinct colours; with
job-arrays the colour is the job's and the kind is shown by shade (forward light,
backward full, recompute hatched). Links that carried transfers get thin rows below.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from adaptipe.sim.result import Event, SimResult

__all__ = ["plot_gantt", "plot_timeline"]

_KIND_COLOUR = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "recompute": "#8172B2",
    "step": "#C44E52",
    "switch": "#333333",
    "activation": "#4C72B0",
    "gradient": "#55A868",
}
_JOB_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
_WORKER_H, _LINK_H = 0.8, 0.35
_FONT = 7.0

Style = tuple[tuple[float, float, float], float, str]  # face colour, alpha, hatch


def _chunk_hatch(e: Event) -> str:
    """Later model chunks (interleaved schedules) are hatched, never re-coloured, so
    their shades cannot be mistaken for another kind (e.g. a transfer)."""
    return ".." if e.chunk > 0 and e.where == "worker" else ""


def _style(e: Event, multi_job: bool) -> Style:
    if e.kind in ("step", "switch"):
        return (to_rgb(_KIND_COLOUR[e.kind]), 0.9, "")
    if not multi_job:
        alpha = 0.45 if e.where == "link" else 0.95
        return (to_rgb(_KIND_COLOUR[e.kind]), alpha, _chunk_hatch(e))
    colour = to_rgb(_JOB_COLOURS[e.job % len(_JOB_COLOURS)])
    alpha = {"forward": 0.5, "activation": 0.35, "gradient": 0.6}.get(e.kind, 0.95)
    return (colour, alpha, ("////" if e.kind == "recompute" else "") + _chunk_hatch(e))


def _rows(
    workers: int, events: list[Event]
) -> tuple[dict[tuple[str, int, int], tuple[float, float]], list[str]]:
    """Y position and height of each row (workers first, then used links)."""
    pos: dict[tuple[str, int, int], tuple[float, float]] = {}
    labels: list[str] = []
    y = 0.0
    for s in range(workers):
        pos[("worker", s, -1)] = (y, _WORKER_H)
        labels.append(f"worker {s}")
        y += 1.0
    links = sorted({(e.worker, e.peer) for e in events if e.where == "link"})
    for src, dst in links:
        pos[("link", src, dst)] = (y - 0.5 + _LINK_H, _LINK_H)
        labels.append(f"{src}\u2192{dst}")
        y += 0.55
    return pos, labels


def _legend(events: list[Event], multi_job: bool, chunks: int) -> list[Patch]:
    kinds = {e.kind for e in events}
    order = [
        k
        for k in ("forward", "backward", "recompute", "step", "switch", "activation", "gradient")
        if k in kinds
    ]
    if chunks > 1:
        tints = [Patch(facecolor="white", edgecolor="#555555", hatch="..", label="later chunk")]
    else:
        tints = []
    if not multi_job:
        return [
            Patch(
                facecolor=_KIND_COLOUR[k],
                alpha=0.45 if k in ("activation", "gradient") else 0.95,
                label=k,
            )
            for k in order
        ] + tints
    handles = [
        Patch(facecolor=_JOB_COLOURS[j % len(_JOB_COLOURS)], label=f"job {j}")
        for j in sorted({e.job for e in events})
    ]
    handles.append(Patch(facecolor="#999999", alpha=0.5, label="forward (light)"))
    handles.append(Patch(facecolor="#999999", alpha=0.95, label="backward (full)"))
    if "recompute" in kinds:
        handles.append(Patch(facecolor="#999999", hatch="////", label="recompute"))
    handles += [Patch(facecolor=_KIND_COLOUR[k], label=k) for k in ("step", "switch") if k in kinds]
    return handles + tints


def plot_gantt(
    result: SimResult, path: str | os.PathLike[str], *, title: str | None = None
) -> None:
    """Write ``result``'s timeline (from ``simulate(..., record=True)``) as a PNG."""
    if not result.timeline:
        raise ValueError("plot_gantt: the result has no timeline; simulate with record=True")
    head = title or result.schedule
    plot_timeline(
        result.timeline,
        path,
        workers=result.num_stages,
        title=f"{head}: makespan {result.makespan:.4g} s, bubble ratio {result.bubble_ratio:.1%}",
    )


def plot_timeline(
    timeline: Sequence[Event], path: str | os.PathLike[str], *, workers: int, title: str
) -> None:
    """Write any timeline (simulated, or traced from a real run) as a PNG Gantt chart."""
    # Zero-length events (free transfers, free steps) have nothing to draw.
    events = [e for e in timeline if e.end > e.start]
    if not events:
        raise ValueError("plot_timeline: no events to draw")
    multi_job = len({e.job for e in events}) > 1
    chunks = max((e.chunk for e in events), default=0) + 1
    pos, labels = _rows(workers, events)
    height = 1.6 + 0.45 * len(labels)
    fig = Figure(figsize=(12.0, height), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    t0 = min((e.start for e in events), default=0.0)
    t1 = max((e.end for e in events), default=0.0)
    span = max(t1 - t0, 1e-12)
    points_per_s = 12.0 * 0.8 * 72.0 / span
    boxes: dict[tuple[tuple[str, int, int], Style], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        row = (e.where, e.worker, e.peer)
        boxes[(row, _style(e, multi_job))].append((e.start, e.duration))
        label = "" if e.microbatch < 0 or e.kind == "switch" else str(e.microbatch)
        if (
            label
            and e.where == "worker"
            and e.duration * points_per_s >= len(label) * _FONT * 0.7 + 3
        ):
            y, h = pos[row]
            ax.text(
                e.start + e.duration / 2,
                y + h / 2,
                label,
                ha="center",
                va="center",
                fontsize=_FONT,
                color="white",
            )
    for (row, (colour, alpha, hatch)), spans in boxes.items():
        y, h = pos[row]
        ax.broken_barh(
            spans,
            (y, h),
            facecolors=colour,
            alpha=alpha,
            hatch=hatch or None,
            edgecolor="white",
            linewidth=0.4,
        )
    ticks = [y + h / 2 for y, h in pos.values()]
    ax.set_yticks(ticks, labels)
    ax.invert_yaxis()
    ax.set_xlim(t0, t0 + span * 1.002)
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    ax.legend(
        handles=_legend(events, multi_job, chunks),
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
