"""Synthetic device readings: what the runtime's CPU monitor would sample beside a stage.

The generators (`adaptipe.envs.generators`) give every row of a trace per-stage
``device`` fields named as `adaptipe.monitor.device.CpuProbe` names them, so the
observation an environment builds (`adaptipe.monitor.features.feature_vector`) is the
one the runtime builds, and a learned interference model has a signal to learn from.

The model, per stage and iteration, from the stage's slowdown ``x``, the cores its
co-located jobs keep busy ``c`` and the memory they hold ``m`` (``e``: a standard
normal draw, a fresh one for every field, row and stage; ``noise``: its scale):

=============================  ===========================================================
field                          model
=============================  ===========================================================
num_cpus                       ``num_cpus`` (constant)
util_pct                       system busy: ``100 (1 + c) / num_cpus`` (the stage's own core
                               plus the jobs'), times ``1 + noise e``, in [0, 100]
proc_cores, proc_util_pct      the stage's share of a core, ``1 / x`` (time-sliced with the
                               jobs), times ``1 + noise e``; and as a share of all CPUs
run_queue                      runnable tasks: ``1 + Poisson(c + 0.2)``
procs_blocked                  0
ctx_switches_per_s             ``(1500 + 1200 c) exp(noise e)``
proc_ctx_voluntary_per_s       ``200 exp(noise e)`` (the stage waiting on its links)
proc_ctx_involuntary_per_s     ``(5 + 100 (x - 1)) exp(noise e)``: preempted more when slowed
mem_total_bytes                ``mem_total_gib`` GiB
mem_used_bytes                 ``4 GiB + m``, times ``1 + noise e / 10``; free is the rest
rss_bytes                      512 MiB times ``1 + noise e / 10``
clock_max_mhz, clock_mhz       3000; ``3000 (1 - 0.15 min(1, (1 + c) / num_cpus))`` times
                               ``1 + noise e / 10`` (turbo falls as more cores are busy)
=============================  ===========================================================

A slowdown with no co-located job behind it (a stage slowed by other means) moves only
the stage's own share and its involuntary switches. Values keep 5 significant digits.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

__all__ = ["FIELDS", "synthesize"]

Array = npt.NDArray[np.float64]

FIELDS = (
    "num_cpus",
    "util_pct",
    "proc_cores",
    "proc_util_pct",
    "run_queue",
    "procs_blocked",
    "ctx_switches_per_s",
    "proc_ctx_voluntary_per_s",
    "proc_ctx_involuntary_per_s",
    "mem_total_bytes",
    "mem_used_bytes",
    "mem_free_bytes",
    "rss_bytes",
    "clock_max_mhz",
    "clock_mhz",
)
_GIB = float(2**30)
_BASE_USED = 4 * _GIB
_RSS = 512 * 2.0**20
_CLOCK_MAX = 3000.0


def synthesize(
    slowdown: Array,
    cores: Array,
    memory_bytes: Array,
    *,
    rng: np.random.Generator,
    num_cpus: int,
    mem_total_gib: float,
    noise: float,
) -> list[tuple[Mapping[str, float], ...]]:
    """Per row, one readings map per stage; arrays are ``(iterations, stages)``."""
    shape = slowdown.shape

    def e() -> Array:
        return rng.standard_normal(shape)

    total = mem_total_gib * _GIB
    ncpu = float(num_cpus)
    proc = np.clip(1.0 / slowdown * (1 + noise * e()), 0.0, ncpu)
    used = np.clip((_BASE_USED + memory_bytes) * (1 + noise / 10 * e()), 0.0, total)
    busy = np.minimum(1.0, (1.0 + cores) / ncpu)
    columns: dict[str, Array] = {
        "num_cpus": np.full(shape, ncpu),
        "util_pct": np.clip(100 * (1 + cores) / ncpu * (1 + noise * e()), 0.0, 100.0),
        "proc_cores": proc,
        "proc_util_pct": np.minimum(100.0, 100 * proc / ncpu),
        "run_queue": 1.0 + rng.poisson(cores + 0.2).astype(np.float64),
        "procs_blocked": np.zeros(shape),
        "ctx_switches_per_s": (1500 + 1200 * cores) * np.exp(noise * e()),
        "proc_ctx_voluntary_per_s": 200 * np.exp(noise * e()),
        "proc_ctx_involuntary_per_s": (5 + 100 * (slowdown - 1)).clip(0.0) * np.exp(noise * e()),
        "mem_total_bytes": np.full(shape, total),
        "mem_used_bytes": used,
        "mem_free_bytes": total - used,
        "rss_bytes": _RSS * (1 + noise / 10 * e()).clip(0.1),
        "clock_max_mhz": np.full(shape, _CLOCK_MAX),
        "clock_mhz": _CLOCK_MAX * (1 - 0.15 * busy) * (1 + noise / 10 * e()),
    }
    # 5 significant digits: readings are noisy anyway, and the file stays small
    rounded = {
        k: [[float(f"{v:.5g}") for v in row] for row in a.tolist()] for k, a in columns.items()
    }
    return [
        tuple({k: rounded[k][i][s] for k in FIELDS} for s in range(shape[1]))
        for i in range(shape[0])
    ]
