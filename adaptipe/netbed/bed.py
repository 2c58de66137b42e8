"""What a test bed is: its hosts (names, addresses, CPU sets, link shapes) as plain data.

Every object a bed makes carries its prefix: host namespaces ``ap-<prefix>-h<i>`` (the
host's end of its veth has the same name), the switch namespace ``ap-<prefix>-sw`` with
the bridge ``ap-<prefix>-br`` and one port ``ap-<prefix>-s<i>`` per host. Interface
names may have 15 characters, so a prefix has at most 8 letters or digits and a bed at
most 99 hosts. A prefix has no ``-``, so ``ap-t1-`` never matches another bed's objects.

Addresses are in 192.0.2.0/24 (TEST-NET-1, RFC 5737: reserved for documentation and
tests, never routed), host ``i`` at ``192.0.2.<i + 1>``.

A namespace has no CPU set of its own, so a host is a namespace plus the cores its
commands are pinned to: `Host.command` wraps a command in ``ip netns exec`` and
``taskset``.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.netbed.shape import LinkShape
from adaptipe.serial import check_kind, get_int, get_list, get_str

__all__ = ["MAX_HOSTS", "SUBNET", "Bed", "Host", "check_prefix", "names_of", "plan_bed"]

SUBNET = ipaddress.IPv4Network("192.0.2.0/24")
MAX_HOSTS = 99
_PREFIX = re.compile(r"[a-z0-9]{1,8}")
_KIND = "netbed"
_VERSION = 1


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can name a bed's objects, else a PlanError saying what can."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise PlanError(
            f"bed prefix must be 1 to 8 lowercase letters or digits (got {prefix!r}): "
            "it goes into interface names, which may have 15 characters"
        )
    return prefix


def names_of(prefix: str) -> re.Pattern[str]:
    """Matches the name of every namespace and interface a bed with ``prefix`` makes."""
    return re.compile(rf"ap-{re.escape(check_prefix(prefix))}-(?:sw|br|[hs][0-9]{{1,2}})")


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    """One host of a bed: a network namespace, its link to the switch and its cores."""

    index: int
    namespace: str
    interface: str  # the host's end of its veth, inside `namespace`
    port: str  # the switch's end, inside the bed's switch namespace
    address: str
    cpus: tuple[int, ...]
    shape: LinkShape

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this host's namespace, pinned to its cores."""
        cpus = ",".join(str(c) for c in self.cpus)
        return ["ip", "netns", "exec", self.namespace, "taskset", "-c", cpus, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host; the process's pid is the command's own (``ip`` and
        ``taskset`` exec it), so it can be stopped by pid."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(
        self, argv: Sequence[str], *, timeout: float, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on this host to its end, at most ``timeout`` seconds."""
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "namespace": self.namespace,
            "interface": self.interface,
            "port": self.port,
            "address": self.address,
            "cpus": list(self.cpus),
            "shape": self.shape.to_json(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Bed:
    """A test bed: hosts joined by one bridge in a switch namespace of their own."""

    prefix: str
    switch: str
    bridge: str
    hosts: tuple[Host, ...]

    def host(self, index: int) -> Host:
        if isinstance(index, bool) or not isinstance(index, int):
            raise PlanError(f"host must be an index (got {index!r})")
        if not 0 <= index < len(self.hosts):
            raise PlanError(
                f"bed {self.prefix} has hosts 0 to {len(self.hosts) - 1} (got host {index})"
            )
        return self.hosts[index]

    def with_shape(self, index: int, shape: LinkShape) -> Bed:
        """This bed with host ``index``'s link shaped to ``shape``."""
        hosts = list(self.hosts)
        hosts[index] = replace(self.host(index), shape=shape)
        return replace(self, hosts=tuple(hosts))

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": _KIND,
            "version": _VERSION,
            "prefix": self.prefix,
            "switch": self.switch,
            "bridge": self.bridge,
            "subnet": str(SUBNET),
            "hosts": [h.to_json() for h in self.hosts],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str = "bed") -> Bed:
        """Read a bed, checking that every name is the one its prefix gives and every
        address is in 192.0.2.0/24: `down` and `shape` act on these names."""
        check_kind(data, kind=_KIND, version=_VERSION, source=source)
        prefix = get_str(data, "prefix", source=source)
        rows = get_list(data, "hosts", source=source)
        try:
            expected = plan_bed(prefix=prefix, shapes=[LinkShape()] * len(rows), cpus=[0])
        except PlanError as exc:
            raise PlanError(f"{source}: {exc}") from None
        for key in ("switch", "bridge"):
            got = get_str(data, key, source=source)
            if got != getattr(expected, key):
                raise PlanError(
                    f"{source}: {key} must be {getattr(expected, key)!r} for prefix "
                    f"{prefix} (got {got!r})"
                )
        hosts = tuple(
            _host_from_json(row, want, source=source, prefix=f"hosts[{i}].")
            for i, (row, want) in enumerate(zip(rows, expected.hosts, strict=True))
        )
        return cls(prefix=prefix, switch=expected.switch, bridge=expected.bridge, hosts=hosts)


