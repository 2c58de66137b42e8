"""The manager's decision loop: a controller checked every few iterations, off the
training path, whose moves become plan versions.

`_follow` (`adaptipe.runtime.launch`) polls an `AdaptLoop` once per pass with the
iterations merged since the last. Every ``[adapt].check_every`` iterations, once a full
``[adapt].window`` of iterations has run under the partition in force, no plan change
is in flight (a version committed and not yet adopted, or adopted and not yet run by
every stage) and ``[adapt].cooldown`` iterations have passed since the last move it
committed (for every controller: one without hysteresis of its own would otherwise
move back and forth between two partitions that measure alike), it hands the telemetry
records since the last plan change to a `Decider` on a thread of its own. The poll never
waits for it: a call that raises is logged as a decision with an ``error``; one that
runs past ``[adapt].decide_timeout_s`` is logged as timed out, its answer (when it
comes) is dropped, and no new call starts until it has returned. A move (not with ``dry_run``) is committed through `repartition` on the
decision's own thread, the moment the controller answers (waiting for the next poll
would cost the workers an iteration or two), so the workers take it on at their next
boundary with ``[adapt].method``; the poll logs it. The controller in charge, with
the artifacts it decides with, is named in ``control/controller.json``.

Events (one JSON line each in ``control.jsonl``)::

    {"event": "decision", "iteration", "controller", "bounds" (in force), "decision"
     (Decision.to_json() or null), "acted", "dry_run", "inputs", "seconds", "cpu_seconds"
     (its thread's: seconds less waiting for a core), ["version" (committed), "error"]}
    {"event": "decision_outcome", ...}  (`adaptipe.runtime.adapt_outcomes`: the
     realised gain of each committed move, once measured)

``adaptipe adapt RUN_DIR --pause | --resume | --controller NAME`` changes the loop live
(`adaptipe.runtime.adapt_requests`): a paused loop starts no calls, and another
controller is built by ``rebuild`` and used from the next check on (a call in flight
finishes first). A stage's memory warning (`adaptipe.runtime.memory_relief`) is logged
and answered whatever the controller, paused or not: one layer off that stage, as a
``decision`` with ``"reason": "memory"`` under the same cooldown. Each change is an event::

    {"event": "adapt_control", "iteration", "seq", "paused", "controller", "previous",
     ["error" (the controller could not be built: the previous one stays)]}

The loop keeps its state with the run's checkpoints: when the iterations up to a
checkpoint have merged (the workers' rule, `adaptipe.runtime.control.checkpoint_due`), it writes
``control/adapt-state/iter-N.json`` (the controller in charge, paused, the last move,
and the controller's own `state_dict` where it keeps one). A resumed run restores the
newest such file at or before its checkpoint and logs an ``adapt_restored`` event, so
patience counters, the cooldown and the hourly cap go on as before the interruption.

The loop knows controllers only through `Decider`: ``adaptipe.controllers`` sits above
the runtime in the import order (docs/architecture.md), so the caller passes the
factory in (`adaptipe.controllers.live.decider` does observe + decide).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from adaptipe.errors import PlanError
from adaptipe.monitor.schema import Record
from adaptipe.plan.partition import Partition
from adaptipe.runtime.adapt_outcomes import Outcomes
from adaptipe.runtime.adapt_requests import (
    ADAPT_REQUEST,
    AdaptOverride,
    ControllerBuild,
    read_override,
)
from adaptipe.runtime.adapt_state import load_state, record_controller, save_state
from adaptipe.runtime.decide_call import DeciderCall, DecideThread, Verdict
from adaptipe.runtime.memory_relief import MemoryRelief
from adaptipe.runtime.planversion import adoptions, current_version, read_active
from adaptipe.runtime.repartition import repartition
from adaptipe.runtime.rundir import RunDir

if TYPE_CHECKING:
    from adaptipe.runtime.adapt_config import AdaptSection
    from adaptipe.runtime.config import RunConfig

__all__ = ["AdaptLoop", "Decider", "DeciderFactory", "Verdict"]


class Decider(Protocol):
    """Observes telemetry ``records`` under ``partition`` and decides; may keep state."""

    name: str

    def __call__(self, records: Sequence[Record], partition: Partition) -> Verdict: ...


DeciderFactory = Callable[[RunDir, "RunConfig"], Decider]


class AdaptLoop:
    """See the module doc.

    Args:
        run: the run directory (plan versions, adoptions).
        settings: the run's ``[adapt]``.
        decider: the controller behind the `Decider` protocol (None: none decides until
            ``adaptipe adapt --controller`` names one).
        records: the telemetry kept so far, its StageStats from the iteration given on
            (`Collector.for_decision`); called when a check starts, cheap.
        start: the first iteration this launch trains (a resume's checkpoint).
        commit: commits layer bounds, returns the version (default: `repartition`).
        rebuild: builds the controller a name stands for (None for "none"); without it
            ``adaptipe adapt --controller`` is refused here with an error event.
        checkpoint_due: whether a checkpoint is written after that many iterations
            (`adaptipe.runtime.control.checkpoint_due`; None: no state saved).
        memory_warnings: whether stages warn of memory (``[train] stage_memory_mb``);
            without, the loop never scans the control folder for their requests.
    """

    def __init__(
        self,
        run: RunDir,
        settings: AdaptSection,
        decider: Decider | None,
        records: Callable[[int], Sequence[Record]],
        *,
        start: int = 0,
        commit: Callable[[tuple[int, ...]], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rebuild: Callable[[str], Decider | None] | None = None,
        checkpoint_due: Callable[[int], bool] | None = None,
        memory_warnings: bool = True,
    ) -> None:
        self.run, self.settings, self.decider = run, settings, decider
        self._checkpoint_due, self._rebuild = checkpoint_due, rebuild
        self.paused, self._override_seq = False, 0
        self._override_stamp: tuple[int, int] | None = None
        self._asked_by = self.name  # the controller of the call in flight
        # adaptipe adapt --controller: the controller being built, and the request
        self._building: tuple[ControllerBuild, AdaptOverride] | None = None
        self._restored = self._restore(start) if start > 0 else []
        if decider is not None:
            record_controller(run.root, decider, iteration=start)
        self._records, self._clock, self._start = records, clock, start
        self._in_force_cache: tuple[int, float, tuple[int, Partition] | None] | None = None
        self._partitions: dict[int, Partition] = {}  # plan version -> its partition
        self._commit = commit if commit is not None else self._repartition
        self._latest, self._next_check = start - 1, start  # the last merged, the next check
        self._call: DeciderCall | None = None
        self._thread = DecideThread()  # where calls run
        self._asked: tuple[int, tuple[int, ...]] = (start, ())  # iteration, bounds in force
        self._outcomes = Outcomes(run, settings.window)
        self._last_move: int | None = None  # the iteration of the last committed move
        self.calls = 0  # decider calls started (tests check that a hung one is not repeated)
        # the control folder is scanned only where stages run a memory guard
        self._memory = MemoryRelief(run.root) if memory_warnings else None
        self._override_path = run.root / ADAPT_REQUEST

    @property
    def active(self) -> bool:
        """Whether a controller decides now (not paused, one named)."""
        return self.decider is not None and not self.paused

    @property
    def due(self) -> bool:
        """Whether the loop wants the next merged iteration soon: a controller call is
        in flight, or the next merge may be the one a check waits for. The manager polls
        fast only then (every poll pass costs CPU, `bench/bench_overhead.py`)."""
        if not self.active:
            return False
        last = self._last_move
        cooling = last is not None and self._latest + 1 < last + self.settings.cooldown
        return self.deciding or (not cooling and self._latest + 1 >= self._next_check)

    @property
    def deciding(self) -> bool:
        """Whether a controller call is in flight (its answer not yet taken in)."""
        return self._call is not None

    @property
    def name(self) -> str:
        return self.decider.name if self.decider is not None else "none"

    def poll(
        self, merged: Sequence[Mapping[str, Any]], *, answer_wait_s: float = 0.0
    ) -> list[dict[str, Any]]:
        """Take the newly merged iterations; return the events to log. A call it starts
        is waited for up to ``answer_wait_s`` (no CPU), so that a quick answer is logged
        with this poll, not in a pass of its own (each pass costs the manager CPU)."""
        for rec in merged:
            self._latest = max(self._latest, int(rec["iteration"]))
        events, self._restored = self._restored, []
        if self._checkpoint_due is not None:
            for rec in merged:
                if self._checkpoint_due(int(rec["iteration"]) + 1):
                    self._save(int(rec["iteration"]) + 1)
        events += self._overridden() + self._built() + self._collect() + self._relieve()
        if merged:
            events += self._outcomes.merged(merged, self._latest, keep_from=self._asked[0])
        if self._call is None and self._latest >= self._next_check and self.active:
            self._maybe_start()
            if self._call is not None and answer_wait_s > 0 and self._call.wait(answer_wait_s):
                events += self._collect()
        return events

    def await_answer(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` (no CPU) for the call in flight, if any, to answer."""
        if self._call is not None:
            self._call.wait(timeout_s)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, iteration: int) -> None:
        save_state(
            self.run.root,
            iteration,
            controller=self.name,
            paused=self.paused,
            last_move=self._last_move,
            decider=self.decider,
        )

    def _restore(self, start: int) -> list[dict[str, Any]]:
        """Take the state saved with the checkpoint this launch resumes from; the event
        saying so, or none."""
        found = load_state(self.run.root, start)
        if found is None:
            return []
        path, state = found
        event: dict[str, Any] = {"event": "adapt_restored", "iteration": start, "from": str(path)}
        try:
            last = state.get("last_move")
            self._last_move = int(last) if last is not None else None
            load = getattr(self.decider, "load_state_dict", None)
            if state.get("controller") == self.name and callable(load):
                load(dict(state.get("decider_state") or {}))
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return [event | {"error": f"not restored ({type(exc).__name__}: {exc})"}]
        return [event | {"controller": self.name, "last_move": self._last_move}]

    # ------------------------------------------------------------------ live changes
    def _overridden(self) -> list[dict[str, Any]]:
        """Apply a new ``adaptipe adapt`` request (the file is stat'ed each poll, read
        only when it changed)."""
        try:
            st = self._override_path.stat()
        except OSError:
            return []
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._override_stamp:
            return []
        self._override_stamp = stamp
        try:
            asked = read_override(self.run.root)
        except PlanError as exc:
            return [self._control_event(None, "none", error=str(exc))]
        if asked is None or asked.seq <= self._override_seq:
            return []
        self._override_seq = asked.seq
        return self._apply(asked)

    def _apply(self, asked: AdaptOverride) -> list[dict[str, Any]]:
        previous = self.name
        self.paused = asked.paused
        wanted = asked.controller
        if wanted is None or wanted == previous:
            return [self._control_event(asked, previous)]
        if self._rebuild is None:
            why = "this manager cannot change its controller (no decider factory)"
            return [self._control_event(asked, previous, error=why)]
        # Built on a thread: loading a controller (its imports, a learned model) can take
        # seconds, and the poll must not stop merging iterations meanwhile.
        rebuild = self._rebuild
        self._building = (ControllerBuild(lambda: rebuild(wanted)), asked)
        return []

    def _built(self) -> list[dict[str, Any]]:
        """The event of a controller build that has finished (it takes over now)."""
        if self._building is None or not self._building[0].done:
            return []
        (build, asked), self._building = self._building, None
        previous = self.name
        if build.error is not None:  # e.g. a learned policy for another stage count
            return [self._control_event(asked, previous, error=_describe(build.error))]
        carry = getattr(build.result, "carry_from", None)
        if callable(carry):  # what the old one learnt of the run that is not its own
            carry(self.decider)
        self.decider = build.result
        record_controller(self.run.root, self.decider, iteration=self._latest)
        self._next_check = min(self._next_check, self._latest + 1)
        return [self._control_event(asked, previous)]

    @property
    def building(self) -> bool:
        """Whether a controller named by ``adaptipe adapt`` is still being built."""
        return self._building is not None

    def _control_event(
        self, asked: AdaptOverride | None, previous: str, *, error: str | None = None
    ) -> dict[str, Any]:
        event: dict[str, Any] = {
            "event": "adapt_control",
            "iteration": self._latest,
            "seq": asked.seq if asked is not None else None,
            "paused": self.paused,
            "controller": self.name,
            "previous": previous,
        }
        return event | ({"error": error} if error is not None else {})

    def close(self) -> list[dict[str, Any]]:
        """The run ended: the events of a call that has finished by now."""
        self._thread.close()  # after the call it runs, if any
        return self._collect() if self._call is not None and self._call.done else []

    # ------------------------------------------------------------------ calls
    def _maybe_start(self) -> None:
        in_force = self._in_force()
        if in_force is None:
            return
        since, partition = in_force
        if self._latest < since + self.settings.window - 1:
            return  # a full window under the partition in force first
        if self._cooling():
            return
        # What a decider reads: two windows (a measured baseline), the iterations since
        # the last check and a few a stage's telemetry may lag behind the merge; all
        # since the plan change made every check read past a few hundred records.
        floor = max(since, self._latest - 2 * self.settings.window - self.settings.check_every - 4)
        records = list(self._records(floor))
        decider = self.decider
        assert decider is not None  # active
        self._asked = (self._latest, tuple(partition.bounds))
        self._asked_by = decider.name
        fn = lambda: decider(records, partition)  # noqa: E731
        self._call = DeciderCall(fn, self._act, self._clock, thread=self._thread)
        self.calls += 1
        self._next_check = self._latest + self.settings.check_every

    def _in_force(self) -> tuple[int, Partition] | None:
        """(the iteration it came into force, the partition) of the plan in force; None
        while a change is in flight (committed, not yet adopted). Cached while the
        control folder is unchanged (every commit and adoption writes a file into it) and
        dropped at this loop's own commits; re-read at least every 0.25 s, since a
        folder's time moves in clock ticks and two writes may share one."""
        try:
            stamp = os.stat(self.run.root / "control").st_mtime_ns
        except OSError:
            stamp = -1
        now = time.monotonic()
        cached = self._in_force_cache
        if cached is not None and cached[0] == stamp and now - cached[1] < 0.25:
            return cached[2]
        found = self._read_in_force()
        self._in_force_cache = (stamp, now, found)
        return found

    def _read_in_force(self) -> tuple[int, Partition] | None:
        adopted = adoptions(self.run)
        newest = max(adopted, default=0)
        if current_version(self.run) > newest:
            return None
        since = max(adopted.get(newest, 0), self._start)
        partition = self._partitions.get(newest)
        if partition is None:  # a version never changes once committed: read once
            found = read_active(self.run, newest).partition if newest else None
            partition = found if found is not None else self.run.read_partition()
            self._partitions[newest] = partition
        return since, partition

    def _collect(self) -> list[dict[str, Any]]:
        call = self._call
        if call is None:
            return []
        if call.done:
            self._call = None
            return [] if call.timed_out else [self._event(call)]
        if call.seconds() > self.settings.decide_timeout_s and not call.timed_out:
            with call.lock:
                if call.done:  # it answered meanwhile, in time
                    self._call = None
                    return [self._event(call)]
                call.timed_out = True
            why = (
                f"timed out after {self.settings.decide_timeout_s:g} s (decide_timeout_s); its "
                "answer will be dropped and no other call starts until it returns"
            )
            return [self._base(call) | {"decision": None, "acted": False, "error": why}]
        return []

    def _base(self, call: DeciderCall) -> dict[str, Any]:
        iteration, bounds = self._asked
        return {
            "event": "decision",
            "iteration": iteration,
            "controller": self._asked_by,
            "bounds": list(bounds),
            "dry_run": self.settings.dry_run,
            "seconds": round(call.seconds(), 6),
            "cpu_seconds": round(call.cpu_s, 6),
        }

    def _event(self, call: DeciderCall) -> dict[str, Any]:
        event = self._base(call)
        verdict = call.result
        if verdict is None:
            error = call.error if call.error is not None else RuntimeError("no verdict")
            return event | {"decision": None, "acted": False, "error": _describe(error)}
        event |= {
            "decision": dict(verdict.decision),
            "acted": False,
            "inputs": dict(verdict.inputs),
        }
        if "version" in call.acted:
            gain = verdict.decision.get("predicted_gain_s")
            version = int(call.acted["version"])
            self._last_move = self._asked[0]
            self._outcomes.add(self._asked[0], version, float(gain) if gain is not None else None)
        return event | call.acted

    def _act(self, verdict: Verdict) -> dict[str, Any]:
        """On the decision's thread: commit a move (not with ``dry_run``); what to add
        to the decision's event."""
        moves = verdict.bounds is not None and tuple(verdict.bounds) != self._asked[1]
        if not moves or self.settings.dry_run or verdict.bounds is None:
            return {}
        try:
            self._in_force_cache = None  # a change is in flight from now on
            version = self._commit(tuple(verdict.bounds))
        except PlanError as exc:  # e.g. the run finished meanwhile: logged, not raised
            return {"error": f"commit refused: {exc}"}
        return {"acted": True, "version": version}

    def _repartition(self, bounds: tuple[int, ...]) -> int:
        return repartition(self.run.root, bounds).version

    def _relieve(self) -> list[dict[str, Any]]:
        """The workers' memory warnings logged; the oldest unanswered one answered once
        no change or call is in flight and the cooldown allows (module doc)."""
        if self._memory is None:
            return []
        events = self._memory.poll()
        # A timed-out call's late answer is dropped (under its lock): it blocks nothing.
        idle = self._call is None or self._call.timed_out
        in_force = self._in_force() if self._memory.asking and idle else None
        if in_force is None or self._cooling():
            return events
        event = self._memory.decide(self._latest, in_force[1], dry_run=self.settings.dry_run)
        bounds = event["decision"]["bounds"]
        if bounds is not None and not self.settings.dry_run:
            try:
                self._in_force_cache = None
                version = self._commit(tuple(bounds))
            except PlanError as exc:
                return [*events, event | {"error": f"commit refused: {exc}"}]
            self._last_move = self._latest
            self._outcomes.add(self._latest, version, None)
            event |= {"acted": True, "version": version}
        return [*events, event]

    def _cooling(self) -> bool:
        last = self._last_move
        return last is not None and self._latest < last + self.settings.cooldown


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."
