"""Small helpers to read versioned JSON plans with errors that name file and field.

Every plan type has ``to_json() -> dict`` and ``from_json(data, source=...)``; the
helpers here do the field checking so that messages read the same everywhere, e.g.
``profile.json: layers[3].forward_s must be a number >= 0 (got -1.0)``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from adaptipe.errors import PlanError

__all__ = [
    "atomic_write_text",
    "check_kind",
    "get_bool",
    "get_float",
    "get_int",
    "get_list",
    "get_str",
    "load_json_file",
    "new_file_mode",
    "read_json",
    "write_json",
]

T = TypeVar("T")
_MISSING = object()


def _fail(source: str, field: str, message: str) -> PlanError:
    return PlanError(f"{source}: {field} {message}")


def _raw(data: Mapping[str, Any], key: str, source: str, prefix: str, default: Any) -> Any:
    if not isinstance(data, Mapping):
        raise PlanError(
            f"{source}: {prefix or 'top level'} must be an object (got {type(data).__name__})"
        )
    if key in data:
        return data[key]
    if default is _MISSING:
        raise _fail(source, prefix + key, "is missing")
    return default


def get_int(
    data: Mapping[str, Any],
    key: str,
    *,
    source: str,
    prefix: str = "",
    minimum: int | None = None,
    default: Any = _MISSING,
) -> int:
    value = _raw(data, key, source, prefix, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(source, prefix + key, f"must be an integer (got {value!r})")
    if minimum is not None and value < minimum:
        raise _fail(source, prefix + key, f"must be >= {minimum} (got {value})")
    return value


def get_float(
    data: Mapping[str, Any],
    key: str,
    *,
    source: str,
    prefix: str = "",
    minimum: float | None = None,
    default: Any = _MISSING,
) -> float:
    value = _raw(data, key, source, prefix, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(source, prefix + key, f"must be a number (got {value!r})")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise _fail(source, prefix + key, f"must be finite (got {value})")
    if minimum is not None and value < minimum:
        raise _fail(source, prefix + key, f"must be a number >= {minimum} (got {value})")
    return value


def get_str(
    data: Mapping[str, Any],
    key: str,
    *,
    source: str,
    prefix: str = "",
    choices: tuple[str, ...] | None = None,
    default: Any = _MISSING,
) -> str:
    value = _raw(data, key, source, prefix, default)
    if not isinstance(value, str):
        raise _fail(source, prefix + key, f"must be a string (got {value!r})")
    if choices is not None and value not in choices:
        raise _fail(source, prefix + key, f"must be one of {', '.join(choices)} (got {value!r})")
    return value


def get_bool(
    data: Mapping[str, Any], key: str, *, source: str, prefix: str = "", default: Any = _MISSING
) -> bool:
    value = _raw(data, key, source, prefix, default)
    if not isinstance(value, bool):
        raise _fail(source, prefix + key, f"must be true or false (got {value!r})")
    return value


def get_list(
    data: Mapping[str, Any], key: str, *, source: str, prefix: str = "", default: Any = _MISSING
) -> list[Any]:
    value = _raw(data, key, source, prefix, default)
    if not isinstance(value, list):
        raise _fail(source, prefix + key, f"must be a list (got {type(value).__name__})")
    return value


def check_kind(data: Mapping[str, Any], *, kind: str, version: int, source: str) -> None:
    """Check the ``kind`` and ``version`` header every plan file carries."""
    got_kind = get_str(data, "kind", source=source)
    if got_kind != kind:
        raise PlanError(
            f"{source}: kind must be {kind!r} (got {got_kind!r}); is this the right file?"
        )
    got_version = get_int(data, "version", source=source)
    if got_version != version:
        raise PlanError(
            f"{source}: version {got_version} of {kind} is not supported (this adaptipe reads version {version})"
        )


def read_text(path: str | os.PathLike[str]) -> str:
    """A file's text; a missing or unreadable file is a `PlanError` that names it."""
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise PlanError(f"{p}: no such file") from None
    except OSError as exc:
        raise PlanError(f"{p}: cannot read ({exc.strerror})") from None


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; a parse error names the file, line and column."""
    p = Path(path)
    text = read_text(p)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None


def load_json_file(path: str | os.PathLike[str], from_json: Callable[..., T]) -> T:
    """Read ``path`` and build a plan type from it, naming the file in any error."""
    return from_json(read_json(path), source=str(path))


def new_file_mode() -> int:
    """The permissions ``open()`` gives a new file under this process's umask.

    Atomic writes go through `tempfile.mkstemp`, which creates files 0600 whatever the
    umask; without this, a run directory mixed private files with readable ones."""
    try:
        with open("/proc/self/status") as fh:  # Linux: the umask without changing it
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write a file atomically: temp file in the same folder, fsync, rename."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), new_file_mode())
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (a diverged loss: NaN, inf) made None, so
    it serialises as strict JSON (``null``), which every JSON reader accepts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_line(record: Any, **kwargs: Any) -> str:
    """One JSON-lines record, strict JSON (non-finite floats as null), newline-terminated."""
    return json.dumps(finite(record), allow_nan=False, **kwargs) + "\n"


def write_json(path: str | os.PathLike[str], data: Any, *, strict: bool = False) -> None:
    """Write ``data`` as JSON, atomically. ``strict``: non-finite floats (a diverged
    job's loss) become ``null``, which every JSON reader accepts; without it they are
    written as ``NaN`` / ``Infinity``, which Python reads back (plans, profiles)."""
    if strict:
        text = json.dumps(finite(data), indent=2, allow_nan=False)
    else:
        text = json.dumps(data, indent=2)
    atomic_write_text(path, text + "\n")
