"""One controller call of the decision loop (`adaptipe.runtime.adapt_loop`), on the
loop's decision thread, and the answer it gives."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DecideThread", "DeciderCall", "Verdict"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """One controller call's answer: move to ``bounds`` (None: keep), the controller's
    decision as JSON, and the numbers it decided on (for the log)."""

    bounds: tuple[int, ...] | None
    decision: Mapping[str, Any]
    inputs: Mapping[str, Any] = field(default_factory=dict)


class DecideThread:
    """The daemon thread (a hung controller never holds up exit) that runs a loop's
    calls, one after another. One thread started per call made the manager's loop wait
    for each new thread to run (`threading.Thread.start` does), on a machine whose cores
    the stages fill up to a scheduler time slice; a call is now handed over and the loop
    goes on. Started with the first call; `close` ends it after the call it runs."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, run: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="adaptipe-decide", daemon=True)
            self._thread.start()
        self._calls.put(run)

    def close(self) -> None:
        if self._thread is not None:
            self._calls.put(None)
            self._thread = None

    def _loop(self) -> None:
        while (run := self._calls.get()) is not None:
            run()


class DeciderCall:
    """One decider call, run on ``thread`` (the loop's `DecideThread`).

    ``act`` runs on the same thread with the verdict, unless the call has been logged
    as timed out by then (``lock`` orders the two): a late answer is dropped."""

    def __init__(
        self,
        fn: Callable[[], Verdict],
        act: Callable[[Verdict], dict[str, Any]],
        clock: Callable[[], float],
        thread: DecideThread,
    ) -> None:
        self.clock, self.started = clock, clock()
        self.ended: float | None = None
        self.cpu_s = 0.0  # the call's thread's CPU seconds: ``seconds`` less waiting for a core
        self.result: Verdict | None = None
        self.acted: dict[str, Any] = {}  # what acting on the verdict added to its event
        self.error: BaseException | None = None
        self.timed_out = False  # logged as timed out: its answer is dropped
        self.lock = threading.Lock()
        self._finished = threading.Event()
        thread.submit(lambda: self._run(fn, act))

    def _run(self, fn: Callable[[], Verdict], act: Callable[[Verdict], dict[str, Any]]) -> None:
        verdict: Verdict | None = None
        cpu = time.thread_time()
        try:
            verdict = fn()
        except Exception as exc:  # a controller's fault is logged, never raised
            self.error = exc
        finally:
            with self.lock:  # done and acted at once, as the timeout sees it
                try:
                    if verdict is not None and not self.timed_out:
                        self.result, self.acted = verdict, act(verdict)
                except Exception as exc:
                    self.error = exc
                finally:
                    self.cpu_s = time.thread_time() - cpu
                    self.ended = self.clock()
                    self._finished.set()

    @property
    def done(self) -> bool:
        return self.ended is not None

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` (no CPU) for the call to end; whether it has."""
        return self._finished.wait(timeout_s)

    def seconds(self) -> float:
        return (self.ended if self.ended is not None else self.clock()) - self.started
