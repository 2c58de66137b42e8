"""How a host's link is shaped: `LinkShape` and the ``tc`` commands that build it.

A host's link is its veth pair to the switch. A shape acts on both ends, as a cable
would: on the host's end (what the host sends) and on the switch's port (what the host
receives). A path between two hosts crosses two links, so a round trip crosses the
delay of each twice.

On each end the tree is (found by experiment; docs/multi-host.md gives the runs)::

    tbf 1:  rate R, peakrate 2R, mtu 1600          the link's rate
      htb 2:  default 2:11                         priority only (its rates never bind)
        class 2:10  prio 0     <- TOS 0x10 (and 0x12-0x16)
        class 2:11  prio 1     <- everything else
        class 2:12  prio 2     <- TOS 0x08 (and 0x0a-0x0e, 0x02)
      each band's leaf: bfifo (10:, 11:, 12:), or netem (20:, 21:, 22:) for delay/jitter/loss

Why this tree:

- Packets queue under the rate limiter, so the bands sit there: when tbf may send, HTB
  hands it the head of the highest band with a packet (strict priority, as ``prio``).
- tbf, not HTB, holds the rate because tbf splits a GSO packet larger than its ``mtu``
  into wire-size packets and charges each its full size. A packet the bridge forwards
  has no transport header set, so HTB charged a 64 KiB GSO packet for one header:
  a 5 mbit HTB port let 5.2 Mbit/s of TCP payload through, tbf lets 4.78 (the payload
  share of 5 Mbit/s of 1514-byte frames). ``peakrate`` is only there to make ``mtu``
  count; 2R never binds.
- HTB and u32, not ``prio``: the kernel this was built on (a 6.18 VM kernel) has
  neither ``prio`` nor ``netem``; tbf, HTB, u32 and the fifos are in every kernel built
  for traffic control. ``netem`` is used only for delay, jitter and loss.
- The band comes from the IP header's TOS byte, matched by u32 filters that follow
  Linux's default prio map. A socket's priority does not cross the bridge (at the
  switch port every flow looked like default priority); the header does. So
  ``setsockopt(IPPROTO_IP, IP_TOS, 0x08)`` (ZeroMQ: ``zmq.TOS``) marks a flow low on
  both ends of both links.
- netem is a band's leaf, not the root: the root stays tbf whatever the delay, so a
  live change of rate or delay changes the tbf and replaces leaves in place and drops
  nothing queued. A shape with delay but no rate is netem alone at the root (no queue,
  no bands); moving between the two kinds rebuilds the tree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adaptipe.errors import PlanError

__all__ = ["BANDS", "LinkShape", "root_kind", "tc_commands"]

# (class minor, prio) per band, highest first; minors are hexadecimal to tc.
BANDS: tuple[tuple[int, int], ...] = ((0x10, 0), (0x11, 1), (0x12, 2))
_DEFAULT_BAND = 0x11
# u32 matches on the TOS byte (value, mask) -> band: Linux's default prio map, where
# rt_tos2priority sends TOS 0x10-0x16 to band 0, 0x08-0x0e and 0x02 to band 2.
_TOS_FILTERS: tuple[tuple[int, int, int], ...] = (
    (0x10, 0x18, 0x10),
    (0x08, 0x18, 0x12),
    (0x02, 0x1E, 0x12),
)
_MTU = 1600  # bytes: at least an Ethernet frame (1514); tbf splits larger GSO packets
_HTB_ARGS = ("rate", "1000gbit", "ceil", "1000gbit", "burst", "1mb", "cburst", "1mb")
_QUEUE_S = 0.1  # a band's fifo holds this long at the link's rate ...
_QUEUE_MIN_BYTES = 128 * 1024  # ... and at least 128 KiB
_NETEM_LIMIT = 10_000  # packets; netem holds every packet for its delay
_FIELDS = ("rate_mbit", "delay_ms", "jitter_ms", "loss_pct")
# field -> (lowest, highest, lowest excluded)
_LIMITS: dict[str, tuple[float, float, bool]] = {
    "rate_mbit": (0.0, 100_000.0, True),
    "delay_ms": (0.0, 60_000.0, False),
    "jitter_ms": (0.0, 60_000.0, False),
    "loss_pct": (0.0, 100.0, False),
}


def _problem(field: str, value: object) -> str | None:
    """What is wrong with one field's value, or None; the text follows the field name."""
    if value is None:
        return None
    low, high, strict = _LIMITS[field]
    allowed = f"a number {'>' if strict else '>='} {low:g} and <= {high:g}, or null (unshaped)"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be {allowed} (got {value!r})"
    if not math.isfinite(value) or value < low or (strict and value == low) or value > high:
        return f"must be {allowed} (got {value!r})"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkShape:
    """One host link's rate, delay, jitter and loss, each direction; None = unshaped.

    Args:
        rate_mbit: the link's rate in megabits per second (10**6 bits).
        delay_ms: added to every packet, each direction (needs netem).
        jitter_ms: the delay varies uniformly by up to this much (needs ``delay_ms``).
        loss_pct: the share of packets dropped at random, each direction (needs netem).
    """

    rate_mbit: float | None = None
    delay_ms: float | None = None
    jitter_ms: float | None = None
    loss_pct: float | None = None

    def __post_init__(self) -> None:
        for field in _FIELDS:
            problem = _problem(field, getattr(self, field))
            if problem:
                raise PlanError(f"LinkShape: {field} {problem}")
        if self.jitter_ms is not None and self.delay_ms is None:
            raise PlanError("LinkShape: jitter_ms needs delay_ms (netem jitters a delay)")

    @property
    def shaped(self) -> bool:
        return any(getattr(self, field) is not None for field in _FIELDS)

    @property
    def needs_netem(self) -> bool:
        """Delay, jitter or loss: only the netem qdisc does these."""
        return self.delay_ms is not None or self.loss_pct is not None

    def describe(self) -> str:
        """``20 mbit, 5 ms delay +- 1 ms, 0.1% loss`` or ``unshaped``."""
        parts: list[str] = []
        if self.rate_mbit is not None:
            parts.append(f"{self.rate_mbit:g} mbit")
        if self.delay_ms is not None:
            jitter = f" +- {self.jitter_ms:g} ms" if self.jitter_ms is not None else ""
            parts.append(f"{self.delay_ms:g} ms delay{jitter}")
        if self.loss_pct is not None:
            parts.append(f"{self.loss_pct:g}% loss")
        return ", ".join(parts) or "unshaped"

    def to_json(self) -> dict[str, float | None]:
        return {field: getattr(self, field) for field in _FIELDS}

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], *, source: str = "link shape", prefix: str = ""
    ) -> LinkShape:
        if not isinstance(data, Mapping):
            where = prefix.rstrip(".") or "a link shape"
            raise PlanError(f"{source}: {where} must be an object (got {type(data).__name__})")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise PlanError(
                f"{source}: {prefix}{unknown[0]} is not a link shape field "
                f"(allowed: {', '.join(_FIELDS)})"
            )
        for field in _FIELDS:
            problem = _problem(field, data.get(field))
            if problem:
                raise PlanError(f"{source}: {prefix}{field} {problem}")
        if data.get("jitter_ms") is not None and data.get("delay_ms") is None:
            raise PlanError(f"{source}: {prefix}jitter_ms needs delay_ms (netem jitters a delay)")
        values = {field: data.get(field) for field in _FIELDS}
        return cls(**{k: None if v is None else float(v) for k, v in values.items()})


