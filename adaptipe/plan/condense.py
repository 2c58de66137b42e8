"""Model condensation (DynPipe §V-B1, Algorithm 2 ``ModelCondense``).

The top-k layers by compute plus communication time become block ends: every block
runs from just after the previous chosen layer up to and including the next one, and
the last block runs to the end of the model, so there are exactly ``top_k`` blocks.
A planner then searches boundaries between blocks only and `Condensed.expand` maps its
partition back to layers. A block's costs add up exactly (compute, memory) or are
those of its edge layers (activation out of its last layer, gradient into its first),
so a block partition costs the same as the layer partition it expands to.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from adaptipe.errors import PlanError
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import LayerProfile, Profile

__all__ = ["Condensed", "condense"]


@dataclass(frozen=True, slots=True)
class Condensed:
    """A profile whose "layers" are blocks of the original layers.

    Attributes:
        profile: the condensed profile, one `LayerProfile` per block.
        block_bounds: layer index where each block starts, then the original num_layers.
    """

    profile: Profile
    block_bounds: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_bounds) - 1

    def expand(self, partition: Partition) -> Partition:
        """Map a partition of the blocks to the same partition of the original layers."""
        if partition.num_layers != self.num_blocks:
            raise PlanError(
                f"condensed partition covers {partition.num_layers} units but the model was condensed "
                f"into {self.num_blocks} blocks"
            )
        meta = dict(partition.meta)
        meta["condensed"] = {"top_k": self.num_blocks, "block_bounds": list(self.block_bounds)}
        return Partition(
            model=partition.model,
            num_layers=self.block_bounds[-1],
            bounds=tuple(self.block_bounds[b] for b in partition.bounds),
            replicas=partition.replicas,
            planner=partition.planner,
            predicted_s=partition.predicted_s,
            meta=meta,
        )


def _block(layers: tuple[LayerProfile, ...], start: int, end: int) -> LayerProfile:
    part = layers[start:end]
    last = part[-1]
    return LayerProfile(
        name=f"block[{start}:{end}]",
        kind=last.kind if len(part) == 1 else "Block",
        forward_s=sum(layer.forward_s for layer in part),
        backward_s=sum(layer.backward_s for layer in part),
        activation_bytes=last.activation_bytes,
        gradient_bytes=part[0].gradient_bytes,
        saved_bytes=sum(layer.saved_bytes for layer in part),
        param_bytes=sum(layer.param_bytes for layer in part),
        optimizer_bytes=sum(layer.optimizer_bytes for layer in part),
        num_params=sum(layer.num_params for layer in part),
    )


def condense(profile: Profile, top_k: int, *, bandwidth_Bps: float = math.inf) -> Condensed:
    """Group layers into ``min(top_k, num_layers)`` blocks ending at the heaviest layers.

    A layer's weight is its forward + backward time plus the time to send its output
    activation at ``bandwidth_Bps`` (Algorithm 2 ranks by "communication and
    computation time"; with infinite bandwidth only compute counts). Ties go to the
    earlier layer.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise PlanError(f"top_k must be an integer >= 1 (got {top_k!r})")
    if not bandwidth_Bps > 0:
        raise PlanError(
            f"bandwidth_Bps must be a bandwidth in bytes/s in (0, inf] (got {bandwidth_Bps})"
        )
    n = profile.num_layers
    layers = profile.layers

    def weight(i: int) -> float:
        return layers[i].compute_s + layers[i].activation_bytes / bandwidth_Bps

    ranked = sorted(range(n), key=lambda i: (-weight(i), i))
    ends = sorted(ranked[: min(top_k, n)])
    ends[-1] = n - 1  # the last block runs to the end of the model
    bounds = (0, *(e + 1 for e in ends))
    blocks = tuple(_block(layers, bounds[b], bounds[b + 1]) for b in range(len(bounds) - 1))
    meta = dict(profile.meta)
    meta["condensed_from"] = {"num_layers": n, "block_bounds": list(bounds)}
    condensed = dataclasses.replace(profile, layers=blocks, meta=meta)
    return Condensed(profile=condensed, block_bounds=bounds)
