"""Discrete-event pipeline simulator: run a `Schedule` under a `CostModel`."""

from adaptipe.sim.costs import CostModel
from adaptipe.sim.engine import simulate, simulate_iterations
from adaptipe.sim.gantt import plot_gantt
from adaptipe.sim.result import IterationsResult, SimResult

__all__ = [
    "CostModel",
    "IterationsResult",
    "SimResult",
    "plot_gantt",
    "simulate",
    "simulate_iterations",
]
