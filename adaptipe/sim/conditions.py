"""A partition's iterations under changing conditions: the simulator for the adaptive
controllers and their environments.

`LayerCosts` holds a model's per-layer costs per micro-batch (a profile's, or the
measured ones a controller observed); `iteration_times` sums them over the stages of a
partition and runs the schedule (`adaptipe.sim.engine.simulate_iterations`) for as many
iterations as there are rows of conditions: per iteration a slowdown per stage and a
bandwidth per stage boundary (both directions). Iterations whose bandwidths are equal
run as one vectorised block; the pipeline starts each block empty, as the synchronous
schedules do every iteration anyway. `first_iteration_times` is one iteration from an
empty pipeline for many partitions at once (a controller's candidates): the same
seconds, bit for bit, at a fraction of the cost.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError
from adaptipe.profile.types import Profile
from adaptipe.schedule.build import build_schedule
from adaptipe.schedule.types import Schedule
from adaptipe.sim.costs import CostModel
from adaptipe.sim.dag import (
    COMP,
    COMPUTE,
    KIND,
    LINK,
    SEND,
    STEP,
    VSTAGE,
    WORKER,
    XFER,
    compile_schedule,
)
from adaptipe.sim.dag import GRAD as GRAD_ROW
from adaptipe.sim.engine import simulate_iterations

__all__ = ["LayerCosts", "first_iteration_times", "iteration_times", "unlimited"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCosts:
    """Per layer and micro-batch: forward, backward and optimizer seconds, the bytes of
    the layer's output (sent forward across a cut after it) and of the gradient into it
    (sent backward across a cut before it); an iteration is ``microbatches`` of
    ``samples_per_microbatch`` samples through ``schedule``."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    gradient_bytes: tuple[int, ...]
    update_s: tuple[float, ...] = ()
    microbatches: int = 1
    samples_per_microbatch: int = 1
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        for name in ("backward_s", "activation_bytes", "gradient_bytes"):
            if len(getattr(self, name)) != n:
                raise PlanError(
                    f"LayerCosts: {name} has {len(getattr(self, name))} layers, not {n}"
                )
        if self.update_s and len(self.update_s) != n:
            raise PlanError(f"LayerCosts: update_s has {len(self.update_s)} layers, not {n}")
        if self.microbatches < 1 or self.samples_per_microbatch < 1:
            raise PlanError("LayerCosts: microbatches and samples_per_microbatch must be >= 1")

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    @property
    def samples_per_iteration(self) -> int:
        return self.microbatches * self.samples_per_microbatch

    @classmethod
    def from_profile(
        cls, profile: Profile, *, microbatches: int, schedule: str = "1f1b"
    ) -> LayerCosts:
        """A profile's layers (per micro-batch of ``profile.microbatch`` samples)."""
        layers = profile.layers
        return cls(
            forward_s=tuple(x.forward_s for x in layers),
            backward_s=tuple(x.backward_s for x in layers),
            activation_bytes=tuple(int(x.activation_bytes) for x in layers),
            gradient_bytes=tuple(int(x.gradient_bytes) for x in layers),
            update_s=tuple(x.update_s for x in layers),
            microbatches=microbatches,
            samples_per_microbatch=profile.microbatch,
            schedule=schedule,
        )

    def check_partition(self, bounds: Sequence[int]) -> None:
        """Raise `PlanError` unless ``bounds`` partitions the layers."""
        if (
            bounds[0] != 0
            or bounds[-1] != self.num_layers
            or any(a >= b for a, b in itertools.pairwise(bounds))
        ):
            raise PlanError(
                f"LayerCosts: {list(bounds)} is not a partition of {self.num_layers} layers "
                "(increasing, from 0 to the layer count)"
            )

    def cost_model(self, bounds: Sequence[int], bandwidth_Bps: Sequence[float]) -> CostModel:
        """The simulator's costs of partition ``bounds`` with link ``s <-> s + 1`` at
        ``bandwidth_Bps[s]`` in both directions (inf: free)."""
        stages = len(bounds) - 1
        self.check_partition(bounds)
        if len(bandwidth_Bps) != stages - 1:
            raise PlanError(
                f"LayerCosts: {len(bandwidth_Bps)} bandwidths for {stages - 1} stage boundaries"
            )

        def per_stage(values: Sequence[float]) -> list[float]:
            return [float(sum(values[bounds[s] : bounds[s + 1]])) for s in range(stages)]

        links = {}
        for s, bw in enumerate(bandwidth_Bps):
            links[(s, s + 1)] = links[(s + 1, s)] = (float(bw), 0.0)
        return CostModel(
            forward_s=[per_stage(self.forward_s)],
            backward_s=[per_stage(self.backward_s)],
            update_s=[per_stage(self.update_s)] if self.update_s else (),
            activation_bytes=[[self.activation_bytes[bounds[s + 1] - 1] for s in range(stages)]],
            gradient_bytes=[[self.gradient_bytes[bounds[s]] for s in range(stages)]],
            links=links,
            samples_per_microbatch=self.samples_per_microbatch,
        )


