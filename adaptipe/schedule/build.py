"""`build_schedule`: one entry point from a schedule name and its knobs to a `Schedule`.

The names follow Narayanan's dissertation: ``gpipe`` and ``1f1b`` (PipeDream-Flush,
ch. 3 §3.3), ``interleaved`` (PTD-P interleaved 1F1B, ch. 4 §4.2.2), ``pipedream``
(weight stashing / vertical sync, ch. 2 §2.3) and ``2bw`` (PipeDream-2BW, ch. 3 §3.2).
"""

from __future__ import annotations

from adaptipe.errors import PlanError
from adaptipe.schedule.gpipe import gpipe
from adaptipe.schedule.interleaved import interleaved
from adaptipe.schedule.onefoneb import check_count, one_f_one_b
from adaptipe.schedule.pipedream import pipedream
from adaptipe.schedule.twobw import two_bw
from adaptipe.schedule.types import Schedule

__all__ = ["SCHEDULE_NAMES", "build_schedule"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "pipedream", "2bw")


def build_schedule(
    name: str,
    *,
    stages: int,
    microbatches: int,
    chunks: int = 1,
    recompute: bool = False,
    vertical_sync: bool = False,
    update_every: int | None = None,
) -> Schedule:
    """Build schedule ``name`` (one of `SCHEDULE_NAMES`); `PlanError` names any bad knob.

    ``chunks`` is only for ``interleaved`` (>= 2), ``vertical_sync`` only for
    ``pipedream`` and ``update_every`` only for ``2bw``.
    """
    if name not in SCHEDULE_NAMES:
        raise PlanError(f"unknown schedule {name!r}; allowed: {', '.join(SCHEDULE_NAMES)}")
    what = f"schedule {name!r}"
    check_count(what, "stages", stages)
    check_count(what, "microbatches", microbatches)
    check_count(what, "chunks", chunks)
    if name != "interleaved" and chunks != 1:
        raise PlanError(
            f"{what}: chunks={chunks} needs the 'interleaved' schedule; {name!r} allows chunks=1 only"
        )
    if name != "pipedream" and vertical_sync:
        raise PlanError(f"{what}: vertical_sync=True is only allowed for the 'pipedream' schedule")
    if name != "2bw" and update_every is not None:
        raise PlanError(
            f"{what}: update_every={update_every} is only allowed for the '2bw' schedule "
            "(the others step once per flush, or after every micro-batch for 'pipedream')"
        )
    match name:
        case "gpipe":
            return gpipe(stages, microbatches, recompute=recompute)
        case "1f1b":
            return one_f_one_b(stages, microbatches, recompute=recompute)
        case "interleaved":
            return interleaved(stages, microbatches, chunks, recompute=recompute)
        case "pipedream":
            return pipedream(stages, microbatches, vertical_sync=vertical_sync, recompute=recompute)
        case _:
            return two_bw(stages, microbatches, update_every=update_every, recompute=recompute)
