"""A JAPSP instance with time running backwards: the same optimum, seen from the end.

Run a schedule backwards and each job's chain ``F0 .. F(S-1) B(S-1) .. B0`` still visits
stages ``0 .. S-1 .. 0``, its backward blocks now first: the mirror instance's forward
block on stage ``s`` takes the backward time ``r_b + re``, its backward block ``r_f``,
and a transfer (Eq. 5-6) is the same lag in the other direction. Reversed per-stage
orders, forward and backward swapped, give a schedule of the mirror with the same
makespan (every path of the disjunctive graph keeps its length), and back again.

That needs two terms to be symmetric in time. An update (Eq. 9) occupies a stage after
its gradient left, which backwards would be before its input arrived. A switch
(Eq. 8-9) is paid by the job a stage leaves, which backwards is the job it enters;
only a switch that costs the same for every job on a stage stays the same. `mirror`
returns None for instances with updates or such job-dependent switches.
"""

from __future__ import annotations

from adaptipe.japsp.evaluate import Orders
from adaptipe.japsp.instance import JapspInstance

__all__ = ["mirror", "mirror_orders"]


def mirror(inst: JapspInstance) -> JapspInstance | None:
    """The instance run backwards, or None where it has no mirror (module doc)."""
    if any(any(row) for row in inst.update):
        return None
    if any(len({row[s] for row in inst.switch}) > 1 for s in range(inst.num_stages)):
        return None
    return JapspInstance.build(
        [
            [b + re for b, re in zip(bw, rc, strict=True)]
            for bw, rc in zip(inst.backward, inst.recompute, strict=True)
        ],
        [list(row) for row in inst.forward],
        names=list(inst.names),
        comm=[list(row) for row in inst.comm],
        switch=[list(row) for row in inst.switch],
    )


def mirror_orders(orders: Orders) -> Orders:
    """Per-stage orders of the mirror (or, applied again, of the original)."""
    return tuple(
        tuple(("B" if kind == "F" else "F", j) for kind, j in reversed(stage)) for stage in orders
    )
