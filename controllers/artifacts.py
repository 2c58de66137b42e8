"""Trained controllers on disk: files that run no code on load, pinned by a manifest.

An artifact is a folder: the model's files (safetensors weights, a skops forest, JSON)
and ``artifact.json``, which says what it is and how it was made::

    {"kind": "adaptipe-artifact", "version": 1, "model": "predictor",
     "format": 1, "created": "2026-11-26T20:00:00Z", "adaptipe": "0.1.0",
     "training": {"seed": 0, "seconds": 312.5, "data": "...", ...},
     "metrics": {...},
     "files": {"weights.safetensors": "<sha256>", "config.json": "<sha256>"}}

`save_artifact` writes the files and the manifest; `load_artifact` reads them back and
refuses, with what is wrong and how to get a good one, a folder without a manifest, a
manifest for another model or format, and a file that is missing or whose sha256 is
not the manifest's (tampered, or half-copied). Shipped artifacts live in
``controllers/artifacts/<model>/``; `adaptipe controllers train <model>` writes new ones.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptipe.errors import PlanError

__all__ = ["SHIPPED", "Artifact", "describe", "load_artifact", "save_artifact", "shipped"]

ARTIFACT_KIND = "adaptipe-artifact"
ARTIFACT_VERSION = 1
MANIFEST_NAME = "artifact.json"
SHIPPED = Path(__file__).parent / "artifacts"
"""Where the pretrained controllers ship: ``SHIPPED / <model>``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Artifact:
    """A loaded artifact: its manifest's fields and its files' bytes (checked)."""

    model: str
    format: int
    created: str
    training: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, bytes] = field(default_factory=dict)
    root: Path | None = None

    def json(self, name: str) -> Any:
        """One of its files, parsed as JSON."""
        try:
            return json.loads(self.files[name])
        except KeyError:
            raise PlanError(f"{self.root}: the artifact has no {name}") from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def save_artifact(
    root: str | Path,
    *,
    model: str,
    format: int,
    files: Mapping[str, bytes],
    training: Mapping[str, Any],
    metrics: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``files`` and their manifest into the folder ``root`` (created)."""
    from adaptipe import __version__

    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if "/" in name or name == MANIFEST_NAME:
            raise PlanError(f"artifact: bad file name {name!r}")
        (out / name).write_bytes(data)
    manifest = {
        "kind": ARTIFACT_KIND,
        "version": ARTIFACT_VERSION,
        "model": model,
        "format": format,
        "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "adaptipe": __version__,
        "training": dict(training),
        "metrics": dict(metrics or {}),
        "files": {name: _sha256(data) for name, data in sorted(files.items())},
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return out


def load_artifact(root: str | Path, *, model: str, format: int) -> Artifact:
    """Read and check the artifact in ``root`` (see the module doc)."""
    where = Path(root)
    retrain = f"retrain it with `adaptipe controllers train {model}`"
    path = where / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{where}: no {MANIFEST_NAME}: not a {model} artifact; {retrain}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: unreadable ({exc}); {retrain}") from None
    if not isinstance(data, dict) or data.get("kind") != ARTIFACT_KIND:
        raise PlanError(f"{path}: not an adaptipe artifact manifest; {retrain}")
    if data.get("version") != ARTIFACT_VERSION:
        raise PlanError(
            f"{path}: manifest version {data.get('version')!r} is not {ARTIFACT_VERSION}"
        )
    if data.get("model") != model:
        raise PlanError(f"{path}: a {data.get('model')!r} artifact, not a {model!r} one")
    if data.get("format") != format:
        raise PlanError(
            f"{path}: {model} format {data.get('format')!r}; this adaptipe reads format "
            f"{format}; {retrain}"
        )
    files: dict[str, bytes] = {}
    for name, digest in dict(data.get("files", {})).items():
        try:
            blob = (where / name).read_bytes()
        except FileNotFoundError:
            raise PlanError(f"{where}: {name} is missing; {retrain}") from None
        if _sha256(blob) != digest:
            raise PlanError(
                f"{where / name}: sha256 {_sha256(blob)[:16]}... is not the manifest's "
                f"{str(digest)[:16]}...: the file was changed after training; {retrain}"
            )
        files[name] = blob
    return Artifact(
        model=model,
        format=format,
        created=str(data.get("created", "")),
        training=dict(data.get("training", {})),
        metrics=dict(data.get("metrics", {})),
        files=files,
        root=where,
    )


def shipped(model: str) -> Path:
    """The folder of the pretrained ``model`` shipped with adaptipe."""
    return SHIPPED / model


def describe(root: str | Path) -> dict[str, Any]:
    """What names an artifact in a run directory: its model, folder, creation time and
    the sha256 of its manifest (which holds every file's sha256)."""
    where = Path(root)
    blob = (where / MANIFEST_NAME).read_bytes()
    manifest = json.loads(blob)
    return {
        "model": manifest.get("model"),
        "path": str(where),
        "created": manifest.get("created"),
        "sha256": _sha256(blob),
    }
