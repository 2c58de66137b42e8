"""The namespace test bed: hosts reach each other and nothing else, links are shaped
(rate, delay) and can be reshaped live, a TOS 0x08 flow (TCP or ZeroMQ) yields to a
default flow, and nothing is left behind.

Tests that build a bed need root, ``ip`` and ``tc``; they skip with the reason
`netbed.available` gives. Each uses its own prefix and removes its bed in teardown;
processes started on a bed are stopped by pid.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptipe import netbed
from adaptipe.cli import main
from adaptipe.errors import NetbedError, PlanError
from adaptipe.netbed import SUBNET, Bed, Host, LinkShape
from adaptipe.netbed.bed import plan_bed
from adaptipe.netbed.shape import tc_commands
from adaptipe.netbed.system import namespaces, root_links

FLOWS = Path(__file__).with_name("_netbed_flows.py")
REASON = netbed.available()
needs_bed = pytest.mark.skipif(REASON is not None, reason=f"no namespace test bed: {REASON}")
_USED: list[str] = []  # every prefix this module built a bed with


def _prefix(tag: str) -> str:
    prefix = f"{tag}{secrets.token_hex(3)}"
    _USED.append(prefix)
    return prefix


def _leftovers(prefix: str) -> list[str]:
    """Namespaces, root interfaces and root qdiscs whose name carries ``prefix``."""
    mark = f"ap-{prefix}-"
    found = [f"namespace {n}" for n in namespaces() if n.startswith(mark)]
    found += [f"interface {n}" for n in root_links() if n.startswith(mark)]
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, timeout=10)
    found += [f"qdisc {line}" for line in qdiscs.stdout.splitlines() if mark in line]
    return found


class Bench:
    """Beds and the processes started on them, all removed at the end of a test."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.prefixes: list[str] = []
        self.procs: list[subprocess.Popen[str]] = []

    def up(self, tag: str, *, hosts: int = 2, shape: LinkShape | None = None) -> Bed:
        prefix = _prefix(tag)
        self.prefixes.append(prefix)
        return netbed.up(
            prefix=prefix, hosts=hosts, shape=shape or LinkShape(), state_dir=self.state_dir
        )

    def start(self, host: Host, *args: str, timeout: float = 15.0) -> subprocess.Popen[str]:
        argv = [sys.executable, str(FLOWS), "--timeout", str(timeout), *args]
        proc = host.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def serve(self, host: Host, *args: str) -> subprocess.Popen[str]:
        """Start a listening mode and wait for its ``ready``."""
        proc = self.start(host, *args)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"{args[0]} did not start: {line!r} {proc.stderr}"
        return proc

    def result(self, proc: subprocess.Popen[str], timeout: float = 20.0) -> dict[str, Any]:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"exit {proc.returncode}: {err}"
        data: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return data

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)
        for prefix in self.prefixes:
            netbed.down(prefix=prefix, state_dir=self.state_dir)


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    b = Bench(tmp_path)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    yield
    if REASON is None:
        left = [item for prefix in _USED for item in _leftovers(prefix)]
        left += [n for n in namespaces() if n.startswith("ap-probe-")]
        assert not left, f"the bed tests left {left}"


def _mbit(bench: Bench, bed: Bed) -> float:
    """TCP throughput host 0 -> host 1 (payload, Mbit/s) over 3 s, after 1 s."""
    dst = bed.hosts[1]
    sink = bench.serve(dst, "sink", "--tcp", "5000", "--tags", "d", "--window", "1:4")
    to = f"{dst.address}:5000"
    bench.start(bed.hosts[0], "send", "--to", to, "--tag", "d", "--seconds", "5")
    return float(bench.result(sink)["mbit"][0]["d"])


# -- plain types, no namespaces -----------------------------------------------------------


