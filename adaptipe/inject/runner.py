"""Run a scenario: start and end each injection on time, report every start and end.

Seconds-keyed injections run on a background thread from `start()`; iteration-keyed
ones follow `on_iteration(i)`, which the training loop calls before iteration `i`
(active for iterations ``at_iteration .. at_iteration + iterations - 1``). `stop()` ends
every running injection and reaps every child process, and the children's parent-death
guard covers a runner that is killed outright.
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from adaptipe.errors import AdaptipeError, PlanError
from adaptipe.inject.injectors import ControlFile, HogProcesses, Injector
from adaptipe.inject.links import LinkLayer, LinkShaper
from adaptipe.inject.scenario import (
    CpuHog,
    GpuHog,
    Injection,
    Kill,
    LinkReshape,
    LinkThrottle,
    MemoryPressure,
    Scenario,
    Slowdown,
    parse_scenario,
)

__all__ = ["Event", "InjectionError", "ScenarioRunner", "inject"]

EventKind = Literal["injection-start", "injection-end", "injection-failed"]


class InjectionError(AdaptipeError, RuntimeError):
    """An injection could not start (its child process died or never got ready)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One injection starting or ending; a kill is a start and an end around the kill."""

    kind: EventKind
    injector: str  # the injection's kind, e.g. "cpu_hog"
    stage: int | None
    time: float  # time.time()
    elapsed_s: float  # since the runner started
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Running:
    injection: Injection
    injector: Injector | None  # None for a periodic kill
    end: float | None  # seconds or iteration (the injection's clock)
    next_draw: float | None = None  # periodic kills: the next preemption draw
    period: float = 0.0


class ScenarioRunner:
    """Runs an expanded scenario (`arrivals.expand` first if it has Poisson levels).

    Args:
        on_event: called with every `Event`, from the timeline thread or from the
            thread calling `on_iteration`, one at a time and in order.
        control_dir: where link-throttle and slowdown state files go (default: a
            temporary folder, removed by `stop()`); see `injectors.read_throttles`.
        kill_stage: called with a stage index to preempt it; needed by kill injections.
            Link shapes need their beds up when the runner is built (`links.LinkShaper`).
        seed: seeds the draws of kills with p < 1.
        ready_timeout_s: how long an injection may take to be in place.
    """

    def __init__(
        self,
        scenario: Scenario,
        *,
        on_event: Callable[[Event], None] | None = None,
        control_dir: str | Path | None = None,
        kill_stage: Callable[[int], None] | None = None,
        seed: int = 0,
        ready_timeout_s: float = 60.0,
    ) -> None:
        if scenario.poisson:
            raise PlanError(f"{scenario.source}: has [[poisson]] levels; expand() it first")
        kills = [i for i in scenario.injections if isinstance(i.spec, Kill)]
        if kills and kill_stage is None:
            raise PlanError(f"{scenario.source}: {kills[0].origin} kills a stage; give kill_stage")
        self.scenario = scenario
        self.events: list[Event] = []
        self.failures: list[str] = []
        self._on_event, self._kill_stage = on_event, kill_stage
        self._rng = random.Random(seed)
        self._ready_timeout_s = ready_timeout_s
        needs_dir = any(
            isinstance(i.spec, LinkThrottle | Slowdown)
            or (isinstance(i.spec, MemoryPressure) and i.spec.stage is not None)
            for i in scenario.injections
        )
        self._own_dir = control_dir is None and needs_dir  # made by start(), removed by stop()
        shapes = any(isinstance(i.spec, LinkReshape) for i in scenario.injections)
        self._links = LinkShaper(scenario) if shapes else None
        self.control_dir = Path(control_dir) if control_dir is not None else None
        keys = range(len(scenario.injections))
        timed = [k for k in keys if not scenario.injections[k].by_iteration]
        self._timed = deque(sorted(timed, key=lambda k: scenario.injections[k].at_s or 0.0))
        self._counted = [k for k in keys if scenario.injections[k].by_iteration]
        self._running: dict[int, _Running] = {}
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0: float | None = None
        self._error: BaseException | None = None

    # ---- public --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the timeline; injections due at 0 s are in place when this returns."""
        if self._t0 is not None:
            raise RuntimeError("this ScenarioRunner was already started")
        if self._own_dir:
            self.control_dir = Path(tempfile.mkdtemp(prefix="adaptipe-inject-"))
        self._t0 = time.monotonic()
        try:
            with self._lock:
                self._tick()
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._loop, name="adaptipe-inject", daemon=True)
        self._thread.start()

    def on_iteration(self, iteration: int) -> None:
        """Training is about to run `iteration`: start and end iteration-keyed injections.

        A hog started here is in place when this returns (tens of milliseconds; a memory
        injection also writes its pages first).
        """
        if self._t0 is None:
            raise RuntimeError("start() the ScenarioRunner before calling on_iteration()")
        with self._lock:
            for key, run in list(self._running.items()):
                if run.injection.by_iteration:
                    self._advance(key, run, float(iteration))
            for key in list(self._counted):
                inj = self.scenario.injections[key]
                at = inj.at_iteration or 0
                if iteration >= at:
                    self._counted.remove(key)  # a window already past never starts
                    if inj.iterations is None or iteration < at + inj.iterations:
                        self._begin(key)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every seconds-keyed injection has ended; False on timeout."""
        if self._t0 is None:
            raise RuntimeError("start() the ScenarioRunner before waiting for it")
        finished = self._done.wait(timeout)
        if self._error is not None:
            raise self._error
        return finished

    def stop(self) -> None:
        """End every running injection; no child process remains when this returns."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            for key in list(self._running):
                self._end(key, "stopped")
        if self._own_dir and self.control_dir is not None:
            shutil.rmtree(self.control_dir, ignore_errors=True)

    def pids(self) -> tuple[int, ...]:
        """The child processes of the injections running now."""
        with self._lock:
            return tuple(p for r in self._running.values() if r.injector for p in r.injector.pids)

    def __enter__(self) -> ScenarioRunner:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- timeline ------------------------------------------------------------------------

    def _elapsed(self) -> float:
        return 0.0 if self._t0 is None else time.monotonic() - self._t0

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                with self._lock:
                    due = self._tick()
                if due is None:
                    break
                if self._stopping.wait(
                    None if math.isinf(due) else max(0.0, due - self._elapsed())
                ):
                    break
        except BaseException as exc:  # reported by wait(); stop() still cleans up
            self._error = exc
        finally:
            self._done.set()

    def _tick(self) -> float | None:
        """Do what is due; the next due time (inf: wait for stop()), None when all is done."""
        now = self._elapsed()
        for key, run in list(self._running.items()):
            if not run.injection.by_iteration:
                self._advance(key, run, now)
        while self._timed and (self.scenario.injections[self._timed[0]].at_s or 0.0) <= now:
            self._begin(self._timed.popleft())
        timed = [r for r in self._running.values() if not r.injection.by_iteration]
        dues = [t for r in timed for t in (r.end, r.next_draw) if t is not None]
        if self._timed:
            dues.append(self.scenario.injections[self._timed[0]].at_s or 0.0)
        if dues:
            return min(dues)
        return math.inf if timed else None

    def _advance(self, key: int, run: _Running, now: float) -> None:
        """Draw a due periodic kill (once, however late) and end the injection when due."""
        if run.next_draw is not None and now >= run.next_draw:
            if run.end is None or run.next_draw < run.end:
                self._preempt(run.injection)
            while run.next_draw <= now:
                run.next_draw += run.period
            if run.end is not None and run.next_draw >= run.end:
                run.next_draw = None
        if run.end is not None and now >= run.end:
            self._end(key, "done")

    def _begin(self, key: int) -> None:
        inj = self.scenario.injections[key]
        at = float(inj.at_iteration) if inj.at_iteration is not None else inj.at_s or 0.0
        length = inj.iterations if inj.by_iteration else inj.duration_s
        end = None if length is None else at + length
        spec = inj.spec
        if isinstance(spec, Kill):
            period = spec.period_iterations if inj.by_iteration else spec.period_s
            if period is None:
                self._preempt(inj)
            else:
                self._running[key] = _Running(inj, None, end, at + period, float(period))
            return
        injector = self._injector(key, inj)
        try:
            injector.start()
            injector.wait_ready(self._ready_timeout_s)
        except Exception as exc:
            injector.stop()
            self.failures.append(f"{inj.origin} ({inj.kind}) did not start: {exc}")
            self._emit("injection-failed", inj, error=str(exc))
            return
        self._running[key] = _Running(inj, injector, end)
        extra = {"shape": injector.shape.describe()} if isinstance(injector, LinkLayer) else {}
        self._emit("injection-start", inj, pids=list(injector.pids), **inj.fields(), **extra)
        if isinstance(injector, LinkLayer) and self._links is not None:
            for older in self._links.replaced_by(injector):  # a later step on the link
                self._end(older, "replaced")

    def _end(self, key: int, reason: str) -> None:
        run = self._running.pop(key)
        if run.injector is None:
            return
        extra: dict[str, Any] = {}
        try:
            run.injector.stop()
        except Exception as exc:  # e.g. a link whose bed went first: the end is still logged
            self.failures.append(
                f"{run.injection.origin} ({run.injection.kind}) did not end: {exc}"
            )
            self._emit("injection-failed", run.injection, error=str(exc))
        else:
            if isinstance(run.injector, LinkLayer) and run.injector.restored is not None:
                extra["restored"] = run.injector.restored.describe()
        pids = list(run.injector.pids)
        self._emit("injection-end", run.injection, reason=reason, pids=pids, **extra)

    def _preempt(self, inj: Injection) -> None:
        assert isinstance(inj.spec, Kill) and self._kill_stage is not None
        if self._rng.random() >= inj.spec.p:
            return
        self._emit("injection-start", inj, **inj.fields())
        try:
            self._kill_stage(inj.spec.stage)
        except Exception as exc:
            self.failures.append(f"{inj.origin}: kill_stage({inj.spec.stage}) failed: {exc}")
            self._emit("injection-failed", inj, error=str(exc))
            return
        self._emit("injection-end", inj, reason="done")

    def _injector(self, key: int, inj: Injection) -> Injector:
        spec = inj.spec
        if isinstance(spec, CpuHog):  # one process per thread: the GIL
            return HogProcesses([{"load": spec.method, **inj.fields()}] * spec.threads)
        if isinstance(spec, GpuHog):
            return HogProcesses([{"load": "gpu", **inj.fields()}])
        if isinstance(spec, MemoryPressure) and spec.stage is not None:  # in the worker
            assert self.control_dir is not None
            grow = spec.grow_mb if spec.grow_mb is not None else spec.gib * 1024
            load = {"origin": inj.origin, "stage": spec.stage, "mb": spec.gib * 1024}
            path = self.control_dir / f"memory-{spec.stage}-{key:04d}.json"
            return ControlFile(path, load | {"grow_mb": grow, "touch": spec.touch})
        if isinstance(spec, MemoryPressure):
            size = int(spec.gib * 2**30)
            return HogProcesses([{"load": "memory", "bytes": size, "touch": spec.touch}])
        if isinstance(spec, LinkReshape):
            assert self._links is not None
            return self._links.layer(key, inj)
        assert self.control_dir is not None and isinstance(spec, LinkThrottle | Slowdown)
        state: dict[str, Any] = {"origin": inj.origin, "stage": spec.stage}
        if isinstance(spec, LinkThrottle):
            bandwidth = spec.bandwidth_Bps
            state |= {"bandwidth_Bps": None if math.isinf(bandwidth) else bandwidth}
            state |= {"extra_latency_s": spec.extra_latency_s}
        else:
            state |= {"factor": spec.factor}
        name = "throttle" if isinstance(spec, LinkThrottle) else "slowdown"
        return ControlFile(self.control_dir / f"{name}-{spec.stage}-{key:04d}.json", state)

    def _emit(self, kind: EventKind, inj: Injection, **detail: Any) -> None:
        event = Event(
            kind=kind,
            injector=inj.kind,
            stage=inj.stage,
            time=time.time(),
            elapsed_s=self._elapsed(),
            detail={"origin": inj.origin, **detail},
        )
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)


@contextmanager
def inject(
    kind: str,
    *,
    on_event: Callable[[Event], None] | None = None,
    control_dir: str | Path | None = None,
    kill_stage: Callable[[int], None] | None = None,
    num_stages: int | None = None,
    **fields: Any,
) -> Iterator[ScenarioRunner]:
    """One injection for the duration of a ``with`` block, e.g. in a test::

        with inject("cpu_hog", cores=[1]) as hog:
            ...  # hog.pids() are the hog's processes

    Raises:
        InjectionError: the injection did not start.
    """
    data = {"inject": [{"kind": kind, "at_s": 0.0, **fields}]}
    scenario = parse_scenario(data, source=f"inject({kind!r})", num_stages=num_stages)
    runner = ScenarioRunner(
        scenario, on_event=on_event, control_dir=control_dir, kill_stage=kill_stage
    )
    runner.start()
    try:
        if runner.failures:
            raise InjectionError(runner.failures[0])
        yield runner
    finally:
        runner.stop()
