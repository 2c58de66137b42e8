"""Device sampling: the CPU probe's readings, the NVML path against a fake pynvml, and
one feature vector shape for both sources."""

from __future__ import annotations

import math
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from adaptipe.monitor import device
from adaptipe.monitor.device import CpuProbe, NvmlProbe, open_probe, sample_device
from adaptipe.monitor.features import FEATURES, feature_vector
from adaptipe.monitor.schema import DeviceSample

LINUX = sys.platform.startswith("linux")


@pytest.fixture(autouse=True)
def fresh_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test decides anew whether NVML exists; cached probes are not shared."""
    monkeypatch.setattr(device, "_nvml", None)
    monkeypatch.setattr(device, "_probes", {})
    yield


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(not LINUX, reason="/proc readings are Linux-only")
def test_cpu_probe_reads_every_field_in_a_sane_range() -> None:
    probe = CpuProbe()
    _burn(0.2)
    f = probe.read()
    for name in ("util_pct", "proc_util_pct"):
        assert 0.0 <= f[name] <= 100.0
    assert f["proc_cores"] > 0.3  # we just burned a core for 0.2 s
    assert 1 <= f["run_queue"] <= 10_000 and f["procs_blocked"] >= 0
    for name in ("ctx_switches_per_s", "proc_ctx_voluntary_per_s", "proc_ctx_involuntary_per_s"):
        assert f[name] >= 0.0
    assert 1 << 20 < f["rss_bytes"] < f["mem_total_bytes"]
    assert 0 < f["mem_free_bytes"] <= f["mem_total_bytes"]
    assert f["mem_used_bytes"] == pytest.approx(f["mem_total_bytes"] - f["mem_free_bytes"])
    assert f["num_cpus"] >= 1
    if "clock_mhz" in f:
        assert 10 < f["clock_mhz"] < 20_000
    idle = probe.read()  # an immediate second read covers ~no time and stays sane
    assert all(np.isfinite(v) and v >= 0 for v in idle.values())


def test_without_nvml_every_index_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert isinstance(open_probe(0), CpuProbe)
    sample = sample_device(0, stage=4)
    assert sample.source == "cpu" and sample.stage == 4
    assert device.nvml_module() is None


class _FakeNvml(types.ModuleType):
    """Just enough of pynvml: fixed readings, some calls NotSupported, GPM supported."""

    def __init__(self, *, fail_init: bool = False) -> None:
        super().__init__("pynvml")
        self.calls: dict[str, int] = {}
        self.fail_init = fail_init

        class NVMLError(Exception):
            pass

        class NVMLError_NotSupported(NVMLError):
            pass

        self.NVMLError, self.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
        consts = {
            "NVML_CLOCK_SM": 1, "NVML_CLOCK_MEM": 2, "NVML_TEMPERATURE_GPU": 0,
            "NVML_PCIE_UTIL_TX_BYTES": 0, "NVML_PCIE_UTIL_RX_BYTES": 1, "NVML_SUCCESS": 0,
            "NVML_GPM_METRICS_GET_VERSION": 1, "NVML_GPM_METRIC_SM_UTIL": 2,
            "NVML_GPM_METRIC_SM_OCCUPANCY": 3, "NVML_GPM_METRIC_ANY_TENSOR_UTIL": 5,
            "NVML_GPM_METRIC_DRAM_BW_UTIL": 10,
        }  # fmt: skip
        for k, v in consts.items():
            setattr(self, k, v)

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        if index > 0:
            raise self.NVMLError("Invalid Argument")
        return "gpu0"

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        return types.SimpleNamespace(gpu=80, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        return types.SimpleNamespace(used=60 << 30, free=20 << 30, total=80 << 30)

    def nvmlDeviceGetPcieThroughput(self, h: str, counter: int) -> int:
        return 1_000_000 if counter == 0 else 2_000_000  # KB/s

    def nvmlDeviceGetClockInfo(self, h: str, kind: int) -> int:
        return 1500 if kind == 1 else 2600

    def nvmlDeviceGetMaxClockInfo(self, h: str, kind: int) -> int:
        return 1980 if kind == 1 else 2619

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return 350_000  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h: str) -> int:
        return 700_000

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:
        self._count("temperature")
        raise self.NVMLError_NotSupported("Not Supported")

    def nvmlDeviceGetBAR1MemoryInfo(self, h: str) -> Any:
        self._count("bar1")
        raise self.NVMLError("Unknown Error")  # transient: asked again next time

    def nvmlGpmQueryDeviceSupport(self, h: str) -> Any:
        return types.SimpleNamespace(isSupportedDevice=1)

    def nvmlGpmSampleAlloc(self) -> object:
        return object()

    def nvmlGpmSampleGet(self, h: str, sample: object) -> object:
        return sample

    def nvmlGpmSampleFree(self, sample: object) -> None:
        self._count("gpm_free")

    def c_nvmlGpmMetricsGet_t(self) -> Any:
        metrics = [types.SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(8)]
        return types.SimpleNamespace(metrics=metrics)

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        assert request.sample1 is not request.sample2
        for m in request.metrics[: request.numMetrics]:
            # DRAM bandwidth: success with NaN, as an H100 (driver 580) answered.
            m.value = {2: 70.0, 3: 35.0, 5: 10.0}.get(m.metricId, math.nan)
            m.nvmlReturn = 0 if m.metricId in (2, 3, 5, 10) else 3
        return request


def test_nvml_probe_reads_fake_gpu_and_skips_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    probe = open_probe(0)
    assert isinstance(probe, NvmlProbe)
    f = probe.read()
    assert f["util_pct"] == 80 and f["mem_util_pct"] == 40
    assert (f["mem_used_bytes"], f["mem_total_bytes"]) == (60 << 30, 80 << 30)
    assert (f["pcie_tx_Bps"], f["pcie_rx_Bps"]) == (1_024_000_000, 2_048_000_000)
    assert (f["clock_mhz"], f["clock_max_mhz"], f["mem_clock_mhz"]) == (1500, 1980, 2600)
    assert (f["power_w"], f["power_limit_w"]) == (350, 700)
    assert (f["gpm_sm_util_pct"], f["gpm_sm_occupancy_pct"], f["gpm_tensor_util_pct"]) == (
        70.0,
        35.0,
        10.0,
    )
    for missing in ("temperature_c", "bar1_used_bytes", "gpm_dram_bw_util_pct"):
        assert missing not in f
    probe.read()
    assert fake.calls["temperature"] == 1  # NotSupported is not asked again
    assert fake.calls["bar1"] == 2  # other errors are
    probe.close()
    assert fake.calls["gpm_free"] == 2
    sample = sample_device(0, stage=1)
    assert sample.source == "nvml" and sample.fields["util_pct"] == 80


def test_nvml_init_failure_or_bad_index_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml())
    assert isinstance(open_probe(3), CpuProbe)  # no such GPU
    monkeypatch.setattr(device, "_nvml", None)
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(fail_init=True))
    assert isinstance(open_probe(0), CpuProbe)


def test_features_have_one_shape_and_order_for_both_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = sample_device(None)
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml())
    gpu = sample_device(0)
    assert (cpu.source, gpu.source) == ("cpu", "nvml")
    v_cpu, v_gpu = feature_vector(cpu), feature_vector(gpu)
    assert v_cpu.shape == v_gpu.shape == (len(FEATURES),)
    assert v_cpu.dtype == v_gpu.dtype == np.float64
    assert np.isfinite(v_cpu).all() and np.isfinite(v_gpu).all()
    assert len(set(FEATURES)) == len(FEATURES) and FEATURES[0] == "is_gpu"
    at = {name: i for i, name in enumerate(FEATURES)}
    assert (v_cpu[at["is_gpu"]], v_gpu[at["is_gpu"]]) == (0.0, 1.0)
    assert v_gpu[at["util"]] == pytest.approx(0.8)
    assert v_gpu[at["mem_used_frac"]] == pytest.approx(0.75)
    assert v_gpu[at["clock_ratio"]] == pytest.approx(1500 / 1980)
    assert v_gpu[at["power_frac"]] == pytest.approx(0.5)
    assert v_gpu[at["sm_occupancy"]] == pytest.approx(0.35)
    for gpu_only in ("temperature", "dram_bw_util", "run_queue", "rss_frac"):
        assert v_gpu[at[gpu_only]] == 0.0  # missing -> 0
    if LINUX:
        assert v_cpu[at["run_queue"]] > 0 and 0 < v_cpu[at["rss_frac"]] < 1
        assert v_cpu[at["sm_occupancy"]] == 0.0


def test_an_empty_sample_maps_to_zeros_but_the_flag() -> None:
    v = feature_vector(DeviceSample(stage=0, time_s=0.0, source="nvml"))
    assert v[0] == 1.0 and not v[1:].any()
