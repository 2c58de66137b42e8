"""Checkpoints: safetensors tensors and JSON metadata, every write atomic, no pickle.

Keys are global (by model layer index), so a run with another partition, or a stage
receiving a migrated layer, can load any layer from any stage's file::

    checkpoints/
      iter-000050/
        stage-0.safetensors   layers.{i}.{param}, optim.{i}.{param}.{state key}
        stage-0.json          the stage's meta (also in the safetensors header)
        COMMITTED.json        iteration, num_stages, meta, sha256 of every file
      latest.json             {"checkpoint": "iter-000050", ...}

A folder without COMMITTED.json is an interrupted save and is never read; the pointer
swap in latest.json is the commit point, so a crash at any moment leaves the previous
checkpoint in use.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

from adaptipe.errors import PlanError
from adaptipe.runtime.recipe import STEP_KEY
from adaptipe.serial import new_file_mode

__all__ = [
    "CheckpointError",
    "check_compatible",
    "commit",
    "latest",
    "layer_state",
    "load",
    "load_compatible",
    "load_layer_state",
    "load_optimizer_state",
    "optimizer_state",
    "prune",
    "save_stage",
]

CHECKPOINT_VERSION = 1
COMMITTED = "COMMITTED.json"
LATEST = "latest.json"
_DIR = re.compile(r"^iter-(\d{6,})$")
# Optimizer state with the parameter's shape (sgd, adam, adamw); others (step) are scalars.
_PARAM_SHAPED = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class CheckpointError(PlanError):
    """A checkpoint is missing, corrupt, incomplete or for another model."""


# ---- per-layer state ------------------------------------------------------------------------


def _cpu(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def layer_state(
    index: int, module: nn.Module, optimizer: torch.optim.Optimizer | None, *, copy: bool = True
) -> dict[str, Tensor]:
    """Layer `index`'s tensors (and its parameters' optimizer state) under global keys.

    Non-tensor optimizer state becomes a 0-d tensor (float64 or int64) so nothing needs
    pickle; the returned tensors are contiguous CPU copies, safe to write while training
    on (``copy=False``: the live tensors, detached, for a caller that copies them at once).
    """
    out = {
        f"layers.{index}.{name}": _cpu(t) if copy else t.detach()
        for name, t in module.state_dict().items()
    }
    if optimizer is not None:
        out.update(optimizer_state(index, module.named_parameters(), optimizer, copy=copy))
    return out


def optimizer_state(
    index: int,
    params: Iterable[tuple[str, Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    copy: bool = True,
) -> dict[str, Tensor]:
    """The optimizer state of layer `index`'s named ``params``, as `layer_state` keys it."""
    out: dict[str, Tensor] = {}
    for name, param in params:
        for key, value in optimizer.state.get(param, {}).items():
            if value is None:
                continue
            if not isinstance(value, Tensor):
                dtype = torch.float64 if isinstance(value, float) else None
                value = torch.tensor(value, dtype=dtype)
            out[f"optim.{index}.{name}.{key}"] = _cpu(value) if copy else value.detach()
    return out


def load_layer_state(
    index: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    tensors: Mapping[str, Tensor],
) -> None:
    """Restore what `layer_state` saved for layer `index` into `module` and `optimizer`.

    Other layers' keys are ignored; a missing, extra or wrongly shaped key of this layer is
    a `CheckpointError`. The optimizer gets copies, so continuing is bitwise identical to
    never having stopped.
    """
    prefix = f"layers.{index}."
    expected = module.state_dict()
    found = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    where = f"layer {index} ({type(module).__name__})"
    for name in sorted(expected.keys() - found.keys()):
        raise CheckpointError(f"checkpoint has no {prefix}{name}, which {where} needs")
    for name in sorted(found.keys() - expected.keys()):
        raise CheckpointError(
            f"checkpoint key {prefix}{name} is not a tensor of {where} "
            f"(allowed: {', '.join(sorted(expected))})"
        )
    for name, target in expected.items():
        _check_shape(prefix + name, tuple(target.shape), found[name])
    module.load_state_dict(found, strict=True)
    if optimizer is not None:
        load_optimizer_state(index, dict(module.named_parameters()), optimizer, tensors, where)


