"""One controller call of the decision loop (`adaptipe.runtime.adapt_loop`), on a
thread of its own, and the answer it gives."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeciderCall", "Verdict"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """One controller call's answer: move to ``bounds`` (None: keep), the controller's
    decision as JSON, and the numbers it decided on (for the log)."""

    bounds: tuple[int, ...] | None
    decision: Mapping[str, Any]
    inputs: Mapping[str, Any] = field(default_factory=dict)


class DeciderCall:
    """One decider call on a daemon thread (a hung controller never holds up exit).

    ``act`` runs on the same thread with the verdict, unless the call has been logged
    as timed out by then (``lock`` orders the two): a late answer is dropped."""

    def __init__(
        self,
        fn: Callable[[], Verdict],
        act: Callable[[Verdict], dict[str, Any]],
        clock: Callable[[], float],
    ) -> None:
        self.clock, self.started = clock, clock()
        self.ended: float | None = None
        self.cpu_s = 0.0  # the call's thread's CPU seconds: ``seconds`` less waiting for a core
        self.result: Verdict | None = None
        self.acted: dict[str, Any] = {}  # what acting on the verdict added to its event
        self.error: BaseException | None = None
        self.timed_out = False  # logged as timed out: its answer is dropped
        self.lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, args=(fn, act), name="adaptipe-decide", daemon=True
        )
        self._thread.start()

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

    @property
    def done(self) -> bool:
        return self.ended is not None

    def seconds(self) -> float:
        return (self.ended if self.ended is not None else self.clock()) - self.started
