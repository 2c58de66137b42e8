"""Device readings for telemetry: NVML on a GPU, /proc and the process on CPU.

Both probes return a flat ``{name: float}`` map so the wire format and
:mod:`adaptipe.monitor.features` treat them alike. Names shared by both sources mean the
same thing: ``util_pct`` (GPU busy or system CPU busy), ``mem_used_bytes`` /
``mem_free_bytes`` / ``mem_total_bytes`` (GPU memory or host memory), ``clock_mhz`` /
``clock_max_mhz`` (SM clock or CPU frequency). Every reading is guarded: a counter this
machine does not have is simply missing from the map, never an error, because the
sampler runs beside training and must not take it down.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import resource
import threading
import time
from typing import Any, Protocol

from adaptipe.monitor.schema import DeviceSample, Source

__all__ = ["CpuProbe", "DeviceProbe", "NvmlProbe", "nvml_module", "open_probe", "sample_device"]

log = logging.getLogger(__name__)

_MAX_FREQ_FILES = 16  # cpufreq has one file per core; a few describe the package well enough
_CPUINFO_EVERY_S = 2.0  # /proc/cpuinfo is ~1 KiB per core: re-read it rarely
# (field name, pynvml constant) for GPM metrics, read where nvmlGpmMetricsGet is supported.
_GPM_METRICS = (
    ("gpm_sm_util_pct", "NVML_GPM_METRIC_SM_UTIL"),
    ("gpm_sm_occupancy_pct", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("gpm_tensor_util_pct", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    ("gpm_dram_bw_util_pct", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
)


class DeviceProbe(Protocol):
    """Something that reads one device's counters; ``read`` is called every interval."""

    source: Source

    def read(self) -> dict[str, float]: ...

    def close(self) -> None: ...


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:  # binary: a text wrapper costs ~5x the read itself
            return f.read().decode("ascii", "replace")
    except OSError:
        return None


class _Kept:
    """A /proc or /sys file kept open and re-read from its start (the kernel makes its
    text afresh at offset 0): a sample then costs one read per file, where an open, a
    read and a close cost about 3x that (the sampler reads 3 files plus one per core,
    5 times a second)."""

    _CHUNK = 1 << 16

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._pid = 0

    def read(self) -> str | None:
        try:
            if self._fd is None or self._pid != os.getpid():  # a forked child opens anew
                self.close()
                self._fd, self._pid = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC), os.getpid()
            parts = [os.pread(self._fd, self._CHUNK, 0)]
            while len(parts[-1]) == self._CHUNK:  # /proc/stat on a large machine
                parts.append(os.pread(self._fd, self._CHUNK, self._CHUNK * len(parts)))
        except OSError:
            self.close()
            return None
        return b"".join(parts).decode("ascii", "replace")

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit os may be gone already
            self.close()


