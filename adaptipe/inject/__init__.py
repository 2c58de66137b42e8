"""Interference on purpose: CPU/GPU hogs, memory pressure, link throttles, slow or killed
stages, and link shapes on a bed of namespace hosts.

A scenario file (`scenario`) is a timeline of injections; `expand` draws DynPipe-style
Poisson levels into it (`arrivals`); `ScenarioRunner` runs it next to training (or alone,
``adaptipe inject``) and `inject` runs one injection for a ``with`` block. Throttles and
slowdowns are control files that the runtime reads with `read_throttles` and
`read_slowdowns`; link shapes change a bed's links with tc (`links`).
"""

from __future__ import annotations

from adaptipe.inject.arrivals import expand
from adaptipe.inject.injectors import CONTROL_DIR_ENV, Throttle, read_slowdowns, read_throttles
from adaptipe.inject.runner import Event, InjectionError, ScenarioRunner, inject
from adaptipe.inject.scenario import Injection, Scenario, load_scenario

__all__ = [
    "CONTROL_DIR_ENV",
    "Event",
    "Injection",
    "InjectionError",
    "Scenario",
    "ScenarioRunner",
    "Throttle",
    "expand",
    "inject",
    "load_scenario",
    "read_slowdowns",
    "read_throttles",
]
