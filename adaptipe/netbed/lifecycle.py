"""Bring a bed up, shape its links while it runs, and take it down.

`up` first removes whatever an earlier bed with the same prefix left (a killed test
skips its teardown), builds the namespaces, veths and bridge, shapes the links and
writes the bed's description to a state file, so `adaptipe hosts down|shape|show` in
another process knows the bed. `down` needs no state file: it removes every namespace
and interface whose name carries the prefix, after stopping the processes still
running in those namespaces (a namespace with a process in it outlives its name, and
keeps its veth). Nothing is made in the root namespace: the veths are created straight
into the host and switch namespaces, and removing a namespace removes its veths and
their qdiscs.

State files live in ``$ADAPTIPE_NETBED_DIR``, else ``/run/adaptipe-netbed``: /run is
cleared at boot, as network namespaces are.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from adaptipe.errors import NetbedError, PlanError
from adaptipe.netbed.bed import MAX_HOSTS, Bed, Host, check_prefix, names_of, plan_bed
from adaptipe.netbed.shape import LinkShape, tc_commands
from adaptipe.netbed.system import (
    available,
    namespace_pids,
    namespaces,
    root_kind_of,
    root_links,
    run_command,
)
from adaptipe.serial import load_json_file, write_json

__all__ = ["SEND_BUFFER", "STATE_DIR_ENV", "down", "load", "shape", "state_path", "up"]

STATE_DIR_ENV = "ADAPTIPE_NETBED_DIR"
_DEFAULT_STATE_DIR = Path("/run/adaptipe-netbed")
_STOP_WAIT_S = 2.0
_UNSHAPED = LinkShape()


def state_path(prefix: str, state_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the bed with ``prefix`` is described: ``<state_dir>/<prefix>.json``."""
    folder = state_dir or os.environ.get(STATE_DIR_ENV) or _DEFAULT_STATE_DIR
    return Path(folder) / f"{check_prefix(prefix)}.json"


SEND_BUFFER = 64 << 10
"""The bed hosts' TCP send buffer cap, bytes (see `up`)."""


def _require(*, netem: bool, why: str = "") -> None:
    reason = available(netem=netem)
    if reason is not None:
        raise NetbedError(f"{why}{reason}")


def up(
    *,
    prefix: str,
    hosts: int,
    shape: LinkShape = _UNSHAPED,
    cpus_per_host: int = 1,
    state_dir: str | os.PathLike[str] | None = None,
    send_buffer: int | None = SEND_BUFFER,
) -> Bed:
    """Build a bed of ``hosts`` hosts with every link shaped to ``shape``, and return its
    description; the function `shape` reshapes one host's link later.

    Each host's TCP send buffers are capped at ``send_buffer`` bytes (None: the
    system's, up to 4 MiB): a send then completes about when its bytes have crossed the
    shaped link, so the runtime's link samples (send post to completion) see the shaped
    rate rather than the speed of filling a buffer.

    Host ``i`` is pinned to core ``i % ncpu`` of the cores this process may use (with
    ``cpus_per_host`` > 1, to that many cores in turn). A failure part-way removes what
    was made.
    """
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
        raise PlanError(f"a bed has 1 to {MAX_HOSTS} hosts (got {hosts!r})")
    cpus = sorted(os.sched_getaffinity(0))
    bed = plan_bed(prefix=prefix, shapes=[shape] * hosts, cpus=cpus, cpus_per_host=cpus_per_host)
    _require(netem=shape.needs_netem, why=f"{shape.describe()}: " if shape.needs_netem else "")
    down(prefix=prefix, state_dir=state_dir)
    try:
        _build(bed)
        if send_buffer is not None:
            _cap_send_buffers(bed, send_buffer)
        for host in bed.hosts:
            _apply(bed, host, host.shape)
        write_json(state_path(prefix, state_dir), bed.to_json())
    except BaseException:
        down(prefix=prefix, state_dir=state_dir)
        raise
    return bed


