"""ArrayPipe's job-array pipeline scheduling problem (JAPSP, §IV) and its solvers.

``J`` sibling jobs share one pipeline of ``S`` stages; each job's mini-batch is one block
per stage and pass. `JapspInstance` holds the block costs, `evaluate` times per-stage
block orders, `lower_bound` bounds the makespan, and `solve` runs branch-and-bound
(``bb``, proves optima), the genetic algorithm (``ga``, large job-arrays), OR-Tools CP-SAT
(``cpsat``, optional) or a baseline (``gpipe``, ``1f1b``, ``rr``). `to_schedule` compiles
the orders into the one schedule form the simulator and the stage workers execute.
"""

from adaptipe.japsp.bounds import lower_bound
from adaptipe.japsp.compile import to_schedule
from adaptipe.japsp.evaluate import Timeline, evaluate
from adaptipe.japsp.instance import JapspInstance, generate
from adaptipe.japsp.solve import SOLVERS, Result, solve

__all__ = [
    "SOLVERS",
    "JapspInstance",
    "Result",
    "Timeline",
    "evaluate",
    "generate",
    "lower_bound",
    "solve",
    "to_schedule",
]
