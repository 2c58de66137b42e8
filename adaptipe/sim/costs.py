"""`CostModel`: what every instruction of a schedule costs, for the simulator.

Times are per micro-batch and per *virtual* stage ``g`` (model order; worker ``g % S``
holds it as chunk ``g // S``), indexed ``[job][g]`` so job-arrays can mix models.
Transfers follow the usual latency-bandwidth (alpha-beta) model: ``n`` bytes over the
directed link ``src -> dst`` take ``latency + n / bandwidth`` seconds, one transfer at a
time per direction (full duplex). ``slowdown[s]`` multiplies worker ``s``'s compute and
optimizer time, modelling interference from co-located work.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptipe.errors import PlanError
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.schedule.types import Schedule
from adaptipe.serial import check_kind, get_float, get_int, get_list

__all__ = ["COSTS_VERSION", "CostModel"]

COSTS_VERSION = 1

FloatArray = npt.NDArray[np.float64]
Row = Sequence[float] | npt.NDArray[Any]
Table = Sequence[Row] | npt.NDArray[Any]
"""A ``[job][vstage]`` table (nested sequences or a 2-D array); stored as tuples."""
Link = tuple[int, int]

# Per-job tables ([job][vstage]); the first two are required, the rest default.
_JOB_TIMES = ("forward_s", "backward_s", "recompute_s", "update_s", "switch_s")
_JOB_BYTES = ("activation_bytes", "gradient_bytes", "saved_bytes", "input_bytes", "wgrad_bytes")
_STAGE_BYTES = ("param_bytes", "optimizer_bytes")


def _table(
    value: Any, name: str, shape: tuple[int, int] | None, *, integer: bool
) -> tuple[tuple[Any, ...], ...]:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise PlanError(
            f"cost model: {name} must be a table of numbers (got {value!r:.80})"
        ) from None
    if arr.ndim != 2 or (shape is not None and arr.shape != shape):
        want = f"{shape[0]} x {shape[1]}" if shape else "jobs x virtual stages"
        raise PlanError(f"cost model: {name} must be a {want} table (got shape {arr.shape})")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise PlanError(f"cost model: {name} must hold finite numbers >= 0")
    cast = int if integer else float
    return tuple(tuple(cast(v) for v in row) for row in arr.tolist())


def _check_number(
    value: float, name: str, *, positive: bool = False, allow_inf: bool = False
) -> float:
    v = float(value)
    if math.isnan(v) or (math.isinf(v) and not allow_inf) or v < 0 or (positive and v == 0):
        need = "> 0" if positive else ">= 0"
        raise PlanError(f"cost model: {name} must be a number {need} (got {value!r})")
    return v


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-instruction costs: compute per ``[job][vstage]``, links per directed worker pair.

    Attributes:
        forward_s, backward_s: compute seconds of one micro-batch through virtual stage g.
        recompute_s: seconds of a `Recompute` (empty: equal to ``forward_s``).
        update_s: seconds of the optimizer step of stage g; a worker's `OptimizerStep`
            for job j costs the sum over its chunks (empty: zero). With batched weight
            gradients it includes computing them.
        switch_s: seconds added before a compute instruction whose job differs from the
            worker's previous compute instruction (job-array context switch; empty: zero;
            not scaled by ``slowdown`` and not counted as busy time).
        activation_bytes: bytes of g's output (sent forward). gradient_bytes: bytes of the
            gradient w.r.t. g's input (sent backward). saved_bytes: activations g keeps per
            in-flight micro-batch. input_bytes: what g keeps instead under recompute.
            wgrad_bytes: what a micro-batch's backward through g keeps until the job's
            optimizer step (batched weight gradients; empty: zero).
        param_bytes, optimizer_bytes: per virtual stage (shared shape across jobs).
        bandwidth_Bps, latency_s: default for every directed link (inf and 0: free).
        links: per directed link ``(src, dst) -> (bandwidth_Bps, latency_s)`` overrides.
        slowdown: per-worker factor on compute and step time (empty: all 1.0).
        samples_per_microbatch: samples in one micro-batch, for samples/s.
    """

    forward_s: Table
    backward_s: Table
    recompute_s: Table = ()
    update_s: Table = ()
    switch_s: Table = ()
    activation_bytes: Table = ()
    gradient_bytes: Table = ()
    saved_bytes: Table = ()
    input_bytes: Table = ()
    wgrad_bytes: Table = ()
    param_bytes: Row = ()
    optimizer_bytes: Row = ()
    bandwidth_Bps: float = math.inf
    latency_s: float = 0.0
    links: Mapping[Link, tuple[float, float]] = field(default_factory=dict)
    slowdown: Row = ()
    samples_per_microbatch: int = 1
    _arrays: dict[str, FloatArray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fwd = _table(self.forward_s, "forward_s", None, integer=False)
        shape = (len(fwd), len(fwd[0]) if fwd else 0)
        if shape[0] < 1 or shape[1] < 1:
            raise PlanError("cost model: forward_s needs at least one job and one virtual stage")
        object.__setattr__(self, "forward_s", fwd)
        defaults = {"recompute_s": fwd}
        for name in (*_JOB_TIMES[1:], *_JOB_BYTES):
            raw = getattr(self, name)
            if len(raw) == 0:
                raw = defaults.get(name, np.zeros(shape))
            object.__setattr__(self, name, _table(raw, name, shape, integer=name in _JOB_BYTES))
        for name in _STAGE_BYTES:
            raw = getattr(self, name)
            if len(raw) == 0:
                raw = [0] * shape[1]
            row = _table([raw], name, (1, shape[1]), integer=True)[0]
            object.__setattr__(self, name, row)
        object.__setattr__(
            self,
            "bandwidth_Bps",
            _check_number(self.bandwidth_Bps, "bandwidth_Bps", positive=True, allow_inf=True),
        )
        object.__setattr__(self, "latency_s", _check_number(self.latency_s, "latency_s"))
        links: dict[Link, tuple[float, float]] = {}
        for key, (bw, lat) in sorted(dict(self.links).items()):
            src, dst = (int(k) for k in key)
            where = f"links[{src}->{dst}]"
            if src < 0 or dst < 0:
                raise PlanError(f"cost model: {where} names a negative worker")
            links[(src, dst)] = (
                _check_number(bw, where + ".bandwidth_Bps", positive=True, allow_inf=True),
                _check_number(lat, where + ".latency_s"),
            )
        object.__setattr__(self, "links", links)
        slow = tuple(_check_number(v, "slowdown", positive=True) for v in self.slowdown)
        object.__setattr__(self, "slowdown", slow)
        if isinstance(self.samples_per_microbatch, bool) or self.samples_per_microbatch < 1:
            raise PlanError(
                f"cost model: samples_per_microbatch must be an integer >= 1 (got {self.samples_per_microbatch!r})"
            )
        arrays = {
            n: np.asarray(getattr(self, n), dtype=np.float64)
            for n in (*_JOB_TIMES, *_JOB_BYTES, *_STAGE_BYTES)
        }
        for arr in arrays.values():
            arr.flags.writeable = False
        object.__setattr__(self, "_arrays", arrays)

    # -- shape and look-ups -------------------------------------------------------------

    @property
    def num_jobs(self) -> int:
        return len(self.forward_s)

    @property
    def num_vstages(self) -> int:
        return len(self.forward_s[0])

    def array(self, name: str) -> FloatArray:
        """Read-only float64 numpy view of a table (``[job][g]`` or ``[g]``)."""
        return self._arrays[name]

    def link(self, src: int, dst: int) -> tuple[float, float]:
        """``(bandwidth_Bps, latency_s)`` of the directed link ``src -> dst``."""
        return self.links.get((src, dst), (self.bandwidth_Bps, self.latency_s))

    def transfer_s(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over ``src -> dst``: latency + bytes / bandwidth."""
        bw, lat = self.link(src, dst)
        return lat + (nbytes / bw if nbytes else 0.0)

    def slowdowns(self, num_workers: int) -> FloatArray:
        """Per-worker slowdown factors for ``num_workers`` workers (all 1.0 if unset)."""
        if not self.slowdown:
            return np.ones(num_workers)
        if len(self.slowdown) != num_workers:
            raise PlanError(
                f"cost model: slowdown has {len(self.slowdown)} entries but the schedule has {num_workers} workers"
            )
        return np.asarray(self.slowdown, dtype=np.float64)

    def with_slowdown(self, slowdown: Sequence[float]) -> CostModel:
        """A copy with per-worker ``slowdown`` factors (interference)."""
        return replace(self, slowdown=tuple(slowdown))

    def check_schedule(self, schedule: Schedule) -> None:
        """Raise `PlanError` unless this model covers ``schedule``'s stages and jobs."""
        if self.num_vstages != schedule.num_virtual_stages:
            raise PlanError(
                f"cost model: has {self.num_vstages} virtual stages but schedule {schedule.name!r} "
                f"has {schedule.num_virtual_stages} ({schedule.num_stages} workers x {schedule.num_chunks} chunks)"
            )
        if self.num_jobs not in (1, schedule.num_jobs):
            raise PlanError(
                f"cost model: has {self.num_jobs} jobs but schedule {schedule.name!r} has {schedule.num_jobs} (give 1 to share)"
            )
        self.slowdowns(schedule.num_stages)

    # -- constructors --------------------------------------------------------------------

    @classmethod
    def uniform(
        cls, num_vstages: int, *, jobs: int = 1, forward: float = 1.0, backward: float = 2.0
    ) -> CostModel:
        """Identical compute on every virtual stage and job, no communication."""
        if num_vstages < 1 or jobs < 1:
            raise PlanError(
                f"cost model: uniform needs num_vstages >= 1 and jobs >= 1 (got {num_vstages}, {jobs})"
            )
        return cls(
            forward_s=[[forward] * num_vstages] * jobs, backward_s=[[backward] * num_vstages] * jobs
        )

    @classmethod
    def uniform_for(
        cls, schedule: Schedule, *, forward: float = 1.0, backward: float = 2.0
    ) -> CostModel:
        """Uniform per-*worker* costs: each of V chunks gets forward/V and backward/V, so a
        worker's compute per micro-batch is ``forward + backward`` whatever V is."""
        v = schedule.num_chunks
        return cls.uniform(
            schedule.num_virtual_stages,
            jobs=schedule.num_jobs,
            forward=forward / v,
            backward=backward / v,
        )

    @classmethod
    def from_profile(
        cls,
        profile: Profile,
        partition: Partition,
        *,
        bandwidth_Bps: float = math.inf,
        latency_s: float = 0.0,
        links: Mapping[Link, tuple[float, float]] | None = None,
        slowdown: Sequence[float] | None = None,
        batch_weight_grads: bool = False,
        microbatches: int | None = None,
    ) -> CostModel:
        """Sum a per-layer profile over each virtual stage of ``partition`` (one job).

        A stage sends its last layer's activation and its first layer's input gradient;
        under recompute it keeps its input (the previous layer's output, or the
        profile's ``input_bytes`` for stage 0).

        With ``batch_weight_grads`` (the run's ``[pipeline].batch_weight_grads``), a
        micro-batch's backward costs the profile's ``backward_input_s`` and keeps
        ``wgrad_bytes`` until the step, which also computes the deferred weight
        gradients, ``wgrad_s`` per layer. That was
        measured for ``profile.wgrad_microbatches`` micro-batches; for ``microbatches``
        others it is scaled in proportion (one GEMM, linear in its rows).
        """
        partition.check_model(
            model=profile.model, num_layers=profile.num_layers, source="cost model"
        )
        wgrad_scale = 0.0
        if batch_weight_grads:
            if not profile.has_batched_wgrad:
                raise PlanError(
                    f"cost model: profile of {profile.model!r} has no batched weight-gradient "
                    "timings (backward_input_s, wgrad_s); profile with wgrad_microbatches = "
                    "the run's micro-batches"
                )
            if microbatches is not None and microbatches < 1:
                raise PlanError(f"cost model: microbatches must be >= 1 (got {microbatches})")
            wgrad_scale = (microbatches or profile.wgrad_microbatches) / profile.wgrad_microbatches
        rows: dict[str, list[float]] = {
            k: [] for k in ("f", "b", "u", "act", "grad", "saved", "inp", "wg", "par", "opt")
        }
        for g in range(partition.num_stages):
            layers = [profile.layers[i] for i in partition.layers(g)]
            first = partition.bounds[g]
            rows["f"].append(sum(x.forward_s for x in layers))
            if batch_weight_grads:
                rows["b"].append(sum(x.backward_input_s or 0.0 for x in layers))
                wgrad = sum(x.wgrad_s or 0.0 for x in layers)
                rows["u"].append(sum(x.update_s for x in layers) + wgrad * wgrad_scale)
                rows["wg"].append(sum(x.wgrad_bytes or 0 for x in layers))
            else:
                rows["b"].append(sum(x.backward_s for x in layers))
                rows["u"].append(sum(x.update_s for x in layers))
                rows["wg"].append(0)
            rows["act"].append(layers[-1].activation_bytes)
            rows["grad"].append(layers[0].gradient_bytes)
            rows["saved"].append(sum(x.saved_bytes for x in layers))
            rows["inp"].append(
                profile.layers[first - 1].activation_bytes if first else profile.input_bytes
            )
            rows["par"].append(sum(x.param_bytes for x in layers))
            rows["opt"].append(sum(x.optimizer_bytes for x in layers))
        return cls(
            forward_s=[rows["f"]],
            backward_s=[rows["b"]],
            update_s=[rows["u"]],
            activation_bytes=[rows["act"]],
            gradient_bytes=[rows["grad"]],
            saved_bytes=[rows["saved"]],
            input_bytes=[rows["inp"]],
            wgrad_bytes=[rows["wg"]],
            param_bytes=rows["par"],
            optimizer_bytes=rows["opt"],
            bandwidth_Bps=bandwidth_Bps,
            latency_s=latency_s,
            links=dict(links or {}),
            slowdown=tuple(slowdown or ()),
            samples_per_microbatch=profile.microbatch,
        )

    # -- JSON ----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Versioned JSON; infinite bandwidths are written as null."""

        def bw(v: float) -> float | None:
            return None if math.isinf(v) else v

        out: dict[str, Any] = {"kind": "costs", "version": COSTS_VERSION}
        for name in (*_JOB_TIMES, *_JOB_BYTES):
            out[name] = [list(row) for row in getattr(self, name)]
        for name in _STAGE_BYTES:
            out[name] = list(getattr(self, name))
        out["bandwidth_Bps"] = bw(self.bandwidth_Bps)
        out["latency_s"] = self.latency_s
        out["links"] = [
            {"src": s, "dst": d, "bandwidth_Bps": bw(b), "latency_s": lat}
            for (s, d), (b, lat) in self.links.items()
        ]
        out["slowdown"] = list(self.slowdown)
        out["samples_per_microbatch"] = self.samples_per_microbatch
        return out

    @classmethod
    def from_json(cls, data: Any, *, source: str = "costs") -> CostModel:
        check_kind(data, kind="costs", version=COSTS_VERSION, source=source)

        def bw(raw: Any, prefix: str) -> float:
            if raw.get("bandwidth_Bps") is None:
                return math.inf
            return get_float(raw, "bandwidth_Bps", source=source, prefix=prefix, minimum=0.0)

        links: dict[Link, tuple[float, float]] = {}
        for i, raw in enumerate(get_list(data, "links", source=source, default=[])):
            p = f"links[{i}]."
            key = (
                get_int(raw, "src", source=source, prefix=p, minimum=0),
                get_int(raw, "dst", source=source, prefix=p, minimum=0),
            )
            links[key] = (
                bw(raw, p),
                get_float(raw, "latency_s", source=source, prefix=p, minimum=0.0),
            )
        kwargs: dict[str, Any] = {
            n: get_list(data, n, source=source, default=[])
            for n in (*_JOB_TIMES, *_JOB_BYTES, *_STAGE_BYTES)
        }
        try:
            return cls(
                **kwargs,
                bandwidth_Bps=bw(data, ""),
                latency_s=get_float(data, "latency_s", source=source, minimum=0.0, default=0.0),
                links=links,
                slowdown=[float(v) for v in get_list(data, "slowdown", source=source, default=[])],
                samples_per_microbatch=get_int(
                    data, "samples_per_microbatch", source=source, minimum=1, default=1
                ),
            )
        except (PlanError, TypeError, ValueError) as exc:
            raise PlanError(f"{source}: {str(exc).removeprefix('cost model: ')}") from None
