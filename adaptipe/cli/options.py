"""Command-line values that no library function parses: ``--set`` pairs, number lists."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from adaptipe.errors import PlanError

__all__ = ["parse_floats", "parse_overrides"]


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``--set n_layer=6`` -> ``{"n_layer": 6}`` (values parsed as JSON when they can be)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PlanError(f"--set {pair!r} must look like name=value (e.g. --set n_layer=6)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def parse_floats(text: str, *, what: str) -> list[float]:
    """``1,1.5,1`` -> ``[1.0, 1.5, 1.0]``; ``what`` names the flag in the error."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise PlanError(f"{what} {text!r} must be comma-separated numbers (e.g. 1,1.5,1)") from None
