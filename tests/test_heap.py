"""`adaptipe.runtime.heap.settled`: what is alive on entry is out of the garbage
collector's way until exit, then back in it."""

from __future__ import annotations

import gc
import weakref

from adaptipe.runtime.heap import settled


class _Node:
    other: object = None


def test_what_lives_on_entry_is_frozen_until_exit() -> None:
    cycle = _Node()
    cycle.other = cycle  # only the cyclic collector frees it
    ref = weakref.ref(cycle)
    with settled():
        assert gc.get_freeze_count() > 0
        del cycle
        gc.collect()
        assert ref() is not None  # frozen: a full collection does not walk it
        young = _Node()
        young.other = young
        young_ref = weakref.ref(young)
        del young
        gc.collect()
        assert young_ref() is None  # what the loop allocates is collected as ever
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # given back on exit: nothing frozen stays behind