def load_optimizer_state(
    index: int,
    params: Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer,
    tensors: Mapping[str, Tensor],
    where: str,
) -> None:
    """Restore what `optimizer_state` saved for layer `index`'s named ``params`` (copies,
    placed as torch's loader would); ``where`` names the layer in errors."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    states: dict[str, dict[str, Tensor]] = {name: {} for name in params}
    oprefix = f"optim.{index}."
    for key, value in tensors.items():
        if not key.startswith(oprefix):
            continue
        name, _, state_key = key[len(oprefix) :].rpartition(".")
        if name not in params:
            raise CheckpointError(
                f"checkpoint key {key} names no parameter of {where} (allowed: {', '.join(params)})"
            )
        if state_key in _PARAM_SHAPED:
            _check_shape(key, tuple(params[name].shape), value)
        states[name][state_key] = value
    for name, param in params.items():
        if id(param) not in owned:
            raise CheckpointError(f"{where}: parameter {name} is not in the optimizer given")
        optimizer.state[param] = {k: _to_param(k, v, param) for k, v in states[name].items()}


def _check_shape(key: str, expected: tuple[int, ...], found: Tensor) -> None:
    if tuple(found.shape) != expected:
        raise CheckpointError(
            f"checkpoint key {key} has shape {list(found.shape)} but the model expects {list(expected)}"
        )


def _to_param(key: str, value: Tensor, param: Tensor) -> Tensor:
    """A copy placed as torch's Optimizer.load_state_dict would: `step` (and a
    schedule's step count, `STEP_KEY`) stays on the CPU."""
    if key in ("step", STEP_KEY):
        return value.clone()
    dtype = param.dtype if value.is_floating_point() and param.is_floating_point() else None
    return value.to(device=param.device, dtype=dtype, copy=True)


# ---- files ----------------------------------------------------------------------------------


def _fsync_dir(folder: Path) -> None:
    """Make a rename or unlink in `folder` durable (the folder entry is data too)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write via a temp file in the same folder, fsync, rename, fsync the folder: readers
    see the old file or the new one, never a torn one, and a failure leaves no temp file."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        # mkstemp creates 0600 (and safetensors replaces the file with its own 0600
        # one): without this, checkpoints would be private whatever the umask.
        os.chmod(tmp, new_file_mode())
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    _atomic(path, lambda tmp: tmp.write_text(text))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None


def _sha256(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None


def _dirname(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def save_stage(
    ckpt_dir: Path, *, stage: int, tensors: dict[str, Tensor], meta: dict[str, Any]
) -> Path:
    """Write one stage's tensors (with `meta` in the header) and `meta` as JSON, atomically."""
    ckpt_dir = Path(ckpt_dir)
    pointer = _pointer(ckpt_dir.parent)
    if pointer is not None and pointer.resolve() == ckpt_dir.resolve():
        raise CheckpointError(f"{ckpt_dir}: refusing to overwrite the latest checkpoint")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    stale = ckpt_dir / COMMITTED
    if stale.exists():  # from an abandoned run resumed earlier: this folder is being redone
        stale.unlink(missing_ok=True)
        _fsync_dir(ckpt_dir)
    text = json.dumps(meta, sort_keys=True)
    path = ckpt_dir / f"stage-{stage}.safetensors"
    _atomic(path, lambda tmp: safetensors.torch.save_file(tensors, tmp, {"adaptipe": text}))
    _atomic(ckpt_dir / f"stage-{stage}.json", lambda tmp: tmp.write_text(text + "\n"))
    return path


