"""What attaches to a stage worker's loop without living in it: telemetry, injected
interference, the fault drill and tracing.

A hook sees each boundary before the workers agree on the plan there
(`WorkerHook.before_boundary`), each window before it runs (`WorkerHook.before_window`)
and after (`WorkerHook.after_window`), may name iterations a window must not span
(`edges`), hears when the loop has run every iteration (`finish`) and is closed when the
loop ends, however it ends. `worker_hooks` builds the ones this worker's environment
asks for; the loop knows none of them by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from adaptipe.monitor.schema import LinkSample
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.iteration_stats import IterationStats
from adaptipe.runtime.records import per_iteration, stage_stats
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.stage import StageExecutor
from adaptipe.runtime.stagestate import Stage
from adaptipe.runtime.trace import TraceRecorder

__all__ = [
    "FAULT_ENV",
    "TELEMETRY_ENV",
    "TELEMETRY_INTERVAL_ENV",
    "BaseHook",
    "InjectedFault",
    "Window",
    "WorkerHook",
    "telemetry_target",
    "worker_hooks",
]

TELEMETRY_ENV = "ADAPTIPE_TELEMETRY"
"""The manager's collector address (ZeroMQ); workers publish telemetry there."""
TELEMETRY_INTERVAL_ENV = "ADAPTIPE_TELEMETRY_INTERVAL_S"

FAULT_ENV = "ADAPTIPE_INJECT_FAULT"
"""``STAGE:ITERATION``: that stage raises `InjectedFault` when it reaches that iteration.
A drill for fault handling (tests, rehearsals); scenario-driven injection builds on it."""


class InjectedFault(RuntimeError):
    """Raised on purpose by a worker named in ``ADAPTIPE_INJECT_FAULT``."""


@dataclass(frozen=True, slots=True)
class Window:
    """Iterations ``start`` to ``stop`` (exclusive) run as one instruction list."""

    start: int
    stop: int
    executor: StageExecutor
    begun: float  # time.time() when the window began
    ended: float = 0.0
    stats: IterationStats | None = None
    plan_version: int = 0  # the plan version the window ran

    @property
    def rounds(self) -> int:
        return self.stop - self.start


class WorkerHook(Protocol):
    def edges(self) -> set[int]: ...

    def before_boundary(self, iteration: int) -> None: ...

    def before_window(self, window: Window) -> None: ...

    def after_window(self, window: Window) -> None: ...

    def finish(self, total: int) -> None: ...

    def close(self) -> None: ...


class Link(Protocol):
    """What hooks use of the transport: its injected throttle and its link samples."""

    throttle: tuple[float, float] | None

    def link_samples(self) -> list[LinkSample]: ...


class BaseHook:
    """A hook that does nothing; the hooks below override what they need."""

    def edges(self) -> set[int]:
        return set()

    def before_boundary(self, iteration: int) -> None:
        return None

    def before_window(self, window: Window) -> None:
        return None

    def after_window(self, window: Window) -> None:
        return None

    def finish(self, total: int) -> None:
        return None

    def close(self) -> None:
        return None


class _FaultDrill(BaseHook):
    def __init__(self, stage: int, iteration: int, rank: int) -> None:
        self.stage, self.iteration, self.rank = stage, iteration, rank

    def edges(self) -> set[int]:
        return {self.iteration}

    def before_boundary(self, iteration: int) -> None:
        if iteration == self.iteration and self.stage == self.rank:
            raise InjectedFault(f"fault injected at iteration {iteration} ({FAULT_ENV})")


def _fault_drill(rank: int) -> _FaultDrill | None:
    """The drill ``ADAPTIPE_INJECT_FAULT`` asks for, if set."""
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    stage, sep, iteration = value.partition(":")
    if not sep or not stage.isdigit() or not iteration.isdigit():
        raise ValueError(f"{FAULT_ENV}={value!r} must look like STAGE:ITERATION (e.g. 1:5)")
    return _FaultDrill(int(stage), int(iteration), rank)


class _Interference(BaseHook):
    """Applies the slowdown and link throttle a scenario's control files say now."""

    def __init__(self, control_dir: str, rank: int, transport: Link) -> None:
        from adaptipe.inject.injectors import read_slowdowns, read_throttles

        self.read_slowdowns, self.read_throttles = read_slowdowns, read_throttles
        self.control_dir, self.rank, self.transport = control_dir, rank, transport

    def before_window(self, window: Window) -> None:
        window.executor.slowdown = self.read_slowdowns(self.control_dir).get(self.rank, 1.0)
        throttle = self.read_throttles(self.control_dir).get(self.rank)
        self.transport.throttle = (
            None if throttle is None else (throttle.extra_latency_s, throttle.bandwidth_Bps)
        )


