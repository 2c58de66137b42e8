"""Which partition a run asks for: manual bounds, an even split, a planner or a JSON file.

Only the partition is resolved here. A run's schedule (`adaptipe.schedule`), its
job-array plan (`adaptipe.japsp`) and the config that names them all (`adaptipe.runtime`)
sit above this layer, so `adaptipe.runtime.plans` puts them together around this.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaptipe.errors import PlanError
from adaptipe.models import ModelSpec
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.serial import load_json_file
from adaptipe.units import parse_bandwidth

__all__ = ["resolve_partition"]


def resolve_partition(
    spec: ModelSpec,
    *,
    partition: str | Sequence[int],
    num_stages: int,
    microbatch: int,
    device: str,
    optimizer: str,
    bandwidth: str,
    source: str,
    shape: str,
) -> tuple[Partition, Profile | None]:
    """The partition of `spec` into `num_stages` stages, and the profile a planner used.

    Args:
        partition: a planner name (``pipedream``, ``dynpipe``), ``even``, explicit layer
            bounds, or the path of a Partition JSON file.
        microbatch, device, optimizer: what the planners profile (`profile_model`).
        bandwidth: the link bandwidth the planners assume, e.g. ``"1GB/s"``.
        source: where `partition` was given, for errors (``"run.toml: [pipeline].partition"``).
        shape: how `num_stages` came about, for errors (``"stages x virtual = 2 x 1"``).
    """
    profile: Profile | None = None
    if isinstance(partition, tuple | list):
        part = Partition(
            model=spec.name, num_layers=spec.num_layers, bounds=tuple(partition), planner="manual"
        )
    elif partition == "even":
        part = Partition.even(model=spec.name, num_layers=spec.num_layers, num_stages=num_stages)
    elif partition in ("pipedream", "dynpipe"):
        from adaptipe.plan.api import plan
        from adaptipe.profile.profiler import profile_model

        profile = profile_model(
            spec,
            microbatch=microbatch,
            repeats=3,
            warmup=1,
            threads=1,
            device=device,
            optimizer=optimizer,
        )
        part = plan(
            profile,
            planner=str(partition),
            num_stages=num_stages,
            bandwidth_Bps=parse_bandwidth(bandwidth),
        )
    else:
        part = load_json_file(str(partition), Partition.from_json)
    part.check_model(model=spec.name, num_layers=spec.num_layers, source=source)
    if part.num_stages != num_stages:
        raise PlanError(
            f"{source}: has {part.num_stages} stages but the schedule needs {num_stages} ({shape})"
        )
    return part, profile
