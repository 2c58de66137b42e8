"""The start-up heap out of the garbage collector's way, in the manager and each stage.

A process that has imported torch (and, in the manager, scikit-learn and the controllers'
models) holds hundreds of thousands of long-lived objects. CPython's full (generation 2)
collection walks all of them: measured on this project's 2-core machine, 100-320 ms
each, four in the manager's 120 iterations of a 40 ms job-array, one of them inside a
controller's call (a 326 ms decision that spent 2 ms deciding). In a stage such a pause
stalls the whole pipeline. `settled` moves every object alive into the permanent
generation (`gc.freeze`), which collections skip: later full collections walk only what
the run allocated since. It does not collect first: that one collection would cost as
much again at start (370 ms in the manager above), and the start-up's own full
collections have freed most of what a collection would find. On leaving it gives them
back to the collector (`gc.unfreeze`): a caller that trains in its own process, as the
tests do, keeps no frozen garbage.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["settled"]


@contextlib.contextmanager
def settled() -> Iterator[None]:
    """Around a process's loop, once it has built what it keeps: what is alive on entry
    is frozen until exit."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