@functools.lru_cache(maxsize=64)
def _schedule(name: str, stages: int, microbatches: int) -> Schedule:
    return build_schedule(name, stages=stages, microbatches=microbatches)


def iteration_times(
    costs: LayerCosts,
    bounds: Sequence[int],
    slowdown: npt.ArrayLike,
    bandwidth_Bps: npt.ArrayLike,
) -> FloatArray:
    """Seconds of each iteration of partition ``bounds``: ``slowdown`` is ``(K, stages)``,
    ``bandwidth_Bps`` ``(K, stages - 1)`` (inf: unlimited); returns ``(K,)``."""
    slow = np.asarray(slowdown, dtype=np.float64)
    stages = len(bounds) - 1
    bws = np.asarray(bandwidth_Bps, dtype=np.float64).reshape(len(slow), stages - 1)
    if slow.ndim != 2 or slow.shape[1] != stages:
        raise PlanError(f"iteration_times: slowdown must be (K, {stages}) (got {slow.shape})")
    schedule = _schedule(costs.schedule, stages, costs.microbatches)
    out = np.empty(len(slow))
    start = 0
    while start < len(slow):
        end = start + 1
        while end < len(slow) and np.array_equal(bws[end], bws[start]):
            end += 1
        model = costs.cost_model(bounds, [float(b) for b in bws[start]])
        result = simulate_iterations(schedule, model, end - start, slowdown=slow[start:end])
        out[start:end] = result.iteration_s
        start = end
    return out


@dataclass(frozen=True, slots=True)
class _Program:
    """A one-job, one-chunk schedule's DAG as `first_iteration_times` walks it."""

    kinds: list[int]
    workers: list[int]
    links: list[int]
    xfers: list[int]
    compute: npt.NDArray[np.int64]  # ops that compute (COMPUTE or STEP), in order
    merge: list[int]  # starts of runs of one worker's consecutive compute ops
    column: dict[int, int]  # op -> its run's column
    ops: npt.NDArray[np.int64]
    link_pairs: npt.NDArray[np.int64]  # per link: its stage boundary (stages - 1: none)


@functools.lru_cache(maxsize=64)
def _program(name: str, stages: int, microbatches: int) -> _Program | None:
    schedule = _schedule(name, stages, microbatches)
    if schedule.num_jobs != 1 or schedule.num_chunks != 1:
        return None
    c = compile_schedule(schedule)
    kinds, workers, links, xfers = (c.ops[r].tolist() for r in (KIND, WORKER, LINK, XFER))
    comp = [k for k, kind in enumerate(kinds) if kind <= STEP]
    # the same runs as engine._maxplus_block sums, so the sums round the same way
    merge = [
        j
        for j, k in enumerate(comp)
        if j == 0 or comp[j - 1] != k - 1 or workers[k] != workers[k - 1]
    ]
    return _Program(
        kinds=kinds,
        workers=workers,
        links=links,
        xfers=xfers,
        compute=np.asarray(comp, dtype=np.int64),
        merge=merge,
        column={comp[p]: j for j, p in enumerate(merge)},
        ops=c.ops,
        link_pairs=np.asarray(
            [min(a, b) if abs(a - b) == 1 else stages - 1 for a, b in c.links], dtype=np.int64
        ),
    )


