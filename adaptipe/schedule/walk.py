"""`walk`: run every worker's list with buffered sends and blocking receives.

A send never blocks and a receive waits until its matching send has been posted, so how
far each worker gets does not depend on the order the workers are advanced in: the walk
either finishes every list or stops where no worker can advance (a deadlock). The
validator uses it to find deadlocks (`adaptipe.schedule.validate`), the simulator to
put a schedule's instructions in a topological order (`adaptipe.sim.dag`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

__all__ = ["walk"]


def walk(
    lengths: Sequence[int],
    waits: Sequence[Mapping[int, Hashable]],
    posts: Sequence[Mapping[int, Hashable]],
) -> tuple[list[tuple[int, int]], list[int]]:
    """Advance the workers in turn, each as far as it can, until none can advance.

    Args:
        lengths: per worker, how many steps its list has.
        waits: per worker, ``{step: token}`` for each step that waits for ``token`` to
            be posted (a receive); a token no step posts waits forever.
        posts: per worker, ``{step: token}`` for each step that posts ``token`` (a send).

    Returns:
        The ``(worker, step)`` pairs in the order they ran, and each worker's position:
        ``lengths[s]`` where it finished, else the step it is blocked at.
    """
    pc = [0] * len(lengths)
    posted: set[Hashable] = set()
    order: list[tuple[int, int]] = []
    while True:
        progress = False
        for s, n in enumerate(lengths):
            wait, post = waits[s], posts[s]
            while pc[s] < n:
                i = pc[s]
                if i in wait and wait[i] not in posted:
                    break
                if i in post:
                    posted.add(post[i])
                order.append((s, i))
                pc[s] += 1
                progress = True
        if not progress:
            return order, pc
