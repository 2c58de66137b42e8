"""``adaptipe monitor``: a live terminal view of a run's telemetry, one row per stage
and, below, one row per link the stages sent on (its bandwidth as the transport measured
it from the activations and gradients it carried).

Two sources:

* a run directory: ``telemetry.jsonl`` and ``metrics.jsonl`` are followed as they grow
  (only complete lines are read; a line still being written waits for the next look), or
  a finished run is played back in its own time with ``--replay``.
* an address, ``tcp://127.0.0.1:5555``: a standalone :class:`Collector` is *bound* there.
  Workers PUSH to one collector and a PULL socket cannot be shared, so this cannot attach
  to a run that ``adaptipe train`` launched (watch its run directory instead); it is for
  workers started by hand (torchrun) with ``ADAPTIPE_TELEMETRY`` pointing at the address.

A run directory is read with :mod:`adaptipe.monitor.runlog`, which checks every line;
bad lines are skipped and counted under their reason, and the count is shown.
:func:`render` turns a :class:`MonitorState` into the stage table, :func:`render_links`
into the link table, and :func:`view` puts them together; none of them does I/O, so they
are tested on their own. :func:`watch` shows the view until the run ends.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from adaptipe.errors import PlanError
from adaptipe.monitor.runlog import (
    SUMMARY,
    TELEMETRY,
    RunFollower,
    check_run_dir,
    load_run,
    skipped_note,
)
from adaptipe.monitor.schema import DeviceSample, Event, LinkSample, Record, StageStats
from adaptipe.units import format_bytes

__all__ = [
    "MonitorState",
    "render",
    "render_links",
    "view",
    "watch",
]


@dataclass(slots=True)
class MonitorState:
    """What the view shows: the last ``window`` iterations per stage and recent events."""

    window: int = 20
    source: str = ""
    max_events: int = 5
    run_id: str | None = None
    t0: float | None = None
    stats: dict[int, deque[StageStats]] = field(default_factory=dict)
    devices: dict[int, DeviceSample] = field(default_factory=dict)
    links: dict[tuple[int, int], deque[LinkSample]] = field(default_factory=dict)
    events: deque[Event] = field(default_factory=deque)
    metrics: deque[dict[str, Any]] = field(default_factory=deque)
    skipped: str = ""  # a note on skipped lines or rejected frames
    status: str = ""  # e.g. "finished", "waiting for workers"

    def add(self, record: Record) -> None:
        self.t0 = record.time_s if self.t0 is None else min(self.t0, record.time_s)
        match record:
            case StageStats():
                self.run_id = record.run_id
                ring = self.stats.setdefault(record.stage, deque(maxlen=self.window))
                ring.append(record)
            case DeviceSample():
                self.devices[record.stage] = record
            case Event():
                self.events.append(record)
                while len(self.events) > self.max_events:
                    self.events.popleft()
            case LinkSample():
                ring_l = self.links.setdefault((record.src, record.dst), deque(maxlen=self.window))
                ring_l.append(record)

    def add_metrics(self, rec: dict[str, Any]) -> None:
        """Keep ``rec``; a record for an iteration already shown replaces it and what came
        after (a resumed run trains them again; its metrics file is re-read)."""
        it = rec.get("iteration")
        while isinstance(it, int) and self.metrics and self.metrics[-1].get("iteration", -1) >= it:
            self.metrics.pop()
        self.metrics.append(rec)
        while len(self.metrics) > self.window:
            self.metrics.popleft()

    def header(self) -> str:
        parts = [f"run {self.run_id or '?'}"]
        latest = [ring[-1] for ring in self.stats.values() if ring]
        iteration: int | None = max((s.iteration for s in latest), default=None)
        loss = next((s.loss for s in latest if s.loss is not None), None)
        if self.metrics:
            iteration = self.metrics[-1]["iteration"]
            loss = _num(self.metrics[-1].get("loss"))
        parts.append(f"iteration {iteration if iteration is not None else '-'}")
        parts.append(f"loss {loss:.4f}" if loss is not None else "loss -")
        # samples over seconds of the window: sum(sps_i * t_i) / sum(t_i)
        timed = [(_num(m.get("samples_per_s")), _num(m.get("iteration_s"))) for m in self.metrics]
        pairs = [(sps, t) for sps, t in timed if sps is not None and t is not None and t > 0]
        if pairs:
            parts.append(
                f"{sum(s * t for s, t in pairs) / sum(t for _, t in pairs):,.0f} samples/s"
            )
        elif latest:  # an address gives no batch size: iterations per second instead
            its = [s.iteration_s for s in self.stats[max(self.stats)] if s.iteration_s > 0]
            parts.append(f"{1 / statistics.fmean(its):.1f} it/s" if its else "- it/s")
        if self.status:
            parts.append(self.status)
        return "  ·  ".join(parts)


def _num(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None


def _device_text(sample: DeviceSample | None) -> str:
    if sample is None:
        return "-"
    f = sample.fields
    parts = []
    if "util_pct" in f:
        parts.append(f"{'gpu' if sample.source == 'nvml' else 'cpu'} {f['util_pct']:.0f}%")
    if "run_queue" in f:
        cpus = f"/{f['num_cpus']:.0f}" if "num_cpus" in f else ""
        parts.append(f"rq {f['run_queue']:.0f}{cpus}")
    if "temperature_c" in f:
        parts.append(f"{f['temperature_c']:.0f}°C")
    return " ".join(parts) or sample.source


def _event_text(event: Event, t0: float | None) -> str:
    when = f"+{event.time_s - t0:.1f} s" if t0 is not None else f"{event.time_s:.1f}"
    detail = dict(event.detail)
    what = " ".join(str(x) for x in (detail.pop("injector", None), detail.pop("origin", None)) if x)
    where = "" if event.stage is None else f"stage {event.stage} "
    rest = " ".join(f"{k}={v}" for k, v in detail.items())
    return f"{when:>10}  {event.kind:<16} {where}{what} {rest}".rstrip()


def render(state: MonitorState) -> Table:
    """The view: header as title, one row per stage, recent events as caption."""
    table = Table(
        title=state.header(),
        caption_justify="left",
        header_style="bold",
        expand=False,
    )
    for name in ("stage", "iter"):
        table.add_column(name, justify="right")
    for name in ("compute ms", "wait ms", "comm ms", "compute %", "in flight"):
        table.add_column(name, justify="right")
    table.add_column("memory", justify="right")
    table.add_column("device")
    for stage in sorted(set(state.stats) | set(state.devices)):
        ring = state.stats.get(stage)
        device = _device_text(state.devices.get(stage))
        if not ring:
            table.add_row(str(stage), "-", "-", "-", "-", "-", "-", "-", device)
            continue
        compute, wait, comm = (
            statistics.fmean(getattr(s, name) for s in ring)
            for name in ("compute_s", "wait_s", "comm_s")
        )
        total = statistics.fmean(s.iteration_s for s in ring) or compute + wait + comm
        last = ring[-1]
        table.add_row(
            str(stage),
            str(last.iteration),
            f"{compute * 1e3:.2f}",
            f"{wait * 1e3:.2f}",
            f"{comm * 1e3:.2f}",
            f"{100 * compute / total:.0f}%" if total > 0 else "-",
            str(last.in_flight),
            format_bytes(last.memory_allocated_bytes),
            device,
        )
    lines = [f"means over the last {state.window} iterations; source {state.source}"]
    if state.events:
        lines.append("latest events:")
        lines += ["  " + _event_text(e, state.t0) for e in state.events]
    if state.skipped:
        lines.append(state.skipped)
    # one line per entry, cut at the table's width rather than wrapped
    table.caption = Text("\n".join(lines), style="dim", no_wrap=True, overflow="ellipsis")
    return table


def render_links(state: MonitorState) -> Table | None:
    """One row per link (sender -> receiver), or None before any link was measured.

    ``reported`` is the sender's bandwidth estimate (`adaptipe.monitor.bandwidth.link_bandwidth`); ``window mean`` is all bytes over all
    busy seconds of the last ``window`` iterations; ``busy`` is the time per iteration
    the link had a send in flight (the union, not the sum, of its sends' times), and
    ``busy %`` that as a share of the sending stage's iteration.
    """
    if not state.links:
        return None
    table = Table(title="links: bandwidth of the pipeline's own sends", header_style="bold")
    table.add_column("link", justify="right")
    for name in ("reported", "window mean", "bytes/iter", "busy ms", "busy %"):
        table.add_column(name, justify="right")
    for (src, dst), ring in sorted(state.links.items()):
        nbytes = sum(s.nbytes for s in ring)
        busy = sum(s.seconds for s in ring)
        its = [s.iteration_s for s in state.stats.get(src, ()) if s.iteration_s > 0]
        share = busy / len(ring) / statistics.fmean(its) if its else None
        table.add_row(
            f"{src} → {dst}",
            format_bytes(ring[-1].bandwidth_Bps) + "/s",
            format_bytes(nbytes / busy) + "/s" if busy > 0 else "-",
            format_bytes(nbytes / len(ring)),
            f"{busy / len(ring) * 1e3:.2f}",
            f"{100 * share:.0f}%" if share is not None else "-",
        )
    return table


def view(state: MonitorState) -> RenderableType:
    """The whole frame: the stage table, the link table under it, then the notes."""
    stages = render(state)
    links = render_links(state)
    if links is None:
        return stages
    links.caption, stages.caption = stages.caption, None
    links.caption_justify = "left"
    return Group(stages, links)


# --------------------------------------------------------------------------- the loops
def watch(
    source: str | Path,
    *,
    refresh_s: float = 0.5,
    window: int = 20,
    once: bool = False,
    replay: bool = False,
    speed: float = 1.0,
) -> None:
    """Show the view of ``source`` until the run finishes (run directory) or Ctrl-C.

    Args:
        source: a run directory, or a ``tcp://host:port`` address to bind a collector at.
        refresh_s: seconds between frames.
        window: iterations averaged per stage.
        once: print one frame and return.
        replay: play a finished run (a run directory) back in its own time.
        speed: the replay's speed-up.
    """
    for name, value in (("refresh_s", refresh_s), ("speed", speed)):
        if not value > 0:
            raise PlanError(f"{name} must be > 0 (got {value})")
    if window < 1:
        raise PlanError(f"window must be >= 1 (got {window})")
    console = Console(width=None if sys.stdout.isatty() else 120)
    state = MonitorState(window=window, source=str(source))
    if "://" in str(source) and replay:
        raise PlanError("replay needs a run directory, not an address")
    with contextlib.suppress(KeyboardInterrupt):  # the usual way to leave a live view
        if "://" in str(source):
            _watch_address(console, state, str(source), refresh_s=refresh_s, once=once)
        elif replay:
            _replay(console, state, Path(source), refresh_s=refresh_s, once=once, speed=speed)
        else:
            _follow(console, state, Path(source), refresh_s=refresh_s, once=once)


def _follow(
    console: Console, state: MonitorState, root: Path, *, refresh_s: float, once: bool
) -> None:
    check_run_dir(root)
    summary_mtime = _mtime(root / SUMMARY)
    finished = summary_mtime is not None and summary_mtime >= (_mtime(root / TELEMETRY) or 0)
    if once or finished:
        log = load_run(root, final=finished)  # raises naming a missing or empty file
        for record in log.records:
            state.add(record)
        for rec in log.metrics:
            state.add_metrics(rec)
        state.skipped = skipped_note(log.skipped)
        state.status = "finished" if finished else ""
        console.print(view(state))
        return
    if not (root / TELEMETRY).exists():
        load_run(root)  # raises the error that names the missing file
    follower = RunFollower(root)

    def step(final: bool) -> None:
        records, metrics = follower.poll(final=final)
        for record in records:
            state.add(record)
        for rec in metrics:
            state.add_metrics(rec)
        state.skipped = follower.skipped_note()

    from rich.live import Live

    step(final=False)
    with Live(view(state), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(refresh_s)
            done = _mtime(root / SUMMARY) != summary_mtime
            step(final=done)
            state.status = "finished" if done else ""
            live.update(view(state), refresh=True)
            if done:
                return


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def _replay(
    console: Console,
    state: MonitorState,
    root: Path,
    *,
    refresh_s: float,
    once: bool,
    speed: float,
) -> None:
    log = load_run(root)
    state.skipped = skipped_note(log.skipped)
    # A metrics record belongs at the time its iteration's last stage reported.
    ends: dict[int, float] = {}
    for r in log.records:
        if isinstance(r, StageStats):
            ends[r.iteration] = max(ends.get(r.iteration, 0.0), r.time_s)
    last = max((r.time_s for r in log.records), default=0.0)
    timeline: list[tuple[float, int, Record | dict[str, Any]]] = [
        (r.time_s, i, r) for i, r in enumerate(log.records)
    ]
    timeline += [
        (ends.get(m["iteration"], last), len(timeline) + i, m) for i, m in enumerate(log.metrics)
    ]
    timeline.sort(key=lambda item: (item[0], item[1]))

    fed = 0

    def feed(upto: float) -> None:
        nonlocal fed
        while fed < len(timeline) and timeline[fed][0] <= upto:
            item = timeline[fed][2]
            fed += 1
            if isinstance(item, dict):
                state.add_metrics(item)
            else:
                state.add(item)

    if once:
        feed(float("inf"))
        console.print(view(state))
        return
    from rich.live import Live

    clock = timeline[0][0]
    with Live(view(state), console=console, auto_refresh=False) as live:
        while fed < len(timeline):
            clock += refresh_s * speed
            feed(clock)
            left = fed < len(timeline)
            state.status = f"replay at {speed:g}x" if left else "replay finished"
            live.update(view(state), refresh=True)
            if left:
                time.sleep(refresh_s)


def _watch_address(
    console: Console, state: MonitorState, address: str, *, refresh_s: float, once: bool
) -> None:
    from adaptipe.monitor.collector import Collector

    def frame(collector: Collector) -> RenderableType:
        fresh = MonitorState(window=state.window, source=state.source)
        for record in sorted(collector.records(), key=lambda r: r.time_s):
            fresh.add(record)
        rejected = {k: v for k, v in collector.rejected.items() if v}
        if rejected:
            fresh.skipped = "rejected frames: " + ", ".join(f"{v} {k}" for k, v in rejected.items())
        fresh.status = "" if collector.accepted else "waiting for workers"
        return view(fresh)

    with Collector(bind=address, history=max(state.window, 256)) as collector:
        collector.start()
        console.print(f"collector bound at {collector.address}; set ADAPTIPE_TELEMETRY to it")
        if once:
            time.sleep(refresh_s)
            console.print(frame(collector))
            return
        from rich.live import Live

        with Live(frame(collector), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(refresh_s)
                live.update(frame(collector), refresh=True)
