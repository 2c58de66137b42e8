"""A trace as an injection scenario: replay its conditions on a real run.

`trace_to_scenario` writes the TOML of a scenario file (`adaptipe.inject.scenario`),
keyed by iterations, so ``adaptipe train --inject`` puts a real pipeline under what
the trace describes:

- a run of consecutive iterations at one slowdown above 1 on a stage is one
  ``slowdown`` injection (``at_iteration``, ``iterations``, ``stage``, ``factor``);
  slowdowns below 1 cannot be injected and replay as 1;
- a run at one limited bandwidth on link ``s -> s + 1`` is one ``link_throttle`` on stage
  ``s`` (every message stage ``s`` sends, so its gradients back to ``s - 1`` share the
  limit), or with ``bed`` a ``link_shape`` of host ``s`` on that namespace-host bed
  (stage ``s`` on host ``s``); unlimited stretches inject nothing;
- a ``preempt`` event is a ``kill`` of its stage with ``p = 1`` at that iteration (its
  ``stall_s`` is what the restart takes, not injected).

``resolution`` (a relative step, 0: exact) rounds slowdowns to multiples of it and
bandwidths to powers of ``1 + resolution`` first, so a recorded (noisy) trace gives a
scenario of a few injections rather than one per iteration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence

from adaptipe.envs.trace import Trace
from adaptipe.errors import PlanError
from adaptipe.netbed.bed import check_prefix

__all__ = ["trace_to_scenario"]


def trace_to_scenario(trace: Trace, *, bed: str | None = None, resolution: float = 0.0) -> str:
    """The scenario file's text for ``trace`` (see the module doc)."""
    if not (math.isfinite(resolution) and resolution >= 0):
        raise PlanError(f"resolution must be a number >= 0 (got {resolution!r})")
    if bed is not None:
        check_prefix(bed)
    entries: list[tuple[int, int, str]] = []  # (iteration, order, TOML table)
    slow = trace.slowdowns()
    for s in range(trace.stages):
        column = [_step(max(v, 1.0), resolution) for v in slow[:, s].tolist()]
        for start, length, factor in _runs(column):
            if factor > 1.0:
                body = f"stage = {s}\nfactor = {factor!r}"
                entries.append((start, 0, _table("slowdown", start, length, body)))
    bandwidth = trace.bandwidths()
    for link in range(trace.stages - 1):
        column = [_step_bw(v, resolution) for v in bandwidth[:, link].tolist()]
        for start, length, bps in _runs(column):
            if math.isfinite(bps):
                rate = json.dumps(f"{bps / 1e6:.6g}MB/s")
                body = (
                    f"host = {link}\nrate = {rate}"
                    if bed is not None
                    else f"stage = {link}\nbandwidth = {rate}"
                )
                kind = "link_shape" if bed is not None else "link_throttle"
                entries.append((start, 1, _table(kind, start, length, body)))
    for i, row in enumerate(trace.rows):
        for e in row.events:
            if e["kind"] == "preempt" and e.get("stage") is not None:
                body = f"stage = {e['stage']}\np = 1.0"
                entries.append((i, 2, f'[[inject]]\nkind = "kill"\nat_iteration = {i}\n{body}\n'))
    head = [
        f"# Replays trace {trace.family!r} (seed {trace.seed}, {trace.stages} stages, "
        f"{trace.iterations} iterations; sha256 {trace.digest()[:16]})",
        "# written by adaptipe.envs.replay.trace_to_scenario; iteration-keyed",
    ]
    if bed is not None:
        head.append(f"bed = {json.dumps(bed)}")
    tables = [text for _, _, text in sorted(entries, key=lambda e: (e[0], e[1]))]
    return "\n".join(head) + "\n\n" + "\n".join(tables)


def _table(kind: str, start: int, length: int, body: str) -> str:
    return f'[[inject]]\nkind = "{kind}"\nat_iteration = {start}\niterations = {length}\n{body}\n'


def _runs(values: Sequence[float]) -> Iterator[tuple[int, int, float]]:
    """``(start, length, value)`` of each stretch of equal consecutive values."""
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            yield start, i - start, values[start]
            start = i


def _step(value: float, resolution: float) -> float:
    return round(round(value / resolution) * resolution, 6) if resolution else value


def _step_bw(value: float, resolution: float) -> float:
    if not resolution or not math.isfinite(value):
        return value
    base = math.log1p(resolution)
    return float(f"{math.exp(round(math.log(value) / base) * base):.6g}")
