"""An `Observation` as the fixed-length vector a learned controller reads.

The environments hand this vector to their agents, and the runtime's learned
controllers (the next issue) encode their live observations with the same function,
so a policy trained here reads in the manager exactly what it read in training. The
vector, for ``S`` stages, ``L`` layers and ``K`` candidates, in order:

=================  =====  ==========================================================
part               size   value
=================  =====  ==========================================================
slowdowns          S      each stage's measured over profiled seconds (window median)
cuts               S - 1  the partition in force: interior bounds over L
links              S - 1  log10(bandwidth in bytes/s) / 12 (1.0: not measured)
measured           1      the window's median iteration over the in-force prediction
candidates         K      each candidate's predicted seconds over the in-force one's
device             S x F  each stage's device features (`adaptipe.monitor.features`)
=================  =====  ==========================================================

Every value is clipped to [0, `HIGH`].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from adaptipe.controllers.observation import Observation
from adaptipe.controllers.recall import measured_iteration_s
from adaptipe.controllers.replan import predicted_time, stage_slowdowns
from adaptipe.monitor.features import FEATURES

__all__ = ["HIGH", "encode", "encoded_size"]

HIGH = 100.0


def encoded_size(stages: int, candidates: int) -> int:
    """The vector's length for ``stages`` stages and ``candidates`` candidates."""
    return stages + 2 * (stages - 1) + 1 + candidates + stages * len(FEATURES)


def encode(
    obs: Observation, candidate_s: Sequence[float], *, slowdowns: Sequence[float] | None = None
) -> npt.NDArray[np.float32]:
    """``obs`` with ``candidate_s`` (each candidate's predicted seconds per iteration,
    as `adaptipe.controllers.candidates` scores them) as a float32 vector."""
    stages, layers = obs.num_stages, obs.num_layers
    slow = tuple(slowdowns) if slowdowns is not None else stage_slowdowns(obs)
    current = predicted_time(obs, obs.bounds, slow) * obs.microbatches
    cuts = [b / layers for b in obs.bounds[1:-1]]
    links = [math.log10(bw) / 12 if math.isfinite(bw) else 1.0 for bw in obs.boundary_bandwidths()]
    now = measured_iteration_s(obs)
    measured = now / current if now is not None and current > 0 else 1.0
    ratios = [c / current if current > 0 else 1.0 for c in candidate_s]
    device = [v for row in obs.device for v in row] or [0.0] * (stages * len(FEATURES))
    vector = np.array([*slow, *cuts, *links, measured, *ratios, *device], dtype=np.float64)
    return np.clip(np.nan_to_num(vector, nan=1.0, posinf=HIGH), 0.0, HIGH).astype(np.float32)