def test_link_shape_and_bed_round_trip_through_json() -> None:
    shape = LinkShape(rate_mbit=20, delay_ms=5, jitter_ms=1, loss_pct=0.5)
    assert LinkShape.from_json(json.loads(json.dumps(shape.to_json()))) == shape
    assert LinkShape.from_json({}) == LinkShape()
    assert shape.describe() == "20 mbit, 5 ms delay +- 1 ms, 0.5% loss"
    bed = plan_bed(prefix="rt1", shapes=[shape, LinkShape()], cpus=[0, 1])
    again = Bed.from_json(json.loads(json.dumps(bed.to_json())), source="t1.json")
    assert again == bed
    assert [h.namespace for h in bed.hosts] == ["ap-rt1-h0", "ap-rt1-h1"]
    assert all(len(h.port) <= 15 and len(h.interface) <= 15 for h in bed.hosts)
    assert [h.cpus for h in bed.hosts] == [(0,), (1,)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rate_mbit": 0}, "rate_mbit must be a number > 0 and <= 100000, or null"),
        ({"delay_ms": -1}, "delay_ms must be a number >= 0 and <= 60000, or null"),
        ({"loss_pct": 101}, "loss_pct must be a number >= 0 and <= 100, or null"),
        ({"loss_pct": True}, "loss_pct must be a number"),
        ({"jitter_ms": 1}, "jitter_ms needs delay_ms"),
        ({"rate": 20}, "rate is not a link shape field (allowed: rate_mbit, delay_ms"),
    ],
)
def test_a_bad_link_shape_names_the_field_and_what_is_allowed(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(PlanError, match=rf"^bed.json: hosts\[0\]\.shape\.{message}"[:60]):
        LinkShape.from_json(fields, source="bed.json", prefix="hosts[0].shape.")
    if "rate" not in fields:
        with pytest.raises(PlanError, match=r"^LinkShape: "):
            LinkShape(**fields)


def test_a_bed_file_must_keep_the_names_and_addresses_its_prefix_gives() -> None:
    data = plan_bed(prefix="rt2", shapes=[LinkShape()] * 2, cpus=[0]).to_json()
    data["hosts"][1]["namespace"] = "other"
    with pytest.raises(PlanError, match=r"s.json: hosts\[1\]\.namespace must be 'ap-rt2-h1'"):
        Bed.from_json(data, source="s.json")
    data = plan_bed(prefix="rt2", shapes=[LinkShape()] * 2, cpus=[0]).to_json()
    data["hosts"][0]["address"] = "10.0.0.1"
    with pytest.raises(PlanError, match=r"hosts\[0\]\.address must be '192\.0\.2\.1'"):
        Bed.from_json(data, source="s.json")
    for bad in ("", "Up", "a-b", "toolong99"):
        with pytest.raises(PlanError, match="1 to 8 lowercase letters or digits"):
            plan_bed(prefix=bad, shapes=[LinkShape()], cpus=[0])
    with pytest.raises(PlanError, match="1 to 99 hosts"):
        plan_bed(prefix="rt2", shapes=[LinkShape()] * 100, cpus=[0])


def test_a_rate_change_is_made_in_place_and_delay_goes_on_netem_leaves() -> None:
    def commands(shape: LinkShape, current: str) -> list[str]:
        argvs = tc_commands(netns="n", dev="d", shape=shape, current=current)
        assert all(a[:3] == ["tc", "-n", "n"] for a in argvs)
        return [" ".join(a[3:]) for a in argvs]

    fresh = commands(LinkShape(rate_mbit=20), "noqueue")
    assert fresh[0] == (
        "qdisc add dev d root handle 1: tbf rate 20000000bit burst 2500 latency 100ms "
        "peakrate 40000000bit mtu 1600"
    )
    assert fresh[1] == "qdisc add dev d parent 1:1 handle 2: htb default 11"
    assert sum(c.startswith("class add dev d parent 2:1 ") for c in fresh) == 3
    assert sum("filter add" in c and "flowid 2:12" in c for c in fresh) == 2  # 0x08, 0x02
    assert any("match ip tos 0x10 0x18 flowid 2:10" in c for c in fresh)
    change = commands(LinkShape(rate_mbit=5), "tbf")
    assert change[0].startswith("qdisc change dev d root handle 1: tbf rate 5000000bit")
    assert all(c.startswith("qdisc replace dev d parent 2:1") for c in change[1:]), change
    delayed = commands(LinkShape(rate_mbit=5, delay_ms=20, jitter_ms=2, loss_pct=1), "tbf")
    assert [c.split(" netem")[0] for c in delayed[1:]] == [
        f"qdisc replace dev d parent 2:{band} handle {band + 10}:" for band in (10, 11, 12)
    ]
    assert all(c.endswith("netem limit 10000 delay 20000us 2000us loss 1%") for c in delayed[1:])
    assert commands(LinkShape(delay_ms=20), "tbf")[0] == "qdisc del dev d root"
    assert commands(LinkShape(delay_ms=20), "netem") == [
        "qdisc change dev d root handle 1: netem limit 10000 delay 20000us"
    ]
    assert commands(LinkShape(), "tbf") == ["qdisc del dev d root"]
    assert commands(LinkShape(), "noqueue") == []


# -- a live bed -----------------------------------------------------------------------------


@needs_bed
def test_hosts_reach_each_other_on_test_net_on_their_own_cores_and_see_no_root_interface(
    bench: Bench,
) -> None:
    root_before = set(root_links())
    bed = bench.up("re")
    assert not [n for n in root_links() if n.startswith(f"ap-{bed.prefix}-")]  # none in root
    assert all(ipaddress.ip_address(h.address) in SUBNET for h in bed.hosts)
    for src, dst in ((0, 1), (1, 0)):
        listener = bench.serve(bed.hosts[dst], "listen", "--port", "6000")
        probe = bench.start(bed.hosts[src], "rtt", "--to", f"{bed.hosts[dst].address}:6000")
        assert bench.result(probe)["rtt_ms"] < 50
        listener.kill()
    for host in bed.hosts:
        seen = host.run(["ip", "-j", "link", "show"], timeout=10, capture_output=True, text=True)
        names = {row["ifname"] for row in json.loads(seen.stdout)}
        assert names == {"lo", host.interface}
        assert not names & (root_before - {"lo"})
        cores = host.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            timeout=10,
            capture_output=True,
            text=True,
        )
        assert json.loads(cores.stdout) == list(host.cpus)
    ncpu = sorted(os.sched_getaffinity(0))
    assert [h.cpus for h in bed.hosts] == [(ncpu[i % len(ncpu)],) for i in range(2)]


