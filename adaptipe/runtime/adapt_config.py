"""``[adapt]``: how a run takes on a new partition, and scripted re-partitions.

::

    [adapt]
    method = "live"          # live: layers move between the running workers at one
                             # boundary (stop-and-copy, `adaptipe.runtime.migration`);
                             # checkpoint: through a checkpoint written there;
                             # restart: checkpoint, stop the workers, start them again
                             # on the new partition (the field's baseline)
    timeout_s = 60           # a migration message later than this fails the migration
                             # (a streamed one: the whole move, first boundary to switch)
    transfer = "auto"        # live moves: stop_and_copy (the state crosses at one
                             # boundary), streamed (base copy + gradient log while
                             # training goes on, `adaptipe.runtime.streamed`), auto (the
                             # cost model's crossover, `adaptipe.sim.migration`)
    prioritise = true        # streamed state yields to activations and gradients
    chunk_bytes = 262144     # streamed state travels in chunks of this size
    pace_iterations = 3      # a streamed move's base copy is paced to take about this
                             # many iterations (0: as fast as the stage's sends let it)
    streamer = "auto"        # who does a streamed move's work: thread (threads of the
                             # stage process), process (the worker's helper process,
                             # `adaptipe.runtime.courier`: off the stage's GIL), auto
                             # (thread, until process is measured cheaper somewhere)

    controller = "threshold" # none (default) | threshold | always_best | straggler | stale
                             # | ppo (the shipped learned switch policy): the manager
                             # re-partitions when it says so (`adaptipe.runtime.adapt_loop`)
    check_every = 4          # iterations between the controller's checks
    window = 8               # iterations each check observes
    margin = 0.20            # threshold: in force over best predicted, beyond 1
    patience = 3             # threshold: consecutive checks over the margin (K)
    cooldown = 20            # iterations after a move before the next (every controller)
    max_per_hour = 6         # threshold: at most this many moves an hour
    horizon = 100            # threshold: iterations a move's predicted gain counts over
    baseline = "profile"     # what a stage's slowdown is measured against: the run's
                             # profile, or each layer as this run measured it in its
                             # second window (`adaptipe.controllers.live`); a run with no
                             # profile measures it either way
    recall = true            # threshold, ppo: rank a partition the run has held at what
                             # it measured there (its model's error remembered,
                             # `adaptipe.controllers.recall`)
    revisit_checks = 50      # with recall: for this many checks after it was left, a
                             # partition ranks no better than it measured then (0: off)
    unchanged = 0.05         # threshold, ppo: a check whose readings are each within
                             # this fraction of those of the last check the controller
                             # settled on keeps without asking it, at most `window`
                             # checks in a row (`adaptipe.controllers.unchanged`; 0: off)
    calibrate = true         # divide a stage's readings by what its place costs, measured
                             # across the move that put its layers there
                             # (`adaptipe.controllers.positions`)
    dry_run = false          # log the decisions, never act on them
    decide_timeout_s = 5.0   # a controller call longer than this is logged as timed out
    online = false           # ppo: fine-tune the speed predictor on the run's own
                             # measurements (`adaptipe.controllers.online`), on a
                             # low-priority thread between decisions
    online_budget_s = 0.2    # its CPU seconds per round (one round per decision at most)

    [[adapt.repartition]]    # scripted: from iteration 10 on, layers 0-2 | 3-7
    iteration = 10
    bounds = [0, 3, 8]

A scripted re-partition is committed as a plan version before the workers start, and
comes into force exactly at its iteration (windows end there). A controller needs
telemetry (``[train].telemetry``, on by default): one with telemetry turned off is
refused (`adaptipe.runtime.config`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.serial import get_bool, get_float, get_int, get_list, get_str

__all__ = [
    "BASELINES",
    "CONTROLLERS",
    "METHODS",
    "STREAMERS",
    "TRANSFERS",
    "AdaptSection",
    "Repartition",
    "parse_adapt",
]

METHODS = ("live", "checkpoint", "restart")
TRANSFERS = ("auto", "stop_and_copy", "streamed")
STREAMERS = ("auto", "thread", "process")
CONTROLLERS = ("none", "threshold", "always_best", "straggler", "stale", "ppo")
BASELINES = ("profile", "measured")
# [adapt] integer fields of the controller loop: name -> (default, minimum)
_INTS = {
    "check_every": (4, 1),
    "window": (8, 1),
    "patience": (3, 1),
    "cooldown": (20, 0),
    "max_per_hour": (6, 1),
    "horizon": (100, 1),
    "revisit_checks": (50, 0),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Repartition:
    """From ``iteration`` on, the stages hold layers ``bounds[s]`` to ``bounds[s + 1]``."""

    iteration: int
    bounds: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptSection:
    method: str = "live"
    timeout_s: float = 60.0
    transfer: str = "auto"
    prioritise: bool = True
    chunk_bytes: int = 256 << 10
    pace_iterations: int = 3
    streamer: str = "auto"
    repartition: tuple[Repartition, ...] = field(default_factory=tuple)
    controller: str = "none"
    check_every: int = 4
    window: int = 8
    margin: float = 0.20
    unchanged: float = 0.05
    patience: int = 3
    cooldown: int = 20
    max_per_hour: int = 6
    horizon: int = 100
    revisit_checks: int = 50
    baseline: str = "profile"
    recall: bool = True
    calibrate: bool = True
    dry_run: bool = False
    decide_timeout_s: float = 5.0
    online: bool = False
    online_budget_s: float = 0.2

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "timeout_s": self.timeout_s,
            "transfer": self.transfer,
            "prioritise": self.prioritise,
            "chunk_bytes": self.chunk_bytes,
            "pace_iterations": self.pace_iterations,
            "streamer": self.streamer,
            "controller": self.controller,
            **{name: getattr(self, name) for name in _INTS},
            "margin": self.margin,
            "unchanged": self.unchanged,
            "baseline": self.baseline,
            "recall": self.recall,
            "calibrate": self.calibrate,
            "dry_run": self.dry_run,
            "decide_timeout_s": self.decide_timeout_s,
            "online": self.online,
            "online_budget_s": self.online_budget_s,
            "repartition": [
                {"iteration": r.iteration, "bounds": list(r.bounds)} for r in self.repartition
            ],
        }


def parse_adapt(
    raw: Any, *, source: str, num_layers: int, stages: int, iterations: int | None
) -> AdaptSection:
    """Read ``[adapt]``; every error names the file, the field and what is allowed."""
    if not isinstance(raw, Mapping):
        raise PlanError(f"{source}: [adapt] must be a table (got {type(raw).__name__})")
    allowed = (
        "method",
        "timeout_s",
        "transfer",
        "prioritise",
        "chunk_bytes",
        "pace_iterations",
        "streamer",
        "repartition",
        "controller",
        *_INTS,
        "margin",
        "unchanged",
        "baseline",
        "recall",
        "calibrate",
        "dry_run",
        "decide_timeout_s",
        "online",
        "online_budget_s",
    )
    for key in raw:
        if key not in allowed:
            raise PlanError(
                f"{source}: unknown field [adapt].{key} (allowed: {', '.join(allowed)})"
            )
    method = get_str(
        raw, "method", source=source, prefix="[adapt].", choices=METHODS, default="live"
    )
    timeout = get_float(raw, "timeout_s", source=source, prefix="[adapt].", default=60.0)
    if timeout <= 0:
        raise PlanError(f"{source}: [adapt].timeout_s must be > 0 (got {timeout:g})")
    transfer = get_str(
        raw, "transfer", source=source, prefix="[adapt].", choices=TRANSFERS, default="auto"
    )
    prioritise = get_bool(raw, "prioritise", source=source, prefix="[adapt].", default=True)
    chunk = get_int(
        raw, "chunk_bytes", source=source, prefix="[adapt].", minimum=4096, default=256 << 10
    )
    pace = get_int(raw, "pace_iterations", source=source, prefix="[adapt].", minimum=0, default=3)
    streamer = get_str(
        raw, "streamer", source=source, prefix="[adapt].", choices=STREAMERS, default="auto"
    )
    entries = get_list(raw, "repartition", source=source, prefix="[adapt].", default=[])
    out: list[Repartition] = []
    for n, entry in enumerate(entries):
        where = f"[[adapt.repartition]] #{n + 1}"
        out.append(_repartition(entry, source, where, num_layers, stages, iterations))
    its = [r.iteration for r in out]
    if its != sorted(set(its)):
        raise PlanError(f"{source}: [[adapt.repartition]] iterations must increase (got {its})")
    return AdaptSection(
        method=method,
        timeout_s=timeout,
        transfer=transfer,
        prioritise=prioritise,
        chunk_bytes=chunk,
        pace_iterations=pace,
        streamer=streamer,
        repartition=tuple(out),
        **_controller_fields(raw, source),
    )


def _controller_fields(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The controller loop's fields of ``[adapt]``, checked."""
    p = "[adapt]."
    out: dict[str, Any] = {
        "controller": get_str(
            raw, "controller", source=source, prefix=p, choices=CONTROLLERS, default="none"
        ),
        "dry_run": get_bool(raw, "dry_run", source=source, prefix=p, default=False),
        "recall": get_bool(raw, "recall", source=source, prefix=p, default=True),
        "calibrate": get_bool(raw, "calibrate", source=source, prefix=p, default=True),
        "baseline": get_str(
            raw, "baseline", source=source, prefix=p, choices=BASELINES, default="profile"
        ),
    }
    for name, (default, low) in _INTS.items():
        out[name] = get_int(raw, name, source=source, prefix=p, minimum=low, default=default)
    margin = get_float(raw, "margin", source=source, prefix=p, default=0.20)
    if not 0 <= margin < 10:
        raise PlanError(f"{source}: [adapt].margin must be >= 0 and < 10 (got {margin:g})")
    unchanged = get_float(raw, "unchanged", source=source, prefix=p, default=0.05)
    if not 0 <= unchanged < 1:
        raise PlanError(f"{source}: [adapt].unchanged must be >= 0 and < 1 (got {unchanged:g})")
    wait = get_float(raw, "decide_timeout_s", source=source, prefix=p, default=5.0)
    if not 0 < wait <= 3600:
        raise PlanError(
            f"{source}: [adapt].decide_timeout_s must be > 0 and <= 3600 seconds (got {wait:g})"
        )
    online = get_bool(raw, "online", source=source, prefix=p, default=False)
    budget = get_float(raw, "online_budget_s", source=source, prefix=p, default=0.2)
    if not 0 < budget <= 60:
        raise PlanError(
            f"{source}: [adapt].online_budget_s must be > 0 and <= 60 CPU seconds a round "
            f"(got {budget:g})"
        )
    return {
        **out,
        "margin": margin,
        "unchanged": unchanged,
        "decide_timeout_s": wait,
        "online": online,
        "online_budget_s": budget,
    }