def _build(bed: Bed) -> None:
    """The namespaces, the bridge, and one veth per host from the host to a bridge port."""
    sw = ["ip", "-n", bed.switch]
    commands = [
        ["ip", "netns", "add", bed.switch],
        [*sw, "link", "add", "name", bed.bridge, "type", "bridge"],
        [*sw, "link", "set", bed.bridge, "up"],
    ]
    for h in bed.hosts:
        on = ["ip", "-n", h.namespace]
        veth = ["ip", "link", "add", "name", h.interface, "netns", h.namespace, "type", "veth"]
        commands += [
            ["ip", "netns", "add", h.namespace],
            [*veth, "peer", "name", h.port, "netns", bed.switch],
            [*sw, "link", "set", h.port, "master", bed.bridge, "up"],
            [*on, "addr", "add", f"{h.address}/24", "dev", h.interface],
            [*on, "link", "set", h.interface, "up"],
            [*on, "link", "set", "lo", "up"],
        ]
    for argv in commands:
        run_command(argv)


def _cap_send_buffers(bed: Bed, limit: int) -> None:
    """``net.ipv4.tcp_wmem`` (per network namespace) with ``limit`` as its maximum."""
    if limit < 4096:
        raise PlanError(f"a host's TCP send buffer needs at least 4096 bytes (got {limit})")
    wmem = f"net.ipv4.tcp_wmem=4096 {min(16384, limit)} {limit}"
    for h in bed.hosts:
        run_command(["ip", "netns", "exec", h.namespace, "sysctl", "-q", "-w", wmem])


def _apply(bed: Bed, host: Host, link: LinkShape) -> None:
    """Shape both ends of ``host``'s link: the host's side and the switch's port."""
    for netns, dev in ((host.namespace, host.interface), (bed.switch, host.port)):
        current = root_kind_of(netns, dev)
        for argv in tc_commands(netns=netns, dev=dev, shape=link, current=current):
            run_command(argv)


def load(prefix: str, *, state_dir: str | os.PathLike[str] | None = None) -> Bed:
    """The bed with ``prefix``, from its state file."""
    path = state_path(prefix, state_dir)
    if not path.is_file():
        raise NetbedError(
            f"no bed with prefix {prefix} ({path} does not exist); start one with "
            f"`adaptipe hosts up --prefix {prefix}`"
        )
    return load_json_file(path, Bed.from_json)


def shape(
    bed: Bed, host: int, link: LinkShape, *, state_dir: str | os.PathLike[str] | None = None
) -> Bed:
    """Reshape host ``host``'s link on the running bed; returns the bed as it is now.

    A change of rate, delay, jitter or loss is made in place and keeps what is queued;
    going from a rate to none (or back) rebuilds the tree and drops the queue.
    """
    target = bed.host(host)
    _require(netem=link.needs_netem, why=f"host {host}: {link.describe()}: ")
    missing = [ns for ns in (bed.switch, target.namespace) if ns not in namespaces()]
    if missing:
        raise NetbedError(
            f"bed {bed.prefix} is not running (no namespace {', '.join(missing)}); "
            f"start it with `adaptipe hosts up --prefix {bed.prefix}`"
        )
    _apply(bed, target, link)
    changed = bed.with_shape(host, link)
    write_json(state_path(bed.prefix, state_dir), changed.to_json())
    return changed


def down(*, prefix: str, state_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove every namespace and root interface named for ``prefix``, and its state
    file; returns what was removed (namespaces, interfaces, ``pid N`` for processes
    stopped). Safe to call when nothing is there."""
    ours = names_of(prefix)
    removed: list[str] = []
    mine = [ns for ns in namespaces() if ours.fullmatch(ns)]
    for pid in _stop([pid for ns in mine for pid in namespace_pids(ns)]):
        removed.append(f"pid {pid}")
    for ns in mine:
        run_command(["ip", "netns", "del", ns])
        removed.append(ns)
    for link in root_links():  # none unless something made them by hand
        # Deleting one end of a veth deletes the other: ask for each, count what went.
        if not ours.fullmatch(link):
            continue
        if run_command(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(link)
    path = state_path(prefix, state_dir)
    if path.exists():
        path.unlink()
        removed.append(str(path))
    return removed


def _stop(pids: list[int]) -> list[int]:
    """SIGTERM each process, SIGKILL those alive after a grace period; the pids stopped."""
    stopped = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _STOP_WAIT_S
    while stopped and time.monotonic() < deadline and any(_alive(p) for p in stopped):
        time.sleep(0.05)
    killed = [pid for pid in stopped if _alive(pid)]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _STOP_WAIT_S  # SIGKILL is not instant either
    while killed and time.monotonic() < deadline and any(_alive(p) for p in killed):
        time.sleep(0.05)
    return stopped


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has exited: its parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