class CpuProbe:
    """CPU and host-memory readings from /proc, /sys and getrusage.

    Rates (utilisation, context switches) are deltas since the previous ``read`` (the
    first since construction). Process counters come from ``getrusage`` rather than
    /proc/self/status because the latter counts only the main thread.
    """

    source: Source = "cpu"

    def __init__(self) -> None:
        self._ncpu = os.cpu_count() or 1
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        paths = sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq"))
        self._freq_paths = paths[:_MAX_FREQ_FILES]
        self._freq = [_Kept(p) for p in self._freq_paths]
        self._stat, self._meminfo = _Kept("/proc/stat"), _Kept("/proc/meminfo")
        self._statm = _Kept("/proc/self/statm")  # re-opened in a forked child: its own
        maxes = [_read(p.replace("scaling_cur_freq", "cpuinfo_max_freq")) for p in self._freq_paths]
        khz = [float(m) for m in maxes if m and m.strip().isdigit()]
        self._max_mhz = sum(khz) / len(khz) / 1000 if khz else None
        self._cpuinfo_at = -1e9
        self._cpuinfo_mhz: float | None = None
        self._last = self._counters()

    def _counters(self) -> dict[str, float]:
        out = {"wall": time.monotonic()}
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["proc_cpu"] = usage.ru_utime + usage.ru_stime
        out["nvcsw"], out["nivcsw"] = float(usage.ru_nvcsw), float(usage.ru_nivcsw)
        stat = self._stat.read()
        for line in stat.splitlines() if stat else ():
            key, _, rest = line.partition(" ")
            if key == "cpu":
                ticks = [float(x) for x in rest.split()[:8]]  # guest is already in user
                out["sys_total"] = sum(ticks)
                out["sys_busy"] = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
            elif key in ("ctxt", "procs_running", "procs_blocked"):
                out[key] = float(rest)
        return out

    def _clock_mhz(self) -> float | None:
        khz = [f.read() for f in self._freq]
        values = [float(k) / 1000 for k in khz if k and k.strip().isdigit()]
        if values:
            return sum(values) / len(values)
        now = time.monotonic()
        if now - self._cpuinfo_at >= _CPUINFO_EVERY_S:
            self._cpuinfo_at = now
            info = _read("/proc/cpuinfo") or ""
            mhz = [float(ln.split(":")[1]) for ln in info.splitlines() if ln.startswith("cpu MHz")]
            self._cpuinfo_mhz = sum(mhz) / len(mhz) if mhz else None
        return self._cpuinfo_mhz

    def read(self) -> dict[str, float]:
        now, last = self._counters(), self._last
        self._last = now
        dt = max(now["wall"] - last["wall"], 1e-9)
        f: dict[str, float] = {"num_cpus": float(self._ncpu)}
        proc = max(now["proc_cpu"] - last["proc_cpu"], 0.0)
        f["proc_cores"] = proc / dt
        f["proc_util_pct"] = min(100.0, 100.0 * proc / dt / self._ncpu)
        f["proc_ctx_voluntary_per_s"] = max(now["nvcsw"] - last["nvcsw"], 0.0) / dt
        f["proc_ctx_involuntary_per_s"] = max(now["nivcsw"] - last["nivcsw"], 0.0) / dt
        if "sys_total" in now and "sys_total" in last:
            total = now["sys_total"] - last["sys_total"]
            busy = now["sys_busy"] - last["sys_busy"]
            f["util_pct"] = min(100.0, max(0.0, 100.0 * busy / total)) if total > 0 else 0.0
        if "ctxt" in now and "ctxt" in last:
            f["ctx_switches_per_s"] = max(now["ctxt"] - last["ctxt"], 0.0) / dt
        if "procs_running" in now:  # the same counter /proc/loadavg shows, one read fewer
            f["run_queue"] = now["procs_running"]
            f["procs_blocked"] = now.get("procs_blocked", 0.0)
        statm = self._statm.read()
        if statm:
            f["rss_bytes"] = float(statm.split()[1]) * self._page
        meminfo = self._meminfo.read() or ""
        kb = {k: v for k, _, v in (ln.partition(":") for ln in meminfo.splitlines()[:8])}
        if "MemTotal" in kb and "MemAvailable" in kb:
            total_b = float(kb["MemTotal"].split()[0]) * 1024
            avail_b = float(kb["MemAvailable"].split()[0]) * 1024
            f["mem_total_bytes"], f["mem_free_bytes"] = total_b, avail_b
            f["mem_used_bytes"] = max(total_b - avail_b, 0.0)
        clock = self._clock_mhz()
        if clock is not None:
            f["clock_mhz"] = clock
        if self._max_mhz is not None:
            f["clock_max_mhz"] = self._max_mhz
        return f

    def close(self) -> None:
        """Close the files it keeps open."""
        for kept in (self._stat, self._meminfo, self._statm, *self._freq):
            kept.close()


