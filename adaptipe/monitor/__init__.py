"""Telemetry: stage statistics and device samples over ZeroMQ to the manager.

Stages run a :class:`Publisher` (non-blocking, drops and counts rather than waiting)
with a :class:`DeviceSampler` thread (NVML on a GPU, /proc on CPU); the manager runs a
:class:`Collector` that validates every frame against :mod:`adaptipe.monitor.schema`.
Controllers read device samples through :func:`feature_vector`.
"""

from __future__ import annotations

from adaptipe.monitor.bandwidth import LinkMeter, probe
from adaptipe.monitor.collector import Collector
from adaptipe.monitor.device import sample_device
from adaptipe.monitor.features import FEATURES, feature_vector
from adaptipe.monitor.publisher import CurveKeys, DeviceSampler, Publisher
from adaptipe.monitor.schema import (
    SCHEMA_VERSION,
    DeviceSample,
    Event,
    LinkSample,
    MonitorError,
    Record,
    StageStats,
    TelemetryError,
    decode,
)

__all__ = [
    "FEATURES",
    "SCHEMA_VERSION",
    "Collector",
    "CurveKeys",
    "DeviceSample",
    "DeviceSampler",
    "Event",
    "LinkMeter",
    "LinkSample",
    "MonitorError",
    "Publisher",
    "Record",
    "StageStats",
    "TelemetryError",
    "decode",
    "feature_vector",
    "probe",
    "sample_device",
]
