"""What one iteration (or window) cost a stage: `IterationStats`, the executor's report."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["IterationStats"]


@dataclass(slots=True)
class IterationStats:
    """What one iteration cost this stage (seconds) and, on the last stage, the loss."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    comm_s: float = 0.0
    iteration_s: float = 0.0
    loss: float | None = None  # mean over micro-batches (and, of each job's mean, over jobs)
    losses: dict[int, float] = field(default_factory=dict)  # per job, summed over micro-batches
    microbatch_losses: dict[tuple[int, int], float] = field(default_factory=dict)  # (job, mb)
    # Per global layer: forward time measured layer by layer; backward time is measured per
    # chunk and split across its layers in proportion to their forward time (autograd runs
    # a chunk's backward as one call); batched weight gradients, computed at the step for
    # the whole stage, are split the same way over all its layers.
    layer_forward_s: dict[int, float] = field(default_factory=dict)
    layer_backward_s: dict[int, float] = field(default_factory=dict)
    max_in_flight: int = 0
    # Job-arrays: the most job states resident at once, the time blocks waited for
    # offloaded ones and how many were loaded only when needed (`MemoryManager`).
    resident_jobs: int = 0
    state_wait_s: float = 0.0
    state_misses: int = 0
    cut_at: int | None = None  # a window ended before this round (a plan came); None: all ran
