"""What a simulation returns: `SimResult` (one run, with timeline) and `IterationsResult`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptipe.serial import check_kind, get_float, get_int, get_list, get_str

__all__ = ["RESULT_VERSION", "Event", "IterationsResult", "SimResult"]

RESULT_VERSION = 1

FloatArray = npt.NDArray[np.float64]

EVENT_KINDS = ("forward", "backward", "recompute", "step", "switch", "activation", "gradient")
"""Worker events: forward, backward, recompute, step (optimizer), switch (job change).
Link events: activation and gradient transfers."""


def _num(v: float) -> float | None:
    """JSON has no infinity: write non-finite numbers as null."""
    return v if math.isfinite(v) else None


def _unnum(v: Any) -> float:
    return math.inf if v is None else float(v)


@dataclass(frozen=True, slots=True)
class Event:
    """One box of the timeline.

    ``where`` is ``"worker"`` (on ``worker``; ``peer`` is -1) or ``"link"`` (the
    directed link ``worker -> peer``). Steps have ``microbatch`` and ``chunk`` -1.
    """

    where: str
    worker: int
    peer: int
    kind: str
    job: int
    microbatch: int
    chunk: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_json(self) -> list[Any]:
        return [
            self.where,
            self.worker,
            self.peer,
            self.kind,
            self.job,
            self.microbatch,
            self.chunk,
            self.start,
            self.end,
        ]

    @classmethod
    def from_json(cls, raw: Any) -> Event:
        where, worker, peer, kind, job, mb, chunk, start, end = raw
        return cls(
            where=str(where),
            worker=int(worker),
            peer=int(peer),
            kind=str(kind),
            job=int(job),
            microbatch=int(mb),
            chunk=int(chunk),
            start=float(start),
            end=float(end),
        )


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """One simulated run of a schedule.

    Attributes:
        schedule: the schedule's name; num_stages/num_microbatches/num_jobs: its shape.
        makespan: last worker finish minus earliest worker start.
        busy_s: per worker, seconds of compute and optimizer work (switches excluded).
        bubble_ratio: ``1 - sum(busy) / (S * makespan)``.
        throughput: micro-batches (over all jobs) per second; samples_per_s likewise.
        peak_activation_bytes: per worker, the most activation stash held at once.
        peak_weight_bytes: per worker, parameters + optimizer state of its chunks (per
            job) plus one parameter copy per extra live weight version.
        start_s, end_s: per worker start and finish time.
        link_free_s: per directed link used, when it finished its last transfer.
        timeline: the events, in execution order (empty unless recorded).
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    num_jobs: int
    makespan: float
    busy_s: tuple[float, ...]
    bubble_ratio: float
    throughput: float
    samples_per_s: float
    peak_activation_bytes: tuple[int, ...]
    peak_weight_bytes: tuple[int, ...]
    start_s: tuple[float, ...]
    end_s: tuple[float, ...]
    link_free_s: dict[tuple[int, int], float] = field(default_factory=dict)
    timeline: tuple[Event, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "sim_result",
            "version": RESULT_VERSION,
            "schedule": self.schedule,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "num_jobs": self.num_jobs,
            "makespan": self.makespan,
            "busy_s": list(self.busy_s),
            "bubble_ratio": self.bubble_ratio,
            "throughput": _num(self.throughput),
            "samples_per_s": _num(self.samples_per_s),
            "peak_activation_bytes": list(self.peak_activation_bytes),
            "peak_weight_bytes": list(self.peak_weight_bytes),
            "start_s": list(self.start_s),
            "end_s": list(self.end_s),
            "link_free_s": [[s, d, t] for (s, d), t in self.link_free_s.items()],
            "timeline": [e.to_json() for e in self.timeline],
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "sim_result") -> SimResult:
        check_kind(data, kind="sim_result", version=RESULT_VERSION, source=source)

        def floats(key: str) -> tuple[float, ...]:
            return tuple(float(v) for v in get_list(data, key, source=source))

        return cls(
            schedule=get_str(data, "schedule", source=source),
            num_stages=get_int(data, "num_stages", source=source, minimum=1),
            num_microbatches=get_int(data, "num_microbatches", source=source, minimum=1),
            num_jobs=get_int(data, "num_jobs", source=source, minimum=1),
            makespan=get_float(data, "makespan", source=source, minimum=0.0),
            busy_s=floats("busy_s"),
            bubble_ratio=get_float(data, "bubble_ratio", source=source),
            throughput=_unnum(data.get("throughput")),
            samples_per_s=_unnum(data.get("samples_per_s")),
            peak_activation_bytes=tuple(
                int(v) for v in get_list(data, "peak_activation_bytes", source=source)
            ),
            peak_weight_bytes=tuple(
                int(v) for v in get_list(data, "peak_weight_bytes", source=source)
            ),
            start_s=floats("start_s"),
            end_s=floats("end_s"),
            link_free_s={
                (int(s), int(d)): float(t)
                for s, d, t in get_list(data, "link_free_s", source=source, default=[])
            },
            timeline=tuple(
                Event.from_json(e) for e in get_list(data, "timeline", source=source, default=[])
            ),
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class IterationsResult:
    """Many back-to-back iterations of one schedule (see `simulate_iterations`).

    Attributes:
        iteration_s: per iteration, its finish (last worker) minus the previous finish.
        end_s: per iteration, the time its last worker finished (cumulative).
        worker_end_s: ``(iterations, S)`` per-worker finish times.
        total_s: finish time of the last iteration.
        throughput: micro-batches (all jobs) per second over the whole run.
    """

    schedule: str
    num_stages: int
    microbatches_per_iteration: int
    samples_per_microbatch: int
    iteration_s: FloatArray
    end_s: FloatArray
    worker_end_s: FloatArray

    @property
    def iterations(self) -> int:
        return int(self.iteration_s.shape[0])

    @property
    def total_s(self) -> float:
        return float(self.end_s[-1])

    @property
    def mean_iteration_s(self) -> float:
        return self.total_s / self.iterations

    @property
    def throughput(self) -> float:
        t = self.total_s
        return self.iterations * self.microbatches_per_iteration / t if t > 0 else math.inf

    @property
    def samples_per_s(self) -> float:
        return self.throughput * self.samples_per_microbatch

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "sim_iterations",
            "version": RESULT_VERSION,
            "schedule": self.schedule,
            "num_stages": self.num_stages,
            "iterations": self.iterations,
            "microbatches_per_iteration": self.microbatches_per_iteration,
            "total_s": self.total_s,
            "throughput": _num(self.throughput),
            "samples_per_s": _num(self.samples_per_s),
            "iteration_s": self.iteration_s.tolist(),
        }
