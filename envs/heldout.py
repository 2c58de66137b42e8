"""The held-out traces every controller is judged on, pinned by a committed manifest.

``envs/heldout/manifest.json`` lists each held-out trace by family, seed, shape and
generator parameters, with the sha256 of the trace file the generator writes for it.
The traces are generated again when needed and checked against those digests, so a
generator that changed cannot quietly change the test set. The manifest was committed
(with its own digest pinned in ``tests/test_heldout.py``) before any controller was
trained.

Held out two ways (AutoPipe, DynPipe and the issue ask for both):

- **by seed**: training draws seeds below `HELD_OUT_SEED`, the manifest's are above it;
- **by family**: ``colocated`` is never used in training (`TRAINING_FAMILIES` leaves it
  out), so the evaluation also shows how a controller does on interference it never saw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adaptipe.envs.trace import Trace
from adaptipe.errors import PlanError
from adaptipe.serial import read_json, write_json

__all__ = [
    "HELD_OUT_FAMILIES",
    "HELD_OUT_SEED",
    "MANIFEST",
    "TRAINING_FAMILIES",
    "heldout_traces",
    "manifest_digest",
    "manifest_for",
    "write_manifest",
]

MANIFEST = Path(__file__).parent / "heldout" / "manifest.json"
"""The 4-stage set (the environments' default pipeline)."""
MANIFESTS = {4: MANIFEST, 2: MANIFEST.with_name("manifest-2stages.json")}
"""Per stage count, its held-out set: the 2-stage one (same families and seeds) was
committed before the 2-stage switch policy was trained."""
MANIFEST_KIND = "adaptipe-heldout"
HELD_OUT_SEED = 1_000_000
"""Training seeds are below this; held-out seeds at or above it."""
HELD_OUT_FAMILIES = ("colocated",)
TRAINING_FAMILIES = ("bandwidth-steps", "poisson-light", "poisson-heavy", "preemption", "mixture")
ALL_FAMILIES = (*TRAINING_FAMILIES, *HELD_OUT_FAMILIES)


def manifest_for(stages: int) -> Path:
    """The held-out manifest of ``stages``-stage traces."""
    if stages not in MANIFESTS:
        raise PlanError(
            f"no held-out set for {stages} stages (there are sets for "
            f"{', '.join(str(s) for s in sorted(MANIFESTS))}); `write_manifest` makes one"
        )
    return MANIFESTS[stages]


def _generate(entry: dict[str, Any]) -> Trace:
    from adaptipe.envs.generators import generate

    return generate(
        entry["family"],
        stages=int(entry["stages"]),
        iterations=int(entry["iterations"]),
        seed=int(entry["seed"]),
        **dict(entry.get("params", {})),
    )


def write_manifest(
    path: str | Path = MANIFEST,
    *,
    families: Sequence[str] = ALL_FAMILIES,
    seeds: int = 5,
    stages: int = 4,
    iterations: int = 200,
) -> Path:
    """Generate the held-out set and write its manifest (done once, before training)."""
    entries = []
    for family in families:
        for k in range(seeds):
            entry: dict[str, Any] = {
                "family": family,
                "seed": HELD_OUT_SEED + k,
                "stages": stages,
                "iterations": iterations,
                "params": {},
            }
            entry["sha256"] = _generate(entry).digest()
            entries.append(entry)
    data = {
        "kind": MANIFEST_KIND,
        "version": 1,
        "held_out_seed": HELD_OUT_SEED,
        "held_out_families": list(HELD_OUT_FAMILIES),
        "training_families": list(TRAINING_FAMILIES),
        "traces": entries,
    }
    write_json(path, data)
    return Path(path)


def manifest_digest(path: str | Path = MANIFEST) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def heldout_traces(
    path: str | Path = MANIFEST, *, families: Sequence[str] | None = None
) -> list[Trace]:
    """The manifest's traces (optionally of ``families`` only), each checked against its
    digest."""
    data = read_json(path)
    if not isinstance(data, dict) or data.get("kind") != MANIFEST_KIND:
        raise PlanError(f"{path}: not a held-out manifest (kind {MANIFEST_KIND!r})")
    out = []
    for n, entry in enumerate(data.get("traces", [])):
        if families is not None and entry["family"] not in families:
            continue
        trace = _generate(entry)
        if trace.digest() != entry["sha256"]:
            raise PlanError(
                f"{path}: traces[{n}] ({entry['family']}, seed {entry['seed']}) is not the "
                "trace the manifest pinned: the generator changed; a changed held-out set "
                "needs a new manifest and every controller evaluated again"
            )
        out.append(trace)
    return out