def root_kind(shape: LinkShape) -> str:
    """The root qdisc a shape needs: ``tbf`` (a rate), ``netem`` (delay or loss only) or
    ``noqueue`` (unshaped: a veth's own default)."""
    if shape.rate_mbit is not None:
        return "tbf"
    return "netem" if shape.needs_netem else "noqueue"


def _netem_args(shape: LinkShape) -> list[str]:
    args = ["netem", "limit", str(_NETEM_LIMIT)]
    if shape.delay_ms is not None:
        args += ["delay", f"{round(shape.delay_ms * 1000)}us"]
        if shape.jitter_ms is not None:
            args.append(f"{round(shape.jitter_ms * 1000)}us")
    if shape.loss_pct is not None:
        args += ["loss", f"{shape.loss_pct:.6g}%"]
    return args


def _tbf_args(rate_mbit: float) -> list[str]:
    rate = round(rate_mbit * 1e6)
    burst = max(_MTU, rate // 8 // 1000)  # 1 ms at the rate: timer slack cannot cut it
    args = ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "100ms"]
    return [*args, "peakrate", f"{2 * rate}bit", "mtu", str(_MTU)]


def _leaves(tc: list[str], dev: str, shape: LinkShape, verb: str) -> list[list[str]]:
    """One leaf per band. A leaf's handle names its kind (fifo 1N:, netem 2N:), so
    ``replace`` changes a leaf of the same kind in place and grafts a new one over a leaf
    of the other kind."""
    assert shape.rate_mbit is not None
    limit = max(_QUEUE_MIN_BYTES, round(shape.rate_mbit * 1e6 / 8 * _QUEUE_S))
    leaf = _netem_args(shape) if shape.needs_netem else ["bfifo", "limit", str(limit)]
    cmds = []
    for minor, _ in BANDS:
        handle = f"{minor + 0x10:x}:" if shape.needs_netem else f"{minor:x}:"
        cmds.append([*tc, "qdisc", verb, "dev", dev, "parent", f"2:{minor:x}", "handle", handle])
        cmds[-1] += leaf
    return cmds


