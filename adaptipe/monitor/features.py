"""One fixed-length feature vector from a device sample of either source.

The interference model and the speed predictor are trained on traces from GPU and CPU
machines alike, so both sources map into the same ordered features. A feature that a
source does not have is 0, and ``is_gpu`` tells the model which source it sees. Values
are scaled to roughly [0, 1] (fractions) or compressed with log1p (rates), because the
LSTM is sensitive to scale and the random forest does not mind.

=====================  ================================================================
feature                meaning (GPU source / CPU source)
=====================  ================================================================
is_gpu                 1 for NVML samples, 0 for CPU samples
util                   GPU busy fraction / system CPU busy fraction
proc_util              - / this process's share of all CPUs
mem_util               memory-controller busy fraction / -
mem_used_frac          device memory used / host memory used (total - available)
io_tx                  PCIe bytes sent from the GPU, log1p(GB/s) / -
io_rx                  PCIe bytes received by the GPU, log1p(GB/s) / -
clock_ratio            SM clock / max SM clock; CPU frequency / max frequency
power_frac             power draw / enforced power limit / -
temperature            degrees C / 100 / -
run_queue              - / runnable tasks per CPU
ctx_switch_rate        - / log1p(system context switches per s per CPU / 1000)
involuntary_ctx_rate   - / log1p(this process's involuntary switches per s / 100)
sm_occupancy           GPM active warps / maximum / -
tensor_util            GPM tensor-core busy fraction / -
dram_bw_util           GPM DRAM bandwidth used / peak / -
bar1_used_frac         BAR1 used / total / -
rss_frac               - / this process's RSS / host memory
=====================  ================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from adaptipe.monitor.schema import DeviceSample

__all__ = ["FEATURES", "feature_vector"]

Fields = Mapping[str, float]


def _get(f: Fields, name: str, scale: float = 1.0) -> float:
    return f.get(name, 0.0) * scale


def _ratio(f: Fields, num: str, den: str) -> float:
    d = f.get(den, 0.0)
    return f.get(num, 0.0) / d if num in f and d > 0 else 0.0


def _log1p(f: Fields, name: str, scale: float) -> float:
    return math.log1p(max(f.get(name, 0.0), 0.0) * scale)


def _per_cpu(f: Fields, name: str) -> float:
    return f.get(name, 0.0) / max(f.get("num_cpus", 1.0), 1.0)


_SPECS: tuple[tuple[str, Callable[[DeviceSample], float]], ...] = (
    ("is_gpu", lambda s: 1.0 if s.source == "nvml" else 0.0),
    ("util", lambda s: _get(s.fields, "util_pct", 0.01)),
    ("proc_util", lambda s: _get(s.fields, "proc_util_pct", 0.01)),
    ("mem_util", lambda s: _get(s.fields, "mem_util_pct", 0.01)),
    ("mem_used_frac", lambda s: _ratio(s.fields, "mem_used_bytes", "mem_total_bytes")),
    ("io_tx", lambda s: _log1p(s.fields, "pcie_tx_Bps", 1e-9)),
    ("io_rx", lambda s: _log1p(s.fields, "pcie_rx_Bps", 1e-9)),
    ("clock_ratio", lambda s: _ratio(s.fields, "clock_mhz", "clock_max_mhz")),
    ("power_frac", lambda s: _ratio(s.fields, "power_w", "power_limit_w")),
    ("temperature", lambda s: _get(s.fields, "temperature_c", 0.01)),
    ("run_queue", lambda s: _per_cpu(s.fields, "run_queue")),
    (
        "ctx_switch_rate",
        lambda s: math.log1p(max(_per_cpu(s.fields, "ctx_switches_per_s"), 0.0) / 1000),
    ),
    ("involuntary_ctx_rate", lambda s: _log1p(s.fields, "proc_ctx_involuntary_per_s", 0.01)),
    ("sm_occupancy", lambda s: _get(s.fields, "gpm_sm_occupancy_pct", 0.01)),
    ("tensor_util", lambda s: _get(s.fields, "gpm_tensor_util_pct", 0.01)),
    ("dram_bw_util", lambda s: _get(s.fields, "gpm_dram_bw_util_pct", 0.01)),
    ("bar1_used_frac", lambda s: _ratio(s.fields, "bar1_used_bytes", "bar1_total_bytes")),
    ("rss_frac", lambda s: _ratio(s.fields, "rss_bytes", "mem_total_bytes")),
)

#: Feature names in vector order; the module docstring documents each one.
FEATURES: tuple[str, ...] = tuple(name for name, _ in _SPECS)


def feature_vector(sample: DeviceSample) -> np.ndarray:
    """``sample`` as a float64 vector of ``len(FEATURES)`` values, in FEATURES order."""
    return np.fromiter((fn(sample) for _, fn in _SPECS), dtype=np.float64, count=len(_SPECS))