def commit(ckpt_root: Path, *, iteration: int, num_stages: int, meta: dict[str, Any]) -> Path:
    """Seal ``iter-{iteration}`` once every stage has saved, then point latest.json at it.

    `meta` must hold ``model`` (name) and ``model_config`` (dict) for `check_compatible`.
    """
    ckpt_root = Path(ckpt_root)
    directory = ckpt_root / _dirname(iteration)
    if not isinstance(meta.get("model"), str) or not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{directory}: meta must hold 'model' and 'model_config'")
    files: dict[str, str] = {}
    for stage in range(num_stages):
        path = directory / f"stage-{stage}.safetensors"
        files[path.name] = _sha256(path)
        try:
            with safetensors.safe_open(str(path), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
        json_path = directory / f"stage-{stage}.json"
        _read_json(json_path)
        files[json_path.name] = _sha256(json_path)
    record = {
        "kind": "checkpoint",
        "version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_stages": num_stages,
        "meta": meta,
        "files": files,
    }
    _write_json(directory / COMMITTED, record)
    pointer = {"kind": "checkpoint_pointer", "version": CHECKPOINT_VERSION}
    _write_json(
        ckpt_root / LATEST, {**pointer, "checkpoint": directory.name, "iteration": iteration}
    )
    return directory


def _committed(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(iteration, folder) of every committed checkpoint, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for path in ckpt_root.iterdir():
        m = _DIR.match(path.name)
        if m and (path / COMMITTED).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def _pointer(ckpt_root: Path) -> Path | None:
    try:
        name = json.loads((ckpt_root / LATEST).read_text())["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str) or not _DIR.match(name):
        return None
    return ckpt_root / name if (ckpt_root / name / COMMITTED).is_file() else None


def latest(ckpt_root: Path) -> Path | None:
    """The checkpoint latest.json points to, or (no pointer) the newest committed one."""
    ckpt_root = Path(ckpt_root)
    pointer = _pointer(ckpt_root)
    if pointer is not None:
        return pointer
    committed = _committed(ckpt_root)
    return committed[-1][1] if committed else None


def load(ckpt_dir: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """All stages' tensors merged, and the COMMITTED.json record (iteration, meta, ...).

    Every file is checked against its sha256 before it is parsed.
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / COMMITTED).is_file():
        raise CheckpointError(f"{ckpt_dir}: not a committed checkpoint (no {COMMITTED})")
    record = _read_json(ckpt_dir / COMMITTED)
    if (
        not isinstance(record, dict)
        or record.get("version") != CHECKPOINT_VERSION
        or not isinstance(record.get("files"), dict)
    ):
        raise CheckpointError(f"{ckpt_dir / COMMITTED}: not a version {CHECKPOINT_VERSION} record")
    tensors: dict[str, Tensor] = {}
    for name, digest in sorted(record["files"].items()):
        path = ckpt_dir / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing") from None
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise CheckpointError(
                f"{path}: corrupt (sha256 {got[:16]}... but {COMMITTED} says {digest[:16]}...)"
            )
        if not name.endswith(".safetensors"):
            continue
        part = safetensors.torch.load(data)
        for key in sorted(part.keys() & tensors.keys()):
            raise CheckpointError(f"{path}: key {key} is also in another stage's file")
        tensors.update(part)
    return tensors, record


def check_compatible(
    meta: Mapping[str, Any],
    *,
    model: str,
    model_config: Mapping[str, Any],
    num_layers: int,
    source: str,
) -> None:
    """Refuse a checkpoint (`load`'s record, or its ``meta``) made for another model."""
    info = meta["meta"] if isinstance(meta.get("meta"), Mapping) else meta
    got = info.get("model")
    if got != model:
        raise CheckpointError(
            f"checkpoint {source} is for model {got!r} but the config asks for {model!r}"
        )
    saved = info.get("model_config", {})
    diff = sorted(
        k for k in saved.keys() | model_config.keys() if saved.get(k) != model_config.get(k)
    )
    if diff:
        had = ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
        wants = ", ".join(f"{k}={model_config.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"checkpoint {source} is for model {model!r} with {had} but the config asks for {wants}"
        )
    saved_layers = info.get("num_layers", num_layers)
    if saved_layers != num_layers:
        raise CheckpointError(
            f"checkpoint {source} has {saved_layers} layers but model {model!r} has {num_layers}"
        )


def prune(ckpt_root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints, never the latest one.

    Also removes interrupted saves older than the latest checkpoint (they can never
    complete). Returns the folders deleted.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0 (got {keep})")
    ckpt_root = Path(ckpt_root)
    current = latest(ckpt_root)
    if current is None:
        return []
    newest = int(current.name.split("-")[1])
    # Committed folders past the pointer belong to a run resumed from an earlier checkpoint
    # (or a crash between the two commit writes); they are left for save_stage to redo.
    committed = [path for it, path in _committed(ckpt_root) if it <= newest]
    keeping = set(committed[len(committed) - keep :] if keep else []) | {current}
    removed = []
    for path in sorted(ckpt_root.iterdir()):
        m = _DIR.match(path.name)
        if not m or path in keeping:
            continue
        sealed = (path / COMMITTED).is_file()
        if (sealed and path in committed) or (not sealed and int(m.group(1)) < newest):
            if sealed:  # unseal first so a crash mid-delete never leaves a "committed" husk
                (path / COMMITTED).unlink()
                _fsync_dir(path)
            shutil.rmtree(path)
            removed.append(path)
    if removed:
        _fsync_dir(ckpt_root)
    return removed


def load_compatible(
    ckpt_dir: Path, *, model: str, model_config: Mapping[str, Any], num_layers: int
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """`load` a checkpoint and refuse it (`check_compatible`) if made for another model."""
    tensors, record = load(ckpt_dir)
    check_compatible(
        record, model=model, model_config=model_config, num_layers=num_layers, source=str(ckpt_dir)
    )
    return tensors, record
