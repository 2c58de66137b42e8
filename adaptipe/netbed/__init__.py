"""A test bed of namespace hosts: N network namespaces on one bridge, with shaped links.

Each host is a network namespace pinned to its own cores, joined by a veth pair to a
bridge in a switch namespace of its own, on an address in 192.0.2.0/24; each link has
a rate, delay, jitter and loss (`LinkShape`) that can change while the bed runs, and
priority bands picked by the IP TOS byte. Nothing in the root namespace's network
changes. Needs root, ``ip`` and ``tc``; `available` says whether this machine can.
See docs/multi-host.md, "A test bed of namespace hosts".
"""

from __future__ import annotations

from adaptipe.netbed.bed import SUBNET, Bed, Host
from adaptipe.netbed.lifecycle import SEND_BUFFER, down, load, shape, state_path, up
from adaptipe.netbed.parse import parse_shape
from adaptipe.netbed.shape import LinkShape
from adaptipe.netbed.system import available

__all__ = [
    "SEND_BUFFER",
    "SUBNET",
    "Bed",
    "Host",
    "LinkShape",
    "available",
    "down",
    "load",
    "parse_shape",
    "shape",
    "state_path",
    "up",
]