def first_iteration_times(
    costs: LayerCosts,
    partitions: Sequence[Sequence[int]],
    slowdown: npt.ArrayLike,
    bandwidth_Bps: npt.ArrayLike,
) -> FloatArray:
    """Seconds of one iteration from an empty pipeline of each of ``partitions`` (one
    stage count): ``slowdown`` ``(P, stages)``, ``bandwidth_Bps`` ``(P, stages - 1)``.

    Each is ``iteration_times(costs, partitions[p], slowdown[p:p+1], bandwidth_Bps[p:p+1])``
    to the last bit: the schedule's DAG is walked once for all partitions, carrying each
    one's finish times where `simulate_iterations` carries max-plus matrices (from a zero
    state the maximum over a matrix row is that finish time, as rounding is monotonic).
    """
    P = len(partitions)
    stages = len(partitions[0]) - 1 if P else 1
    slow = np.asarray(slowdown, dtype=np.float64).reshape(P, stages)
    bws = np.asarray(bandwidth_Bps, dtype=np.float64).reshape(P, stages - 1)
    prog = _program(costs.schedule, stages, costs.microbatches) if P else None
    if prog is None:
        return np.asarray(
            [
                iteration_times(costs, b, slow[p : p + 1], bws[p : p + 1])[0]
                for p, b in enumerate(partitions)
            ]
        )
    if np.any(slow <= 0) or not np.all(np.isfinite(slow)) or np.any(bws <= 0):
        raise PlanError("first_iteration_times: slowdowns must be finite and > 0, bandwidths > 0")
    fwd, bwd, upd, act, grad = (np.empty((P, stages)) for _ in range(5))
    sums: dict[tuple[int, int], tuple[float, float, float]] = {}
    for p, bounds in enumerate(partitions):
        if len(bounds) != stages + 1:
            raise PlanError(
                f"first_iteration_times: {list(bounds)} has not the {stages} stages of the first"
            )
        costs.check_partition(bounds)
        for s in range(stages):
            a, b = bounds[s], bounds[s + 1]
            hit = sums.get((a, b))
            if hit is None:  # Python's sum, as LayerCosts.cost_model adds them
                hit = sums[(a, b)] = (
                    float(sum(costs.forward_s[a:b])),
                    float(sum(costs.backward_s[a:b])),
                    float(sum(costs.update_s[a:b])) if costs.update_s else 0.0,
                )
            fwd[p, s], bwd[p, s], upd[p, s] = hit
            act[p, s] = costs.activation_bytes[b - 1]
            grad[p, s] = costs.gradient_bytes[a]
    ops = prog.ops
    work = np.zeros((P, ops.shape[1]))
    on = ops[KIND] == COMPUTE  # forward, backward, recompute (a forward's cost)
    table = np.stack([fwd, bwd, fwd])
    work[:, on] = table[ops[COMP, on], :, ops[VSTAGE, on]].T
    step = ops[KIND] == STEP
    work[:, step] = upd[:, ops[WORKER, step]]
    work *= slow[:, ops[WORKER]]
    merged = np.add.reduceat(work[:, prog.compute], prog.merge, axis=1)
    send = np.flatnonzero((ops[KIND] == SEND) & (ops[LINK] >= 0))
    nbytes = np.where(
        ops[GRAD_ROW, send] > 0, grad[:, ops[VSTAGE, send]], act[:, ops[VSTAGE, send]]
    )
    free = np.hstack([bws, np.full((P, 1), math.inf)])  # a link no boundary names is free
    bw = free[:, prog.link_pairs[ops[LINK, send]]]
    xfer = np.zeros((P, ops.shape[1]))
    xfer[:, send] = np.where(nbytes > 0, nbytes / bw, 0.0)
    T = [np.zeros(P) for _ in range(stages)]
    L = [np.zeros(P) for _ in prog.link_pairs]
    arrival: dict[int, FloatArray] = {}
    for k, kind in enumerate(prog.kinds):
        s = prog.workers[k]
        if kind <= STEP:
            j = prog.column.get(k)
            if j is not None:
                T[s] = T[s] + merged[:, j]
        elif kind == SEND:
            lk = prog.links[k]
            if lk < 0:
                arrival[prog.xfers[k]] = T[s] + xfer[:, k]
            else:
                L[lk] = arrival[prog.xfers[k]] = np.maximum(T[s], L[lk]) + xfer[:, k]
        else:
            T[s] = np.maximum(T[s], arrival.pop(prog.xfers[k]))
    out: FloatArray = np.max(np.stack(T), axis=0)
    return out


def unlimited(stages: int, iterations: int = 1) -> FloatArray:
    """``(iterations, stages - 1)`` bandwidths that never bind."""
    return np.full((iterations, max(stages - 1, 0)), math.inf)
