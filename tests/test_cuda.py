"""CUDA paths end to end, on a machine with a GPU (skipped elsewhere).

Two stage processes share GPU 0 when there is only one: NCCL refuses two ranks on one
GPU, so `auto` picks gloo, which moves activations and gradients through pinned host
memory (`P2PTransport`). These tests prove that path trains exactly what one process
trains (up to float reassociation on the GPU), that the job-array memory manager keeps
exact with fewer resident job states than jobs (CUDA-stream prefetches), that NVML readings reach the telemetry, and
that the profiler and the GPU interference injector work on a real device.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptipe.inject.injectors import HogProcesses
from adaptipe.models import get_model
from adaptipe.monitor.device import nvml_module, sample_device
from adaptipe.monitor.runlog import load_run
from adaptipe.monitor.schema import DeviceSample, StageStats
from adaptipe.profile.profiler import profile_model
from adaptipe.runtime import resolve_plans, train
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.reference import train_reference
from adaptipe.runtime.rundir import RunDir
from tests.conftest import final_state
from tests.test_jobarray import _alone, _job_params

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# GPU kernels sum in other orders than the CPU's; a wrong weight version or a lost
# gradient moves parameters by far more than this.
RTOL, ATOL = 1e-4, 1e-5


def _checkpoint(run_dir: str) -> dict[str, torch.Tensor]:
    return final_state(run_dir)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize(
    ("schedule", "recompute"), [("1f1b", False), ("interleaved", True), ("gpipe", False)]
)
def test_stages_sharing_a_gpu_train_what_one_cpu_process_trains(
    make_config: Callable[..., RunConfig], schedule: str, recompute: bool
) -> None:
    pipeline: dict[str, Any] = {"stages": 2, "schedule": schedule, "recompute": recompute}
    if schedule == "interleaved":
        pipeline["virtual"] = 2
    cfg = make_config(pipeline=pipeline, train={"device": "cuda", "iterations": 4})
    assert cfg.train.backend == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    summary = train(cfg)
    spec = get_model(cfg.model.name, **cfg.model.config)
    plans = resolve_plans(cfg)
    want = train_reference(
        spec=spec,
        schedule=plans.schedule,
        partition=plans.partition,
        make_optimizer=cfg.optimizer.build,
        batch_size=cfg.data.batch_size,
        iterations=4,
        seed=cfg.train.seed,
        data_seed=cfg.data.seed,
    ).params
    got = {k: v for k, v in _checkpoint(summary.run_dir).items() if k.startswith("layers.")}
    _assert_close(got, want)
    log = load_run(summary.run_dir)
    stats = [r for r in log.records if isinstance(r, StageStats)]
    assert {s.stage for s in stats} == {0, 1}
    assert all(s.memory_allocated_bytes > 0 for s in stats)  # read from the CUDA allocator
    if nvml_module() is not None:
        samples = [r for r in log.records if isinstance(r, DeviceSample)]
        assert {s.stage for s in samples if s.source == "nvml"} == {0, 1}
        assert all(s.fields.get("mem_used_bytes", 0) > 0 for s in samples)


def test_a_job_array_on_a_gpu_keeps_its_budget_and_every_job_exact(
    make_config: Callable[..., RunConfig],
) -> None:
    cfg = make_config(
        data={"microbatches": 1, "batch_size": 16},
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"device": "cuda", "iterations": 4},
    )
    data = cfg.to_dict()
    data["sweep"] = {
        "grid": {"lr": [0.05, 0.2], "batch_size": [8, 16]},
        "solver": "1f1b",
        "memory_budget": 2,
        "window": 2,
    }
    cfg = RunConfig.from_dict(data, source="test.toml")
    summary = train(cfg)
    for job in cfg.jobs:
        _assert_close(_job_params(summary.run_dir, job.index), _alone(cfg, job))
    for stage in range(2):  # the manager's totals, from each stage's done record
        lines = RunDir(summary.run_dir).stage_metrics(stage).read_text().splitlines()
        done = next(r for r in map(json.loads, lines) if r.get("event") == "done")
        memory = done["memory"]
        assert memory["budget"] == 2 and memory["peak_resident"] <= 2
        assert memory["evictions"] > 0 and memory["prefetches"] + memory["misses"] > 0


def test_the_profiler_times_every_layer_on_the_gpu() -> None:
    spec = get_model("mlp", in_features=8, hidden=64, depth=4, out_features=4, num_samples=64)
    profile = profile_model(spec, microbatch=16, device="cuda", warmup=2, repeats=5)
    assert len(profile.layers) == spec.num_layers
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers)
    assert profile.meta["gpu"] == torch.cuda.get_device_name(0)


@pytest.mark.skipif(nvml_module() is None, reason="needs NVML")
def test_nvml_sees_the_gpu_injector_load_the_gpu() -> None:
    def busy(seconds: float) -> float:
        # NVML's utilisation is the share of the last sample period with a kernel running.
        end, peak = time.monotonic() + seconds, 0.0
        while time.monotonic() < end:
            peak = max(peak, sample_device(0).fields.get("util_pct", 0.0))
            time.sleep(0.05)
        return peak

    hog = HogProcesses([{"load": "gpu", "device": 0, "size": 4096, "intensity": 0.9}])
    hog.start()
    try:
        hog.wait_ready(timeout_s=60)
        loaded = busy(2.0)
    finally:
        hog.stop()
    assert loaded >= 50, loaded
    assert sample_device(0).source == "nvml"


def test_a_round_feed_copies_each_round_to_the_gpu_without_waiting() -> None:
    from itertools import islice

    from adaptipe.runtime.data import BatchStream, RoundFeed, split_microbatches

    dataset = get_model("mlp").dataset()
    want = [
        split_microbatches(x, y, 2)
        for x, y in islice(BatchStream(dataset, batch_size=16, seed=1), 3)
    ]
    feed = RoundFeed(
        BatchStream(dataset, batch_size=16, seed=1), rounds=3, per_round=2, device="cuda"
    )
    for index in range(6):
        x, y = feed[index]
        assert x is not None and y is not None and x.is_cuda and y.is_cuda
        r, i = divmod(index, 2)
        assert torch.equal(x.cpu(), want[r][i][0]) and torch.equal(y.cpu(), want[r][i][1])


def test_a_warned_gpu_stage_offloads_a_job_state_and_every_job_ends_as_without(
    make_config: Callable[..., RunConfig], tmp_path: Path
) -> None:
    """The memory guard reads the device's reserved memory on a CUDA stage; an injected
    device allocation growing on stage 1 warns it, and it keeps one job state fewer
    resident (3 -> 2 of 4) while the manager moves a layer away."""
    from adaptipe.controllers.live import decider as live_decider
    from tests.test_memory_relief import _stage_events

    def array(run_dir: Path, limit_mb: int) -> RunConfig:
        data = make_config(
            model={"config": {"hidden": 192, "num_samples": 16384}},
            data={"microbatches": 1, "batch_size": 32},
            optimizer={"lr": 0.002},
            train={
                "device": "cuda",
                "iterations": 60,
                "run_dir": str(run_dir),
                "stage_memory_mb": limit_mb,
            },
            adapt={"cooldown": 1000},
        ).to_dict()
        data["sweep"] = {
            "grid": {"lr": [0.002, 0.005], "batch_size": [16, 32]},
            "solver": "1f1b",
            "memory_budget": 3,
            "window": 2,
        }
        return RunConfig.from_dict(data, source="test.toml")

    train(array(tmp_path / "base", 100_000), decider=live_decider)
    base_events = _stage_events(tmp_path / "base", 1)
    peak = next(e["used_mb"] for e in base_events if e["event"] == "memory_peak")
    assert not any(e["event"] == "memory_warning" for e in base_events)
    scenario = tmp_path / "memory.toml"
    scenario.write_text(
        '[[inject]]\nkind = "memory"\nat_iteration = 10\nstage = 1\ngib = 0.4\ngrow_mb = 40\n'
    )
    limit = int(peak) + 450
    cfg = array(tmp_path / "mem", limit)
    train(cfg, decider=live_decider, inject=scenario)

    events = _stage_events(tmp_path / "mem", 1)
    warnings = [e for e in events if e["event"] == "memory_warning"]
    assert warnings and warnings[0]["offload"] == {"from": 3, "to": 2}, events
    used = next(e for e in events if e["event"] == "memory_peak")["used_mb"]
    assert peak + 300 < used < limit  # the device load was read; no out-of-memory
    control = (tmp_path / "mem" / "control.jsonl").read_text().splitlines()
    migrations = [e for e in map(json.loads, control) if e["event"] == "migration"]
    print("base peak", peak, "limit", limit, "used", used, "warnings", warnings[:2])
    print("migrations", [(m["bounds"], m["ok"]) for m in migrations])
    assert all(m["ok"] for m in migrations)
    for job in cfg.jobs:
        want = _job_params(str(tmp_path / "base"), job.index)
        got = _job_params(str(tmp_path / "mem"), job.index)
        assert all(torch.isfinite(v).all() for v in want.values())
        _assert_close(got, want)


def test_a_staged_pack_of_gpu_tensors_is_the_packed_bytes_as_they_were() -> None:
    """The copies are queued before a later in-place change on the same stream, so the
    sending thread reads the tensors as they were when the stage packed them."""
    from adaptipe.runtime.tensorpack import Staged, pack, pack_staged

    torch.manual_seed(0)
    live = {
        "g": torch.randn(512, 256, device="cuda"),
        "t": torch.randn(64, 32, device="cuda").t(),  # not contiguous
        "h": torch.randn(7, device="cuda", dtype=torch.bfloat16),
        "step": torch.tensor(5),  # an optimizer's step count stays on the host
    }
    want = pack({k: v.clone() for k, v in live.items()}, {"m": "1"})
    body = pack_staged(live, {"m": "1"})
    assert isinstance(body, Staged)
    for t in live.values():
        t.add_(1)  # the optimizer step after the log was packed
    assert bytes(body.ready()) == bytes(want) and len(body) == len(want)


@pytest.mark.parametrize("streamer", ["process", "thread"])
def test_a_streamed_move_on_gpu_stages_ends_bitwise_as_without(
    make_config: Callable[..., RunConfig], tmp_path: Path, streamer: str
) -> None:
    """Through each worker's helper process, the gradient log crosses pinned and shared
    memory and the receiver's helper replays it on the GPU; in threads, the stage
    replays it itself. Either way the run ends bit for bit as the run that moved
    nothing (same device, same kernels)."""
    from tests.test_streamed_migration import CASES, _config

    case = CASES["1f1b-2-adam"]

    def on_gpu(cfg: RunConfig) -> RunConfig:
        data = cfg.to_dict()
        data["train"]["device"] = "cuda"
        return RunConfig.from_dict(data, source="test.toml")

    train(on_gpu(_config(make_config, case, tmp_path / "still", moves=False)))
    moved = tmp_path / "moved"
    train(on_gpu(_config(make_config, case, moved, moves=True, adapt={"streamer": streamer})))
    lines = (moved / "control.jsonl").read_text().splitlines()
    said = [e for e in map(json.loads, lines) if e.get("event") == "migration"]
    assert [(e["ok"], e["transfer"], e["streamer"]) for e in said] == [
        (True, "streamed", streamer)
    ] * 2
    got, want = final_state(moved), final_state(tmp_path / "still")
    assert got.keys() == want.keys() and want
    for name, value in want.items():
        assert torch.equal(got[name], value), name
