"""A trace family's parameters, read and checked (`adaptipe.envs.generators`).

Parameters are kw-only dataclass fields whose metadata (`rule`) says how a value is
read: ``int``, ``float`` (with ``minimum``, ``above``, ``maximum``), ``bool``,
``bandwidth`` (bytes/s, text such as ``"10Gbit/s"``, or None: unlimited), ``floats``
and ``names`` (lists; ``names`` from ``choices``), or ``internal`` (never given by a
user). Text, as the command line gives it, is converted to the parameter's type, and a
list may be given comma-separated. Every refusal names the parameter and what is
allowed.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import Field, fields
from typing import Any, TypeVar

from adaptipe.errors import PlanError
from adaptipe.units import parse_bandwidth

__all__ = ["read_params", "rule", "to_json"]

T = TypeVar("T")
_LIMITS = (
    ("minimum", ">=", operator.ge),
    ("above", ">", operator.gt),
    ("maximum", "<=", operator.le),
)


def rule(kind: str, **limits: Any) -> dict[str, Any]:
    """Field metadata: how `read_params` reads and checks the field."""
    return {"kind": kind, **limits}


def read_params(cls: type[T], raw: Mapping[str, Any], *, where: str, what: str) -> T:
    """``cls`` from the values in ``raw`` (the defaults for the others).

    Args:
        where: the message's prefix (``"family colocated: "``).
        what: what the parameters are of, in the message (``colocated``).
    """
    known = {f.name: f for f in fields(cls) if f.metadata["kind"] != "internal"}  # type: ignore[arg-type]
    for name in raw:
        if name not in known:
            allowed = ", ".join(known)
            raise PlanError(f"{where}{name} is not a parameter of {what} (allowed: {allowed})")
    return cls(**{name: _value(known[name], value, where) for name, value in raw.items()})


def to_json(params: Any, *, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """The parameters as JSON types; a mapping of parameter sets nests each, less
    ``leave_out``."""
    out: dict[str, Any] = {}
    for f in fields(params):
        value = getattr(params, f.name)
        if isinstance(value, Mapping):
            for name, child in value.items():
                out[name] = {k: v for k, v in to_json(child).items() if k not in leave_out}
        else:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _value(f: Field[Any], value: Any, where: str) -> Any:
    limits, name = f.metadata, f"{where}{f.name}"
    kind = limits["kind"]
    if kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise PlanError(f"{name} must be true or false (got {value!r})")
        return value
    if kind == "bandwidth":
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        if isinstance(value, str):
            bps = parse_bandwidth(value, what=name)
            return None if math.isinf(bps) else bps
        return _number(value, name, "float", {**limits, "above": 0.0})
    if kind in ("floats", "names"):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not items:
            raise PlanError(f"{name} must be a non-empty list (got {value!r})")
        if kind == "floats":
            return tuple(_number(v, f"{name} entry", "float", limits) for v in items)
        names = tuple(str(v).strip() for v in items)
        choices = limits["choices"]
        if not set(names) <= set(choices) or len(set(names)) < len(names):
            allowed = ", ".join(choices)
            raise PlanError(f"{name} must list distinct names of {allowed} (got {value!r})")
        return names
    return _number(value, name, kind, limits)


def _number(value: Any, name: str, kind: str, limits: Mapping[str, Any]) -> float | int:
    what = "an integer" if kind == "int" else "a number"
    if isinstance(value, str):
        try:
            value = int(value) if kind == "int" else float(value)
        except ValueError:
            raise PlanError(f"{name} must be {what} (got {value!r})") from None
    if isinstance(value, bool) or not isinstance(value, int if kind == "int" else int | float):
        raise PlanError(f"{name} must be {what} (got {value!r})")
    for key, op, test in _LIMITS:
        bound = limits.get(key)
        if bound is not None and not (math.isfinite(value) and test(value, bound)):
            raise PlanError(f"{name} must be {what} {op} {bound:g} (got {value!r})")
    return value if kind == "int" else float(value)
