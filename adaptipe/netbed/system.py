"""Running ``ip`` and ``tc``, and finding out whether this machine can build a bed.

Every command has a timeout and fails with a `NetbedError` that quotes the command and
its error. `available` tries the real thing once per process (a namespace with a veth,
a bridge and the HTB tree): being root is not enough inside a container without
CAP_SYS_ADMIN, and a kernel may lack a qdisc.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from adaptipe.errors import NetbedError
from adaptipe.netbed.shape import LinkShape, tc_commands

__all__ = [
    "available",
    "namespace_pids",
    "namespaces",
    "root_kind_of",
    "root_links",
    "run_command",
]

_TIMEOUT_S = 20.0
_TOOLS = {"ip": "iproute2", "tc": "iproute2", "taskset": "util-linux"}


def run_command(
    argv: Sequence[str], *, timeout: float = _TIMEOUT_S, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command; with ``check``, a failure is a NetbedError."""
    shown = " ".join(argv)
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise NetbedError(f"`{shown}`: no {argv[0]} command on PATH") from None
    except subprocess.TimeoutExpired:
        raise NetbedError(f"`{shown}` did not finish in {timeout:g} s") from None
    if check and done.returncode != 0:
        why = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        raise NetbedError(f"`{shown}` failed: {why}")
    return done


def _json(argv: Sequence[str]) -> Any:
    out = run_command(argv).stdout.strip()
    return json.loads(out) if out else []


def namespaces() -> list[str]:
    """The names of this machine's named network namespaces (``ip netns list``)."""
    return [row["name"] for row in _json(["ip", "-j", "netns", "list"])]


def root_links() -> list[str]:
    """The names of the root namespace's interfaces."""
    return [row["ifname"] for row in _json(["ip", "-j", "link", "show"])]


def namespace_pids(name: str) -> list[int]:
    """The processes running in namespace ``name`` (``ip netns pids``)."""
    out = run_command(["ip", "netns", "pids", name]).stdout
    return [int(word) for word in out.split()]


def root_kind_of(netns: str, dev: str) -> str:
    """The kind of ``dev``'s root qdisc in ``netns`` (``noqueue`` when it has none)."""
    rows = _json(["tc", "-n", netns, "-j", "qdisc", "show", "dev", dev, "root"])
    return str(rows[0]["kind"]) if rows else "noqueue"


def available(*, netem: bool = False) -> str | None:
    """None when this machine can build a bed (with ``netem``: and shape delay, jitter
    and loss), else the reason it cannot; tests skip with it."""
    base, netem_reason = _probe()
    if base is not None:
        return base
    return netem_reason if netem else None


@functools.cache
def _probe() -> tuple[str | None, str | None]:
    """(why no bed, why no netem); each None when it works. Builds what a bed builds:
    a namespace, a veth, a bridge, a shaped link's tree, a command pinned to a core."""
    missing = [tool for tool in _TOOLS if not shutil.which(tool)]
    if missing:
        packages = ", ".join(sorted({_TOOLS[tool] for tool in missing}))
        return f"cannot find {', '.join(missing)} on PATH (install {packages})", "no bed"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})", "no bed"
    name = f"ap-probe-{os.getpid()}"
    ns = ["ip", "-n", name]
    rate = LinkShape(rate_mbit=1)
    steps = [
        ("create a network namespace", ["ip", "netns", "add", name]),
        (
            "make a veth pair",
            [*ns, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"],
        ),
        ("make a bridge", [*ns, "link", "add", "name", "br", "type", "bridge"]),
        ("pin a command to a core", ["ip", "netns", "exec", name, "taskset", "-c", "0", "true"]),
    ]
    steps += [
        ("shape a link", argv)
        for argv in tc_commands(netns=name, dev="a", shape=rate, current="noqueue")
    ]
    delay = LinkShape(rate_mbit=1, delay_ms=1)
    try:
        for what, argv in steps:
            why = _fails(argv)
            if why:
                return f"cannot {what} here (`{' '.join(argv)}`: {why})", "no bed"
        for argv in tc_commands(netns=name, dev="a", shape=delay, current="tbf"):
            why = _fails(argv)
            if why:
                return None, (
                    "this kernel has no netem qdisc (sch_netem, CONFIG_NET_SCH_NETEM), so "
                    f"delay, jitter and loss cannot be shaped; rate and priority work ({why})"
                )
        return None, None
    except NetbedError as exc:  # a timeout
        return str(exc), "no bed"
    finally:
        run_command(["ip", "netns", "del", name], check=False)


def _fails(argv: list[str]) -> str | None:
    """Why ``argv`` failed, or None when it worked."""
    done = run_command(argv, check=False)
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
