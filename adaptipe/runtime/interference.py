"""An interference scenario run next to training (``adaptipe train --inject``, and
``adaptipe manage --inject`` for workers torchrun starts).

Its clock starts when every worker is ready; its events travel as telemetry, and a
``kill`` injector preempts a stage worker the way a spot instance would be. A manager of
workers it did not start (`remote`) has no processes to kill, and its workers are not
told the control folder that throttles and slowdowns act through, so it refuses those;
link shapes, hogs and memory pressure act from the manager's side and run there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptipe.errors import PlanError

if TYPE_CHECKING:
    from adaptipe.inject.runner import Event as InjectEvent
    from adaptipe.inject.scenario import Scenario

__all__ = ["SCENARIO_HORIZON_S", "Interference", "load_interference"]

SCENARIO_HORIZON_S = 24 * 3600.0  # Poisson arrivals are drawn this far ahead
_NOT_REMOTE = {
    "kill": "it kills a stage worker's process, and this manager did not start them",
    "slowdown": "it acts through control files that only workers `adaptipe train` starts read",
    "link_throttle": "it acts through control files that only workers `adaptipe train` starts "
    "read; to slow a link between hosts, use link_shape on the bed",
}


def load_interference(
    path: str | os.PathLike[str],
    *,
    num_stages: int,
    num_cores: int | None,
    seed: int,
    remote: bool = False,
) -> Scenario:
    """The scenario in `path` for this run, Poisson arrivals drawn with `seed`.

    Link shapes' beds are checked here, before any worker starts; with ``remote`` (the
    workers are torchrun's), kills, slowdowns and throttles are refused.
    """
    from adaptipe.inject import expand, load_scenario
    from adaptipe.inject.links import LinkShaper
    from adaptipe.inject.scenario import LinkReshape

    scenario = load_scenario(path, num_stages=num_stages, num_cores=num_cores)
    if scenario.poisson:
        scenario = expand(scenario, horizon_s=SCENARIO_HORIZON_S, seed=seed)
    for inj in scenario.injections if remote else ():
        in_worker = inj.kind == "memory" and inj.stage is not None  # a control file too
        why = _NOT_REMOTE["slowdown"] if in_worker else _NOT_REMOTE.get(inj.kind)
        if why is not None:
            raise PlanError(
                f"{scenario.source}: {inj.origin} is a {inj.kind}, which `adaptipe manage` "
                f"cannot run: {why}; run it with `adaptipe train --inject`"
            )
    if any(isinstance(i.spec, LinkReshape) for i in scenario.injections):
        LinkShaper(scenario)  # the beds are up and have the hosts named
    return scenario


class Interference:
    """Runs an injection scenario next to training; its events go into the telemetry."""

    def __init__(
        self,
        scenario: Scenario,
        telemetry: str,
        control_dir: Path,
        procs: list[subprocess.Popen[bytes]] | None,
        seed: int,
        *,
        curve: Any = None,
    ) -> None:
        """``procs``: the stage workers, or None where another launcher started them (no
        kills then); ``curve``: the workers' CURVE keys when telemetry is off loopback."""
        from adaptipe.inject import ScenarioRunner
        from adaptipe.monitor.publisher import Publisher

        self.procs = procs
        self.publisher = Publisher(telemetry, stage=0, curve=curve)
        try:
            self.runner = ScenarioRunner(
                scenario,
                on_event=self._event,
                control_dir=control_dir,
                kill_stage=self._kill if procs is not None else None,
                seed=seed,
            )
        except BaseException:
            self.publisher.close()
            raise
        self.started = False

    def _event(self, event: InjectEvent) -> None:
        from adaptipe.monitor.schema import Event

        detail: dict[str, str | int | float | bool | None] = {"injector": event.injector}
        detail.update(
            {k: v for k, v in event.detail.items() if isinstance(v, str | int | float | bool)}
        )
        self.publisher.publish(
            Event(kind=event.kind, time_s=time.time(), stage=event.stage, detail=detail)
        )

    def _kill(self, stage: int) -> None:
        assert self.procs is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[stage].pid, signal.SIGKILL)  # spot preemption of that worker

    def start(self) -> None:
        self.runner.start()
        self.started = True

    def on_iteration(self, iteration: int) -> None:
        if self.started:
            self.runner.on_iteration(iteration)

    def stop(self) -> None:
        self.runner.stop()
        self.publisher.close(linger_s=0.5)