@needs_bed
def test_up_removes_a_stale_bed_with_the_same_prefix_and_down_leaves_nothing(
    bench: Bench,
) -> None:
    prefix = _prefix("st")
    bench.prefixes.append(prefix)
    stale = [f"ap-{prefix}-h7", f"ap-{prefix}-sw"]  # as a killed test leaves them
    for name in stale:
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    veth = ["ip", "link", "add", "name", f"ap-{prefix}-s9", "type", "veth"]
    subprocess.run([*veth, "peer", "name", f"ap-{prefix}-h9"], check=True, timeout=10)
    bed = netbed.up(prefix=prefix, hosts=2, state_dir=bench.state_dir)
    assert sorted(n for n in namespaces() if n.startswith(f"ap-{prefix}-")) == sorted(
        [bed.switch, *(h.namespace for h in bed.hosts)]
    )
    assert not [n for n in root_links() if n.startswith(f"ap-{prefix}-")]
    assert netbed.load(prefix, state_dir=bench.state_dir) == bed
    removed = netbed.down(prefix=prefix, state_dir=bench.state_dir)
    assert set(removed) >= {bed.switch, *(h.namespace for h in bed.hosts)}
    assert _leftovers(prefix) == []
    assert not netbed.state_path(prefix, bench.state_dir).exists()
    assert netbed.down(prefix=prefix, state_dir=bench.state_dir) == []  # nothing: no error


@needs_bed
def test_down_stops_the_processes_still_on_the_bed(bench: Bench) -> None:
    bed = bench.up("pr")
    proc = bench.start(bed.hosts[1], "listen", "--port", "6000", timeout=60)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    removed = netbed.down(prefix=bed.prefix, state_dir=bench.state_dir)
    assert f"pid {proc.pid}" in removed
    proc.wait(timeout=10)
    assert _leftovers(bed.prefix) == []