def _repartition(
    entry: Any, source: str, where: str, num_layers: int, stages: int, iterations: int | None
) -> Repartition:
    if not isinstance(entry, Mapping):
        raise PlanError(f"{source}: {where} must be a table with iteration and bounds")
    for key in entry:
        if key not in ("iteration", "bounds"):
            raise PlanError(f"{source}: unknown field {where}.{key} (allowed: iteration, bounds)")
    iteration = get_int(entry, "iteration", source=source, prefix=f"{where}.", minimum=1)
    if iterations is not None and iteration >= iterations:
        raise PlanError(
            f"{source}: {where}.iteration = {iteration} is not before the last iteration "
            f"(allowed: 1..{iterations - 1} for [train].iterations = {iterations})"
        )
    bounds = get_list(entry, "bounds", source=source, prefix=f"{where}.")
    ok = (
        all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
        and len(bounds) == stages + 1
        and bounds[:1] == [0]
        and bounds[-1:] == [num_layers]
        and all(a < b for a, b in itertools.pairwise(bounds))
    )
    if not ok:
        raise PlanError(
            f"{source}: {where}.bounds = {bounds!r} is not a partition of this model: "
            f"{stages + 1} increasing layer indices from 0 to {num_layers} (one stage per "
            f"[pipeline] virtual stage, each at least one layer)"
        )
    return Repartition(iteration=iteration, bounds=tuple(bounds))