def _host_from_json(row: Any, want: Host, *, source: str, prefix: str) -> Host:
    for key in ("namespace", "interface", "port", "address"):
        got = get_str(row, key, source=source, prefix=prefix)
        if got != getattr(want, key):
            raise PlanError(
                f"{source}: {prefix}{key} must be {getattr(want, key)!r} (got {got!r}); "
                f"a bed's names and addresses follow from its prefix and host index"
            )
    if ipaddress.IPv4Address(want.address) not in SUBNET:  # plan_bed's promise, checked
        raise PlanError(f"{source}: {prefix}address {want.address} is not in {SUBNET}")
    index = get_int(row, "index", source=source, prefix=prefix)
    if index != want.index:
        raise PlanError(f"{source}: {prefix}index must be {want.index} (got {index})")
    cpus = get_list(row, "cpus", source=source, prefix=prefix)
    if not cpus or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cpus):
        raise PlanError(
            f"{source}: {prefix}cpus must be a non-empty list of core numbers (got {cpus!r})"
        )
    shape = LinkShape.from_json(row.get("shape", {}), source=source, prefix=f"{prefix}shape.")
    return replace(want, cpus=tuple(cpus), shape=shape)


def plan_bed(
    *, prefix: str, shapes: Sequence[LinkShape], cpus: Sequence[int], cpus_per_host: int = 1
) -> Bed:
    """The bed with one host per shape, host ``i`` on cores ``cpus[i * k : i * k + k]``
    (``k = cpus_per_host``, wrapping round ``cpus``); it makes nothing."""
    check_prefix(prefix)
    if not 1 <= len(shapes) <= MAX_HOSTS:
        raise PlanError(f"a bed has 1 to {MAX_HOSTS} hosts (got {len(shapes)})")
    if not cpus:
        raise PlanError("a bed needs at least one core to pin its hosts to (got none)")
    if not 1 <= cpus_per_host <= len(cpus):
        raise PlanError(
            f"cpus_per_host must be 1 to {len(cpus)}, the cores there are (got {cpus_per_host})"
        )
    base = f"ap-{prefix}"
    hosts = []
    for i, shape in enumerate(shapes):
        address = SUBNET[i + 1]
        assert address in SUBNET
        mine = sorted({cpus[(i * cpus_per_host + j) % len(cpus)] for j in range(cpus_per_host)})
        hosts.append(
            Host(
                index=i,
                namespace=f"{base}-h{i}",
                interface=f"{base}-h{i}",
                port=f"{base}-s{i}",
                address=str(address),
                cpus=tuple(mine),
                shape=shape,
            )
        )
    return Bed(prefix=prefix, switch=f"{base}-sw", bridge=f"{base}-br", hosts=tuple(hosts))
