"""Host facts: parsing a config never asks the machine; `fit_to_host` checks it against one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

import adaptipe.runtime.config_sections as sections
from adaptipe import PlanError
from adaptipe.runtime.config import RunConfig, load_config, parse_config
from adaptipe.runtime.host import HostFacts, fit_to_host, resolve_backend, stages_per_host
from adaptipe.runtime.plans import resolve_plans

TOML = """
[model]
name = "mlp"
[data]
batch_size = 8
microbatches = 2
[optimizer]
name = "sgd"
lr = 0.1
[pipeline]
stages = 2
[train]
iterations = 3
"""


def _config(tmp_path: Path, **train: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(TOML + "".join(f'{k} = "{v}"\n' for k, v in train.items()))
    return path


def _no_host(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("parsing asked the host")


def test_parsing_a_config_never_asks_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("is_available", "device_count"):
        monkeypatch.setattr(torch.cuda, name, _no_host)
    monkeypatch.setattr(os, "sched_getaffinity", _no_host)
    config = parse_config(_config(tmp_path, device="cuda:3", backend="nccl"))
    assert (config.train.device, config.train.backend) == ("cuda:3", "nccl")
    assert config.train.threads_per_stage is None  # the host decides
    again = RunConfig.parse(config.to_dict(), source=config.source)
    assert again == config


def test_fit_to_host_gives_the_errors_load_config_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _config(tmp_path, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PlanError) as loaded:
        load_config(path)
    with pytest.raises(PlanError) as fitted:
        fit_to_host(parse_config(path), HostFacts(cores=4, gpus=0))
    want = (
        f"{path}: [train].device is 'cuda:0' but torch.cuda.is_available() is false "
        "(allowed here: cpu)"
    )
    assert str(fitted.value) == str(loaded.value) == want


@pytest.mark.parametrize(
    ("host", "threads", "backend"),
    [
        (HostFacts(cores=8, gpus=2), 4, "nccl"),  # a GPU per stage
        (HostFacts(cores=8, gpus=1), 4, "gloo"),  # two stages on one GPU
        (HostFacts(cores=1, gpus=1, local_world_size=1), 1, "nccl"),  # torchrun, one per host
        (HostFacts(cores=None, gpus=2), 1, "nccl"),
    ],
)
def test_fit_to_host_fills_in_what_the_host_decides(
    tmp_path: Path, host: HostFacts, threads: int, backend: str
) -> None:
    config = parse_config(_config(tmp_path, device="cuda"))
    fitted = fit_to_host(config, host)
    assert (fitted.train.threads_per_stage, fitted.train.backend) == (threads, backend)
    assert fit_to_host(fitted, host) is fitted  # fitting again changes nothing


def test_the_backend_rules_take_the_host_facts_as_arguments() -> None:
    assert stages_per_host(4, None) == 4 and stages_per_host(4, 2) == 2
    assert resolve_backend("auto", "cuda", 2, 2) == "nccl"
    assert resolve_backend("auto", "cuda:0", 2, 2) == "gloo"
    assert resolve_backend("gloo", "cuda", 1, 1) == "gloo"


def test_loading_and_planning_build_the_schedule_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[str] = []
    build = sections.build_schedule

    def counted(name: str, **kwargs: Any) -> Any:
        built.append(name)
        return build(name, **kwargs)

    monkeypatch.setattr(sections, "build_schedule", counted)
    sections._schedule.cache_clear()
    config = load_config(_config(tmp_path))
    plans = resolve_plans(config)
    assert built == ["1f1b"] and plans.schedule.num_stages == 2
