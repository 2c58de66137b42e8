"""Parse and print the quantities users type: bandwidths and byte sizes."""

from __future__ import annotations

import math
import re

from adaptipe.errors import PlanError

__all__ = ["format_bytes", "parse_bandwidth", "parse_bytes"]

_BYTES = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str, *, what: str = "size") -> float:
    """``"4GiB"`` -> 4294967296; plain numbers are bytes."""
    m = _NUMBER.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _BYTES:
        raise PlanError(f"{what} {text!r} is not a size (examples: 1048576, 512MB, 4GiB)")
    return float(m.group(1)) * _BYTES[unit]


def parse_bandwidth(text: str, *, what: str = "bandwidth") -> float:
    """Bytes per second from ``"1e9"``, ``"10GB/s"``, ``"25Gbit/s"`` or ``"inf"``."""
    if text.strip().lower() in ("inf", "infinite", "none"):
        return math.inf
    body = text.strip()
    if body.lower().endswith("/s") or body.lower().endswith("ps"):
        body = body[:-2]
    m = _NUMBER.match(body)
    unit = m.group(2).lower() if m else ""
    factor = _BYTES.get(unit) or _BITS.get(unit)
    if not m or factor is None:
        raise PlanError(
            f"{what} {text!r} is not a bandwidth (examples: 1e9 (bytes/s), 10GB/s, 25Gbit/s, inf)"
        )
    value = float(m.group(1)) * factor
    if value <= 0:
        raise PlanError(f"{what} must be > 0 (got {text!r})")
    return value


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
