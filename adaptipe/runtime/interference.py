"""An interference scenario run next to training (``adaptipe train --inject``).

Its clock starts when every worker is ready; its events travel as telemetry, and a
``kill`` injector preempts a stage worker the way a spot instance would be.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adaptipe.inject.runner import Event as InjectEvent
    from adaptipe.inject.scenario import Scenario

__all__ = ["SCENARIO_HORIZON_S", "Interference", "load_interference"]

SCENARIO_HORIZON_S = 24 * 3600.0  # Poisson arrivals are drawn this far ahead


def load_interference(
    path: str | Path, *, num_stages: int, num_cores: int | None, seed: int
) -> Scenario:
    """The scenario in `path` for this run, Poisson arrivals drawn with `seed`."""
    from adaptipe.inject import expand, load_scenario

    scenario = load_scenario(path, num_stages=num_stages, num_cores=num_cores)
    if scenario.poisson:
        scenario = expand(scenario, horizon_s=SCENARIO_HORIZON_S, seed=seed)
    return scenario


class Interference:
    """Runs an injection scenario next to training; its events go into the telemetry."""

    def __init__(
        self,
        scenario: Scenario,
        telemetry: str,
        control_dir: Path,
        procs: list[subprocess.Popen[bytes]],
        seed: int,
    ) -> None:
        from adaptipe.inject import ScenarioRunner
        from adaptipe.monitor.publisher import Publisher

        self.procs = procs
        self.publisher = Publisher(telemetry, stage=0)
        self.runner = ScenarioRunner(
            scenario,
            on_event=self._event,
            control_dir=control_dir,
            kill_stage=self._kill,
            seed=seed,
        )
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