class _Tracing(BaseHook):
    """Records the traced iterations' instructions and writes them when they are done."""

    def __init__(self, run: RunDir, config: RunConfig, rank: int) -> None:
        start = config.train.trace_start
        self.traced = range(start, start + config.train.trace_iterations)
        self.recorder: TraceRecorder | None = TraceRecorder(rank)
        self.path = run.trace_file(rank)

    def edges(self) -> set[int]:
        return {self.traced.start, self.traced.stop}

    def before_window(self, window: Window) -> None:
        window.executor.trace = self.recorder if window.start in self.traced else None

    def after_window(self, window: Window) -> None:
        if self.recorder is not None and window.stop == self.traced.stop:
            self.recorder.write(self.path, iterations=(self.traced.start, window.stop))
            self.recorder = None

    def finish(self, total: int) -> None:
        if self.recorder is not None and self.recorder.events:  # ended inside the range
            self.recorder.write(self.path, iterations=(self.traced.start, total))
        self.recorder = None


class _Telemetry(BaseHook):
    """Publishes each iteration's stage statistics and the links' samples (ZeroMQ).

    A stage on a GPU samples that GPU through NVML; a CPU stage samples its process,
    also on a machine with GPUs.
    """

    def __init__(
        self, target: Telemetry, run: RunDir, stage: Stage, interval_s: float, transport: Link
    ) -> None:
        from adaptipe.monitor.publisher import Publisher

        self.run, self.stage, self.transport = run, stage, transport
        address, curve = target
        self.publisher = Publisher(address, stage=stage.rank, curve=curve)
        interval = float(os.environ.get(TELEMETRY_INTERVAL_ENV, interval_s))
        device = stage.device
        self.publisher.start_sampler(
            interval_s=interval, device_index=device.index if device.type == "cuda" else None
        )

    def after_window(self, window: Window) -> None:
        assert window.stats is not None
        # The links first: the manager merges an iteration, and may decide on it, once
        # every stage's stats for it are in; sent after them, this window's link samples
        # could miss that decision (seen on the bed: a throttle showed a check later).
        for link in self.transport.link_samples():
            self.publisher.publish(link)
        mean = per_iteration(window.stats, window.rounds)
        for r in range(window.rounds):
            end_time = window.begun + (window.ended - window.begun) * (r + 1) / window.rounds
            self.publisher.publish(
                stage_stats(
                    self.run,
                    self.stage.rank,
                    window.start + r,
                    mean,
                    self.stage.chunks,
                    self.stage.device,
                    end_time,
                    plan_version=window.plan_version,
                )
            )

    def close(self) -> None:
        self.publisher.close(linger_s=0.5)


Telemetry = tuple[str, Any]
"""Where a worker publishes telemetry: the collector's address and the CURVE keys
(`adaptipe.monitor.publisher.CurveKeys`, None on loopback)."""


def telemetry_target(run: RunDir, config: RunConfig) -> Telemetry | None:
    """Where this worker should publish telemetry, else None.

    The manager of ``adaptipe train`` puts its collector's address in the workers'
    environment; workers started by torchrun find ``adaptipe manage``'s address and keys
    in the run directory (`adaptipe.runtime.managerinfo`). A scenario keeps the manager's
    collector on for its events even with ``[train] telemetry = false``; the stages then
    still publish nothing.
    """
    if not config.train.telemetry:
        return None
    address = os.environ.get(TELEMETRY_ENV)
    if address:
        return address, None
    from adaptipe.runtime.managerinfo import read_manager

    info = read_manager(run)
    if info is None or info.telemetry is None:
        return None
    return info.telemetry, info.curve()


def worker_hooks(run: RunDir, config: RunConfig, stage: Stage, transport: Link) -> list[WorkerHook]:
    """The hooks this worker's environment and config ask for."""
    hooks: list[WorkerHook] = []
    fault = _fault_drill(stage.rank)
    if fault is not None:
        hooks.append(fault)
    if config.train.trace_iterations:
        hooks.append(_Tracing(run, config, stage.rank))
    from adaptipe.inject.injectors import CONTROL_DIR_ENV

    control_dir = os.environ.get(CONTROL_DIR_ENV)
    if control_dir:
        from adaptipe.inject.inworker import WorkerMemory

        hooks.append(_Interference(control_dir, stage.rank, transport))
        hooks.append(WorkerMemory(control_dir, stage.rank, device=stage.device))
    target = telemetry_target(run, config)
    if target is not None:
        interval = config.train.telemetry_interval_s
        hooks.append(_Telemetry(target, run, stage, interval, transport))
    return hooks