def _fresh_tree(tc: list[str], dev: str, shape: LinkShape) -> list[list[str]]:
    assert shape.rate_mbit is not None
    on = [*tc, "qdisc", "add", "dev", dev]
    cmds = [
        [*on, "root", "handle", "1:", *_tbf_args(shape.rate_mbit)],
        [*on, "parent", "1:1", "handle", "2:", "htb", "default", f"{_DEFAULT_BAND:x}"],
        [*tc, "class", "add", "dev", dev, "parent", "2:", "classid", "2:1", "htb", *_HTB_ARGS],
    ]
    for minor, prio in BANDS:
        cmds.append([*tc, "class", "add", "dev", dev, "parent", "2:1", "classid", f"2:{minor:x}"])
        cmds[-1] += ["htb", *_HTB_ARGS, "prio", str(prio), "quantum", "1514"]
    cmds += _leaves(tc, dev, shape, "add")
    for pref, (value, mask, band) in enumerate(_TOS_FILTERS, start=1):
        cmds.append([*tc, "filter", "add", "dev", dev, "parent", "2:", "protocol", "ip"])
        cmds[-1] += ["prio", str(pref), "u32", "match", "ip", "tos", hex(value), hex(mask)]
        cmds[-1] += ["flowid", f"2:{band:x}"]
    return cmds


def tc_commands(*, netns: str, dev: str, shape: LinkShape, current: str) -> list[list[str]]:
    """The ``tc`` commands that shape ``dev`` in namespace ``netns`` to ``shape``.

    Args:
        current: the kind of ``dev``'s root qdisc now (``tc qdisc show``): the same kind
            is changed in place, another is deleted and the tree built afresh.
    """
    tc = ["tc", "-n", netns]
    target = root_kind(shape)
    root = [*tc, "qdisc", "change", "dev", dev, "root", "handle", "1:"]
    if current == target == "netem":
        return [[*root, *_netem_args(shape)]]
    if current == target == "tbf":
        assert shape.rate_mbit is not None
        return [[*root, *_tbf_args(shape.rate_mbit)], *_leaves(tc, dev, shape, "replace")]
    if current == target:
        return []
    cmds = [] if current == "noqueue" else [[*tc, "qdisc", "del", "dev", dev, "root"]]
    if target == "netem":
        cmds.append([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", *_netem_args(shape)])
    elif target == "tbf":
        cmds += _fresh_tree(tc, dev, shape)
    return cmds