@needs_bed
def test_a_shaped_link_caps_throughput_at_its_rate_and_reshapes_live(bench: Bench) -> None:
    bed = bench.up("tp", shape=LinkShape(rate_mbit=20))
    fast = _mbit(bench, bed)
    # TCP payload is ~95% of the bytes on the wire: the payload rate stays under the rate.
    assert 10 < fast <= 20 * 1.02, fast
    # Host 1's link only: the cap is on what it receives, at the switch's port.
    bed = netbed.shape(bed, 1, LinkShape(rate_mbit=5), state_dir=bench.state_dir)
    slow = _mbit(bench, bed)
    assert 2.5 < slow <= 5 * 1.02, slow
    assert netbed.load(bed.prefix, state_dir=bench.state_dir).hosts[1].shape.rate_mbit == 5
    print(f"shaped 20 mbit: {fast:.2f} Mbit/s payload; reshaped to 5 mbit: {slow:.2f}")


def _contend(bench: Bench, bed: Bed, *low: str) -> tuple[float, dict[str, float]]:
    """A flow ``l`` (``low``: its sender's options) from host 0 to host 1 alone, then
    with a default TCP flow ``d``: Mbit/s of ``l`` alone (0.5-1.5 s), and of each flow
    together (2.5-4.5 s; ``d`` starts at 1.5 s)."""
    dst = bed.hosts[1]
    windows = ["--window", "0.5:1.5", "--window", "2.5:4.5"]
    sink = bench.serve(dst, "sink", "--tcp", "5000", "--zmq", "5001", "--tags", "d,l", *windows)
    bench.start(bed.hosts[0], "send", "--tag", "l", "--seconds", "5.5", *low)
    to = f"{dst.address}:5000"
    bench.start(
        bed.hosts[0], "send", "--to", to, "--tag", "d", "--after", "1.5", "--seconds", "5.5"
    )
    alone, together = bench.result(sink)["mbit"]
    return alone["l"], together


@needs_bed
@pytest.mark.parametrize(
    ("bottleneck", "tos"), [("sender", "0x08"), ("receiver", "0x08"), ("sender", "0")]
)
def test_a_tos_0x08_tcp_flow_yields_to_a_default_flow(
    bench: Bench, bottleneck: str, tos: str
) -> None:
    """The queue is on host 0's end of its link (both links shaped), or on the switch's
    port to host 1 (only host 1's link shaped): the TOS byte picks the band on both.
    Unmarked (TOS 0), the first flow keeps a share: the mark, not the order, decides."""
    bed = bench.up("tc", shape=LinkShape(rate_mbit=20))
    if bottleneck == "receiver":
        bed = netbed.shape(bed, 0, LinkShape(), state_dir=bench.state_dir)
    alone, mbit = _contend(bench, bed, "--to", f"{bed.hosts[1].address}:5000", "--tos", tos)
    print(
        f"{bottleneck} end, TOS {tos}: alone {alone:.2f} Mbit/s; with a default flow "
        f"{mbit['l']:.2f}, the default flow {mbit['d']:.2f}"
    )
    assert alone > 10  # the flow runs, at the link's rate when alone
    assert mbit["d"] + mbit["l"] > 10, mbit
    if tos == "0":
        assert mbit["l"] > 0.15 * (mbit["d"] + mbit["l"]), mbit
    else:
        assert mbit["d"] >= 3 * mbit["l"], mbit


@needs_bed
def test_a_zmq_push_with_tos_0x08_yields_to_a_default_flow(bench: Bench) -> None:
    bed = bench.up("zq", shape=LinkShape(rate_mbit=20))
    to = f"{bed.hosts[1].address}:5001"
    alone, mbit = _contend(bench, bed, "--zmq", "--to", to, "--tos", "0x08")
    print(
        f"ZeroMQ PUSH with zmq.TOS 0x08 alone {alone:.2f} Mbit/s; with a default TCP flow "
        f"{mbit['l']:.2f}, the default flow {mbit['d']:.2f}"
    )
    assert alone > 10
    assert mbit["d"] >= 3 * mbit["l"], mbit
    assert mbit["d"] + mbit["l"] > 10, mbit