class NvmlProbe:
    """One GPU's counters through pynvml; each call is guarded on its own.

    A call that answers NotSupported is not asked again. Note that NVML's PCIe
    throughput counter integrates over ~20 ms inside the driver, so ``read`` takes at
    least that long; the sampler runs on its own thread for that reason.
    """

    source: Source = "nvml"

    def __init__(self, nvml: Any, index: int) -> None:
        self._n = nvml
        self._h = nvml.nvmlDeviceGetHandleByIndex(index)
        self._error: type[BaseException] = nvml.NVMLError
        self._not_supported: type[BaseException] = getattr(
            nvml, "NVMLError_NotSupported", self._error
        )
        self._skip: set[str] = set()
        self._static: dict[str, float] = {}
        for name, fn, args, scale in (
            ("clock_max_mhz", "nvmlDeviceGetMaxClockInfo", ("NVML_CLOCK_SM",), 1.0),
            ("mem_clock_max_mhz", "nvmlDeviceGetMaxClockInfo", ("NVML_CLOCK_MEM",), 1.0),
            ("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit", (), 1e-3),
        ):
            value = self._call(name, fn, *(getattr(nvml, a) for a in args))
            if value is not None:
                self._static[name] = float(value) * scale
        self._gpm: list[Any] | None = None
        try:
            if self._n.nvmlGpmQueryDeviceSupport(self._h).isSupportedDevice:
                self._gpm = [self._n.nvmlGpmSampleAlloc(), self._n.nvmlGpmSampleAlloc()]
                self._n.nvmlGpmSampleGet(self._h, self._gpm[0])
        except (self._error, AttributeError):  # old driver or old pynvml: no GPM
            self._gpm = None

    def _call(self, key: str, fn: str, *args: Any) -> Any:
        if key in self._skip:
            return None
        try:
            return getattr(self._n, fn)(self._h, *args)
        except self._not_supported:
            self._skip.add(key)
        except (self._error, AttributeError):
            pass
        return None

    def read(self) -> dict[str, float]:
        n, f = self._n, dict(self._static)
        util = self._call("util", "nvmlDeviceGetUtilizationRates")
        if util is not None:
            f["util_pct"], f["mem_util_pct"] = float(util.gpu), float(util.memory)
        mem = self._call("mem", "nvmlDeviceGetMemoryInfo")
        if mem is not None:
            f["mem_used_bytes"], f["mem_free_bytes"] = float(mem.used), float(mem.free)
            f["mem_total_bytes"] = float(mem.total)
        for name, fn, arg, scale in (
            ("pcie_tx_Bps", "nvmlDeviceGetPcieThroughput", "NVML_PCIE_UTIL_TX_BYTES", 1024.0),
            ("pcie_rx_Bps", "nvmlDeviceGetPcieThroughput", "NVML_PCIE_UTIL_RX_BYTES", 1024.0),
            ("clock_mhz", "nvmlDeviceGetClockInfo", "NVML_CLOCK_SM", 1.0),
            ("mem_clock_mhz", "nvmlDeviceGetClockInfo", "NVML_CLOCK_MEM", 1.0),
            ("temperature_c", "nvmlDeviceGetTemperature", "NVML_TEMPERATURE_GPU", 1.0),
        ):
            value = self._call(name, fn, getattr(n, arg))
            if value is not None:
                f[name] = float(value) * scale
        power = self._call("power_w", "nvmlDeviceGetPowerUsage")
        if power is not None:
            f["power_w"] = float(power) / 1000  # NVML reports milliwatts
        bar1 = self._call("bar1", "nvmlDeviceGetBAR1MemoryInfo")
        if bar1 is not None:
            f["bar1_used_bytes"], f["bar1_total_bytes"] = (
                float(bar1.bar1Used),
                float(bar1.bar1Total),
            )
        if self._gpm is not None:
            self._read_gpm(f)
        return f

    def _read_gpm(self, f: dict[str, float]) -> None:
        n, (prev, cur) = self._n, self._gpm or (None, None)
        try:
            n.nvmlGpmSampleGet(self._h, cur)
            request = n.c_nvmlGpmMetricsGet_t()
            request.version = n.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(_GPM_METRICS)
            request.sample1, request.sample2 = prev, cur
            for i, (_, const) in enumerate(_GPM_METRICS):
                request.metrics[i].metricId = getattr(n, const)
            n.nvmlGpmMetricsGet(request)
        except (self._error, AttributeError):
            return
        finally:
            self._gpm = [cur, prev]  # this sample is the next interval's start
        for i, (name, _) in enumerate(_GPM_METRICS):
            metric = request.metrics[i]
            # An H100 answered NaN for DRAM bandwidth with NVML_SUCCESS: leave it out.
            if metric.nvmlReturn == n.NVML_SUCCESS and math.isfinite(metric.value):
                f[name] = float(metric.value)

    def close(self) -> None:
        for sample in self._gpm or ():
            with contextlib.suppress(self._error, AttributeError):
                self._n.nvmlGpmSampleFree(sample)
        self._gpm = None


_nvml_lock = threading.Lock()
_nvml: Any = None  # None: not tried yet; False: unavailable; otherwise the pynvml module
_probes: dict[int | None, DeviceProbe] = {}


def nvml_module() -> Any | None:
    """The initialised pynvml module, or None without nvidia-ml-py, a driver or a GPU."""
    global _nvml
    with _nvml_lock:
        if _nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors
                log.debug("NVML unavailable, using the CPU sampler: %s", exc)
                _nvml = False
        return _nvml or None


def open_probe(device_index: int | None) -> DeviceProbe:
    """An NVML probe for GPU ``device_index``, else (no index, no NVML) a CPU probe."""
    if device_index is not None:
        nvml = nvml_module()
        if nvml is not None:
            try:
                return NvmlProbe(nvml, device_index)
            except nvml.NVMLError as exc:
                log.warning("NVML cannot open GPU %d (%s); sampling the CPU", device_index, exc)
    return CpuProbe()


def sample_device(device_index: int | None = None, *, stage: int = 0) -> DeviceSample:
    """One reading of the device (probes are cached, so rates cover the last call)."""
    with _nvml_lock:
        probe = _probes.get(device_index)
    if probe is None:
        probe = open_probe(device_index)
        with _nvml_lock:
            probe = _probes.setdefault(device_index, probe)
    return DeviceSample(stage=stage, time_s=time.time(), source=probe.source, fields=probe.read())
