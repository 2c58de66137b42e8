"""A link's shape as people type it: ``20mbit``, ``5ms``, ``0.1%``, or plain numbers.

``adaptipe hosts up|shape`` and the ``link_shape`` injector of scenario files both read
shapes here, so a rate means the same everywhere. Text carries its unit: a rate goes
through `adaptipe.units.parse_bandwidth` (``20mbit``, ``1gbit``, ``2.5MB/s``; ``inf`` is
unshaped), a time is ``1ms``, ``500us`` or ``0.1s``, a loss ``0.1%`` (or ``0.1``). A
number (from TOML) is in the unit `LinkShape` keeps: Mbit/s, milliseconds, percent.

Text without a unit is refused for rates and times: ``"100"`` would be 100 bytes/s to
`parse_bandwidth`, which nobody shaping a link means.
"""

from __future__ import annotations

import math
import re

from adaptipe.errors import PlanError
from adaptipe.netbed.shape import LinkShape
from adaptipe.units import parse_bandwidth

__all__ = ["ShapeValue", "parse_loss", "parse_ms", "parse_rate", "parse_shape"]

ShapeValue = str | int | float
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_TIME = re.compile(rf"^\s*{_NUMBER}\s*(us|ms|s)\s*$")
_MS_PER = {"us": 1e-3, "ms": 1.0, "s": 1e3}
_PERCENT = re.compile(rf"^\s*{_NUMBER}\s*%?\s*$")
_BARE = re.compile(rf"^\s*{_NUMBER}\s*$")
_NAMES = {
    "rate_mbit": "rate (in Mbit/s)",
    "delay_ms": "delay (in ms)",
    "jitter_ms": "jitter (in ms)",
    "loss_pct": "loss (in %)",
}


def _number(value: ShapeValue, what: str, examples: str) -> float | None:
    """``value`` as a float when it is a number, None when it is text; else an error."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise PlanError(f"{what} must be text with a unit or a number: {examples} (got {value!r})")
    return None if isinstance(value, str) else float(value)


def parse_rate(value: ShapeValue, *, what: str = "rate") -> float | None:
    """Mbit/s from ``"20mbit"``, ``"2.5MB/s"`` or a number of Mbit/s; None for ``"inf"``."""
    examples = '"20mbit", "1gbit", "2.5MB/s", "inf" (no limit), or 20 for Mbit/s'
    number = _number(value, what, examples)
    if number is not None:
        return number
    assert isinstance(value, str)
    if _BARE.match(value):
        raise PlanError(f"{what} {value!r} has no unit (examples: {examples})")
    try:
        rate = parse_bandwidth(value, what=what) * 8 / 1e6
    except PlanError:
        raise PlanError(f"{what} {value!r} is not a rate (examples: {examples})") from None
    return None if math.isinf(rate) else rate


def parse_ms(value: ShapeValue, *, what: str = "delay") -> float:
    """Milliseconds from ``"20ms"``, ``"500us"``, ``"0.1s"`` or a number of milliseconds."""
    number = _number(value, what, '"20ms", "500us", "0.1s", or 20 for ms')
    if number is not None:
        return number
    assert isinstance(value, str)
    m = _TIME.match(value)
    if not m:
        raise PlanError(f"{what} {value!r} is not a time (examples: 20ms, 500us, 0.1s)")
    return float(m.group(1)) * _MS_PER[m.group(2)]


def parse_loss(value: ShapeValue, *, what: str = "loss") -> float:
    """Percent from ``"0.1%"``, ``"0.1"`` or a number of percent."""
    number = _number(value, what, '"0.1%", or 0.1 for percent')
    if number is not None:
        return number
    assert isinstance(value, str)
    m = _PERCENT.match(value)
    if not m:
        raise PlanError(f"{what} {value!r} is not a percentage (examples: 1%, 0.1%)")
    return float(m.group(1))


def parse_shape(
    *,
    rate: ShapeValue | None = None,
    delay: ShapeValue | None = None,
    jitter: ShapeValue | None = None,
    loss: ShapeValue | None = None,
    where: str = "",
) -> LinkShape:
    """The `LinkShape` these values give; ``where`` prefixes the names in errors
    (``--`` for the CLI, ``s.toml: inject[0].`` for a scenario)."""
    if jitter is not None and delay is None:
        raise PlanError(f"{where}jitter needs a delay (netem jitters a delay)")
    values = {
        "rate_mbit": None if rate is None else parse_rate(rate, what=f"{where}rate"),
        "delay_ms": None if delay is None else parse_ms(delay, what=f"{where}delay"),
        "jitter_ms": None if jitter is None else parse_ms(jitter, what=f"{where}jitter"),
        "loss_pct": None if loss is None else parse_loss(loss, what=f"{where}loss"),
    }
    try:
        return LinkShape(**values)
    except PlanError as exc:  # a value out of range: say it with the name given here
        field, _, problem = str(exc).removeprefix("LinkShape: ").partition(" ")
        problem = problem.replace(", or null (unshaped)", "")
        raise PlanError(f"{where}{_NAMES.get(field, field)} {problem}") from None