NETEM = netbed.available(netem=True)


@pytest.mark.skipif(NETEM is not None, reason=f"no delay on this machine: {NETEM}")
def test_a_delay_shows_in_the_round_trip_time(bench: Bench) -> None:
    bed = bench.up("dl")
    listener = bench.serve(bed.hosts[1], "listen", "--port", "6000")
    to = f"{bed.hosts[1].address}:6000"
    base = bench.result(bench.start(bed.hosts[0], "rtt", "--to", to))["rtt_ms"]
    bed = netbed.shape(bed, 1, LinkShape(delay_ms=20), state_dir=bench.state_dir)
    delayed = bench.result(bench.start(bed.hosts[0], "rtt", "--to", to))["rtt_ms"]
    listener.kill()
    # A connect is one round trip: in and out of host 1's link, 20 ms each way.
    print(f"round trip {base:.2f} ms unshaped, {delayed:.2f} ms with 20 ms on host 1's link")
    assert 40 <= delayed < 40 + base + 15, (base, delayed)


@pytest.mark.skipif(
    REASON is not None or NETEM is None, reason=f"netem is here, or no bed: {REASON}"
)
def test_a_delay_without_netem_is_refused_with_the_reason(bench: Bench) -> None:
    bed = bench.up("nn", shape=LinkShape(rate_mbit=20))
    with pytest.raises(NetbedError, match="host 1: 20 ms delay: this kernel has no netem"):
        netbed.shape(bed, 1, LinkShape(delay_ms=20), state_dir=bench.state_dir)
    with pytest.raises(NetbedError, match="no netem"):
        netbed.up(prefix=_prefix("nn"), hosts=1, shape=LinkShape(loss_pct=1))
    assert netbed.load(bed.prefix, state_dir=bench.state_dir) == bed  # unchanged


@needs_bed
def test_the_hosts_command_brings_up_shows_reshapes_and_takes_down_a_bed(
    bench: Bench, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = _prefix("cl")
    bench.prefixes.append(prefix)
    where = ["--prefix", prefix, "--state-dir", str(bench.state_dir)]
    assert main(["hosts", "up", "--hosts", "2", "--rate", "20mbit", *where]) == 0
    assert f"ip netns exec ap-{prefix}-h0 taskset -c" in capsys.readouterr().out
    assert main(["hosts", "shape", "--host", "1", "--rate", "5mbit", *where]) == 0
    capsys.readouterr()
    assert main(["hosts", "show", *where]) == 0
    shown = Bed.from_json(json.loads(capsys.readouterr().out))
    assert [h.shape.rate_mbit for h in shown.hosts] == [20, 5]
    port = shown.hosts[1].port
    live = ["tc", "-n", shown.switch, "qdisc", "show", "dev", port, "root"]
    assert "tbf 1: root" in subprocess.run(live, capture_output=True, text=True, timeout=10).stdout
    assert "rate 5Mbit" in subprocess.run(live, capture_output=True, text=True, timeout=10).stdout
    assert main(["hosts", "shape", "--host", "2", "--rate", "5mbit", *where]) == 2
    assert "hosts 0 to 1 (got host 2)" in capsys.readouterr().err
    assert main(["hosts", "shape", "--delay", "20", *where]) == 2
    assert "'20' is not a time (examples: 20ms" in capsys.readouterr().err
    assert main(["hosts", "down", *where]) == 0
    assert f"ap-{prefix}-sw" in capsys.readouterr().out
    assert _leftovers(prefix) == []
    assert main(["hosts", "show", *where]) == 2
    assert f"no bed with prefix {prefix}" in capsys.readouterr().err


@needs_bed
def test_no_namespace_veth_or_qdisc_is_left_after_the_tests() -> None:
    """Every bed this module made so far is gone (the module's last test; a fixture
    checks the same at the module's end, whatever the order)."""
    left = [item for prefix in _USED for item in _leftovers(prefix)]
    left += [n for n in namespaces() if n.startswith("ap-probe-")]
    assert not left
