"""Links that change during a run: the ``link_shape`` injector reshapes a bed host's link
with tc at a time or an iteration, a later step replaces an earlier one, an excursion
gives the link back, and a real two-host run managed by ``adaptipe manage --inject``
shows every step in the bandwidth its own sends measure and on ``adaptipe report``'s
time line.

Parsing needs nothing; the rest needs root, ``ip`` and ``tc`` and skips with the reason
``adaptipe.netbed.available()`` gives (delay needs netem, and skips with its reason).
Every bed has its own prefix and goes at the end with whatever still runs on it.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptipe import netbed
from adaptipe.cli.inject import add_parser as add_inject_parser
from adaptipe.cli.inject import run as run_inject_command
from adaptipe.errors import NetbedError, PlanError
from adaptipe.inject import ScenarioRunner
from adaptipe.inject.runner import Event
from adaptipe.inject.scenario import LinkReshape, load_scenario, parse_scenario
from adaptipe.monitor.report import make_report
from adaptipe.monitor.runlog import load_run
from adaptipe.monitor.schema import StageStats
from adaptipe.monitor.timeline import run_marks
from adaptipe.netbed import Bed, LinkShape
from adaptipe.netbed.system import namespaces
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.interference import load_interference
from adaptipe.runtime.launch import prepare, train
from adaptipe.runtime.rundir import RunDir
from tests._bed_runs import start_manager, torchrun_stage, wait_marked

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
REASON = netbed.available()
NETEM = netbed.available(netem=True)
needs_bed = pytest.mark.skipif(REASON is not None, reason=REASON or "")
PORT = 29518  # rendezvous port on the head host (its namespace has nothing else)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "netbed"


@pytest.fixture
def bed(state_dir: Path) -> Iterator[Bed]:
    """Three hosts on unshaped links, so only what a scenario sets limits a path."""
    if REASON is not None:
        pytest.skip(REASON)
    prefix = "ls" + secrets.token_hex(3)
    made = netbed.up(prefix=prefix, hosts=3, state_dir=state_dir)
    try:
        yield made
    finally:
        netbed.down(prefix=prefix, state_dir=state_dir)  # also stops what still runs on it
        assert not [n for n in namespaces() if prefix in n]


def _toml(bed: str | None, state_dir: Path | None, entries: list[dict[str, Any]]) -> str:
    lines = [f'bed = "{bed}"'] if bed else []
    lines += [f'state_dir = "{state_dir}"'] if state_dir else []
    for entry in entries:
        lines.append("[[inject]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def _tc_rates(bed: Bed, host: int) -> tuple[str, str]:
    """The rate on the host's end and the switch's end of ``host``'s link, as ``tc``
    prints it (``none`` when unshaped)."""
    out = []
    h = bed.hosts[host]
    for ns, dev in ((h.namespace, h.interface), (bed.switch, h.port)):
        argv = ["tc", "-n", ns, "qdisc", "show", "dev", dev, "root"]
        words = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.split()
        out.append(words[words.index("rate") + 1] if "rate" in words else "none")
    return out[0], out[1]


# ------------------------------------------------------------------------------ parsing
def test_link_shape_entries_read_units_or_numbers_and_the_scenarios_bed() -> None:
    scenario = parse_scenario(
        {
            "bed": "t1",
            "state_dir": "/tmp/beds",
            "inject": [
                {"kind": "link_shape", "at_s": 0, "host": 1, "rate": "100mbit"},
                {"kind": "link_shape", "at_iteration": 20, "host": 1, "rate": 250},
                {
                    "kind": "link_shape",
                    "at_s": 5,
                    "duration_s": 2,
                    "host": 0,
                    "bed": "t2",
                    "state_dir": "/run/b",
                    "rate": "1gbit",
                    "delay": "500us",
                    "jitter": 0.1,
                    "loss": "0.5%",
                },
                {"kind": "link_shape", "at_s": 9, "host": 1, "rate": "inf", "loss": 1},
            ],
        },
        source="s.toml",
    )
    first, second, third, fourth = scenario.injections
    assert first.spec == LinkReshape(host=1, bed="t1", state_dir="/tmp/beds", rate="100mbit")
    assert first.spec.shape == LinkShape(rate_mbit=100)
    assert (second.at_iteration, second.spec.shape) == (20, LinkShape(rate_mbit=250))
    assert (third.spec.bed, third.spec.state_dir, third.duration_s) == ("t2", "/run/b", 2.0)
    assert third.spec.shape == LinkShape(rate_mbit=1000, delay_ms=0.5, jitter_ms=0.1, loss_pct=0.5)
    assert fourth.spec.shape == LinkShape(loss_pct=1)  # "inf": no rate limit
    assert first.stage is None and first.kind == "link_shape"
    assert "until replaced or stop: link_shape host=1 bed=t1" in first.describe()


SHAPE_FIELDS = "host, bed, state_dir, rate, delay, jitter, loss"
BAD_LINK_SHAPES: list[tuple[dict[str, Any], str]] = [
    (
        {"inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "rate": "20mbit"}]},
        "inject[0] (link_shape) needs a bed: link_shape reshapes a link of a namespace-host bed "
        '(`adaptipe hosts up --prefix PREFIX`) with tc; give bed = "PREFIX"',
    ),
    (
        {"bed": "T-1", "inject": []},
        "bed must be a bed's prefix: 1 to 8 of a-z, 0-9 (got 'T-1')",
    ),
    (
        {"inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "bed": "toolongname"}]},
        "inject[0].bed must be a bed's prefix: 1 to 8 of a-z, 0-9 (got 'toolongname')",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "rate": "20mbit"}]},
        "inject[0].host is missing (a link_shape needs it)",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": -1, "rate": 5}]},
        "inject[0].host must be >= 0 (got -1)",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": 1}]},
        'inject[0] sets no shape: give rate, delay, jitter or loss (rate = "inf": no limit)',
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "rate": "100"}]},
        'inject[0].rate \'100\' has no unit (examples: "20mbit", "1gbit", "2.5MB/s", '
        '"inf" (no limit), or 20 for Mbit/s)',
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "rate": "fast"}]},
        "inject[0].rate 'fast' is not a rate (examples:",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "rate": 0}]},
        "inject[0].rate (in Mbit/s) must be a number > 0 and <= 100000 (got 0.0)",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "jitter": "1ms"}]},
        "inject[0].jitter needs a delay (netem jitters a delay)",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "delay": "5 sec"}]},
        "inject[0].delay '5 sec' is not a time (examples: 20ms, 500us, 0.1s)",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "loss": 150}]},
        "inject[0].loss (in %) must be a number >= 0 and <= 100 (got 150.0)",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "loss": True}]},
        "inject[0].loss must be text with a unit or a number (got True)",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "host": 1, "rat": 3}]},
        "inject[0].rat is not a field of link_shape (allowed: kind, at_s, duration_s, "
        f"at_iteration, iterations, {SHAPE_FIELDS})",
    ),
    (
        {"bed": "t1", "inject": [{"kind": "link_shape", "at_s": 0, "iterations": 3, "host": 1}]},
        "inject[0] mixes seconds (at_s) and iterations (iterations)",
    ),
    (
        {"poisson": [{"rate_per_min": 1, "mean_duration_s": 5, "kinds": ["link_shape"]}]},
        "poisson[0].kinds must list distinct kinds from cpu_hog, gpu_hog, memory, "
        "link_throttle, slowdown (got ['link_shape'])",
    ),
]


@pytest.mark.parametrize(
    ("data", "message"), BAD_LINK_SHAPES, ids=[m.split(" ")[0] for _, m in BAD_LINK_SHAPES]
)
def test_bad_link_shape_entries_name_the_file_the_entry_and_what_is_allowed(
    tmp_path: Path, data: dict[str, Any], message: str
) -> None:
    path = tmp_path / "s.toml"
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if isinstance(v, str)]
    for section, tables in ((k, v) for k, v in data.items() if isinstance(v, list)):
        for table in tables:  # JSON strings, numbers, booleans and lists are TOML too
            lines += [f"[[{section}]]", *(f"{k} = {json.dumps(v)}" for k, v in table.items())]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PlanError) as err:
        load_scenario(path, num_stages=2, num_cores=2)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


def test_the_example_ladder_is_autopipes_steps_scaled_down() -> None:
    scenario = load_scenario(EXAMPLES / "bandwidth-steps.toml", num_stages=2)
    rates = [i.spec.shape.rate_mbit for i in scenario.injections]
    assert rates == [25, 62.5, 100, 250]
    assert [r / 25 for r in rates] == [10 / 10, 25 / 10, 40 / 10, 100 / 10]  # AutoPipe's Gbit/s
    assert [i.at_iteration for i in scenario.injections] == [None, 20, 40, 60]
    assert all(isinstance(i.spec, LinkReshape) and i.spec.host == 2 for i in scenario.injections)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ({"kind": "kill", "at_s": 1, "stage": 0}, "kills a stage worker's process"),
        ({"kind": "slowdown", "at_iteration": 1, "stage": 1}, "acts through control files"),
        (
            {"kind": "link_throttle", "at_s": 0, "stage": 0, "bandwidth": "1MB/s"},
            "to slow a link between hosts, use link_shape on the bed",
        ),
    ],
)
def test_manage_refuses_injectors_that_need_the_workers_it_did_not_start(
    tmp_path: Path, entry: dict[str, Any], why: str
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(_toml(None, None, [{"kind": "cpu_hog", "at_s": 0, "cores": [0]}, entry]))
    load_interference(path, num_stages=2, num_cores=2, seed=0)  # adaptipe train runs it
    with pytest.raises(PlanError) as err:
        load_interference(path, num_stages=2, num_cores=2, seed=0, remote=True)
    kind = entry["kind"]
    assert str(err.value).startswith(
        f"{path}: inject[1] is a {kind}, which `adaptipe manage` cannot run: "
    )
    assert why in str(err.value) and "run it with `adaptipe train --inject`" in str(err.value)


def test_a_bed_that_is_not_up_is_refused_before_anything_runs(state_dir: Path) -> None:
    entry = {"kind": "link_shape", "at_s": 0, "host": 1, "rate": 5}
    data = {"bed": "nobed9", "state_dir": str(state_dir), "inject": [entry]}
    scenario = parse_scenario(data, source="s.toml")
    with pytest.raises(NetbedError) as err:
        ScenarioRunner(scenario)
    assert str(err.value).startswith("s.toml: inject[0] (link_shape on bed nobed9 host 1)")
    assert (REASON or f"no bed with prefix nobed9 ({state_dir}/nobed9.json") in str(err.value)


# ------------------------------------------------------------------------------ on a bed
def _recorder(bed: Bed, host: int) -> tuple[list[tuple[str, str, Any, tuple[str, str]]], Any]:
    """Events as (kind, origin, restored, tc rates right after the event)."""
    seen: list[tuple[str, str, Any, tuple[str, str]]] = []

    def on_event(e: Event) -> None:
        seen.append((e.kind, e.detail["origin"], e.detail.get("restored"), _tc_rates(bed, host)))

    return seen, on_event


@needs_bed
def test_link_shapes_at_times_change_both_ends_of_the_link_and_give_it_back(
    bed: Bed, state_dir: Path, tmp_path: Path
) -> None:
    bed = netbed.shape(bed, 1, LinkShape(rate_mbit=50), state_dir=state_dir)
    path = tmp_path / "s.toml"
    step = {"kind": "link_shape", "host": 1}
    path.write_text(
        _toml(
            bed.prefix,
            state_dir,
            [
                {**step, "at_s": 0, "rate": "20mbit"},
                {**step, "at_s": 0.3, "rate": 100},  # replaces the 20 mbit step
                {**step, "at_s": 0.6, "duration_s": 0.3, "rate": "5mbit"},  # an excursion
            ],
        )
    )
    seen, on_event = _recorder(bed, 1)
    runner = ScenarioRunner(load_scenario(path), on_event=on_event)
    with runner:
        deadline = time.monotonic() + 20
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert netbed.load(bed.prefix, state_dir=state_dir).hosts[1].shape.rate_mbit == 100
    assert runner.failures == []
    assert seen == [
        ("injection-start", "inject[0]", None, ("20Mbit", "20Mbit")),
        ("injection-start", "inject[1]", None, ("100Mbit", "100Mbit")),
        ("injection-end", "inject[0]", None, ("100Mbit", "100Mbit")),  # replaced: untouched
        ("injection-start", "inject[2]", None, ("5Mbit", "5Mbit")),
        ("injection-end", "inject[2]", "100 mbit", ("100Mbit", "100Mbit")),
        ("injection-end", "inject[1]", "50 mbit", ("50Mbit", "50Mbit")),  # stop: as found
    ]
    ends = [e.detail["reason"] for e in runner.events if e.kind == "injection-end"]
    assert ends == ["replaced", "done", "stopped"]
    assert _tc_rates(bed, 0) == ("none", "none")  # the other links are untouched
    assert netbed.load(bed.prefix, state_dir=state_dir).hosts[1].shape == LinkShape(rate_mbit=50)


@needs_bed
def test_iteration_keyed_link_shapes_follow_the_training_loop(
    bed: Bed, state_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        _toml(
            bed.prefix,
            state_dir,
            [
                {"kind": "link_shape", "at_iteration": 2, "host": 2, "rate": "30mbit"},
                {"kind": "link_shape", "at_iteration": 3, "iterations": 2, "host": 2, "rate": 8},
            ],
        )
    )
    rates = []
    with ScenarioRunner(load_scenario(path)) as runner:
        for iteration in range(7):
            runner.on_iteration(iteration)
            rates.append(_tc_rates(bed, 2)[1])
    assert rates == ["none", "none", "30Mbit", "8Mbit", "8Mbit", "30Mbit", "30Mbit"]
    assert _tc_rates(bed, 2) == ("none", "none")


@needs_bed
def test_a_link_that_cannot_be_given_back_is_reported_not_raised(
    bed: Bed, state_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        _toml(bed.prefix, state_dir, [{"kind": "link_shape", "at_s": 0, "host": 1, "rate": 10}])
    )
    runner = ScenarioRunner(load_scenario(path))
    runner.start()
    netbed.down(prefix=bed.prefix, state_dir=state_dir)  # the bed goes first
    runner.stop()
    (failure,) = runner.failures
    assert failure.startswith("inject[0] (link_shape) did not end: ")
    assert [e.kind for e in runner.events] == [
        "injection-start",
        "injection-failed",
        "injection-end",
    ]


@needs_bed
def test_adaptipe_inject_runs_link_shapes_on_a_bed(
    bed: Bed, state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.toml"
    entries = [
        {"kind": "link_shape", "at_s": 0, "duration_s": 0.2, "host": 1, "rate": "20mbit"},
        {"kind": "link_shape", "at_iteration": 3, "host": 1, "rate": "20mbit"},
    ]
    path.write_text(_toml(bed.prefix, state_dir, entries))
    parser = argparse.ArgumentParser()
    add_inject_parser(parser.add_subparsers())
    assert run_inject_command(parser.parse_args(["inject", str(path)])) == 0
    out = capsys.readouterr().out
    assert "start  link_shape (inject[0]) shape=20 mbit" in out
    assert "end    link_shape (inject[0]) reason=done restored=unshaped" in out
    assert "skipped here" in out
    assert _tc_rates(bed, 1) == ("none", "none")


@needs_bed
def test_adaptipe_train_inject_applies_link_shapes_and_logs_them_as_telemetry(
    make_config: Callable[..., RunConfig], bed: Bed, state_dir: Path, tmp_path: Path
) -> None:
    """Workers `adaptipe train` starts talk over loopback, not the bed: the link changes
    and the events are logged, but the run's own traffic does not cross it."""
    path = tmp_path / "s.toml"
    entry = {"kind": "link_shape", "at_iteration": 2, "iterations": 2, "host": 1, "rate": 30}
    path.write_text(_toml(bed.prefix, state_dir, [entry]))
    seen: list[tuple[str, str]] = []
    summary = train(
        make_config(train={"iterations": 6, "telemetry": True}),
        inject=path,
        on_iteration=lambda rec, total: seen.append(_tc_rates(bed, 1)),
    )
    assert ("30Mbit", "30Mbit") in seen and _tc_rates(bed, 1) == ("none", "none")
    records = [
        json.loads(line) for line in RunDir(summary.run_dir).telemetry.read_text().splitlines()
    ]
    events = [r for r in records if r["type"] == "event"]
    assert [(e["kind"], e["detail"].get("shape"), e["detail"].get("restored")) for e in events] == [
        ("injection-start", "30 mbit", None),
        ("injection-end", None, "unshaped"),
    ]
    assert events[0]["detail"]["host"] == 1 and events[0]["detail"]["bed"] == bed.prefix


@needs_bed
@pytest.mark.skipif(NETEM is None, reason="this kernel has netem: delays are applied")
def test_a_delay_is_refused_with_the_reason_where_the_kernel_has_no_netem() -> None:
    entry = {"kind": "link_shape", "at_s": 0, "host": 1, "delay": "5ms"}
    scenario = parse_scenario({"bed": "nonetem", "inject": [entry]}, source="d.toml")
    with pytest.raises(NetbedError) as err:
        ScenarioRunner(scenario)  # before the bed is looked for
    assert str(err.value) == (
        f"d.toml: inject[0] (link_shape on bed nonetem host 1) cannot shape here: {NETEM}"
    )


@needs_bed
@pytest.mark.skipif(NETEM is not None, reason=NETEM or "")
def test_a_delay_shows_in_the_links_qdiscs(bed: Bed, state_dir: Path) -> None:
    entry = {"kind": "link_shape", "at_s": 0, "host": 1, "rate": "50mbit", "delay": "5ms"}
    data = {"bed": bed.prefix, "state_dir": str(state_dir), "inject": [entry]}
    with ScenarioRunner(parse_scenario(data, source="d.toml")):
        h = bed.hosts[1]
        argv = ["tc", "-n", h.namespace, "qdisc", "show", "dev", h.interface]
        shown = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
        assert "netem" in shown and "delay 5ms" in shown


# ------------------------------------------------------------------------- the must-show
STEPS = (("20mbit", None), ("100mbit", 8), ("40mbit", 16))  # rate, at_iteration (None: at 0 s)
ITERATIONS = 24


def _config(make_config: Callable[..., RunConfig], run_dir: Path) -> RunConfig:
    """A narrow MLP on wide micro-batches: each one sends 0.5 MiB across the stage
    boundary (2048 x 64 float32) and computes for about a millisecond, so the link is what
    an iteration waits for (2 MiB each way per iteration: 0.9 s at 20 Mbit/s)."""
    return make_config(
        model={
            "name": "mlp",
            "config": {
                "in_features": 64,
                "hidden": 64,
                "depth": 4,
                "out_features": 4,
                "num_samples": 8192,
            },
        },
        data={"batch_size": 8192, "microbatches": 4, "seed": 3},
        train={
            "iterations": ITERATIONS,
            "telemetry": True,
            "link_telemetry": True,
            "telemetry_interval_s": 0.1,
            "threads_per_stage": 1,
            "timeout_s": 120,
            "run_dir": str(run_dir),
        },
    )


def _managed_run(bed: Bed, run: RunDir, scenario: Path) -> dict[str, Any]:
    """``adaptipe manage --inject`` on host 0, one torchrun stage on each of hosts 1, 2;
    the manager's summary."""
    manager_host, head, other = bed.hosts
    manager = start_manager(manager_host, run, "--inject", str(scenario))
    procs: list[subprocess.Popen[bytes]] = [manager]
    try:
        wait_marked(run, manager)
        procs += [
            torchrun_stage(head, 0, head, run.root, port=PORT),
            torchrun_stage(other, 1, head, run.root, port=PORT),
        ]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        out, err = manager.communicate(timeout=10)
        codes = [p.poll() for p in procs]
        logs = "\n".join((run.root / f"torchrun-{n}.log").read_text()[-1500:] for n in (0, 1))
        assert codes == [0, 0, 0], f"{codes}\n{err.decode()[-2000:]}\n{logs}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # by pid; the bed's teardown ends the rest
                proc.wait(timeout=10)
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


def _per_step(records: list[dict[str, Any]], src: int, starts: list[float]) -> list[list[float]]:
    """Per step, the bandwidth (bytes/s) stage ``src``'s sends measured in each iteration
    run wholly under it: begun after the step was in place (the iteration before ended
    later) and ended before the next step, leaving out each step's first iteration."""
    stats = [r for r in records if r["type"] == "stage_stats" and r["stage"] == src]
    links = [r for r in records if r["type"] == "link_sample" and r["src"] == src]
    assert len(stats) == len(links) == ITERATIONS  # one of each per iteration, in order
    bounds = [*starts, float("inf")]
    out: list[list[float]] = [[] for _ in starts]
    for it in range(2, ITERATIONS):
        for k in range(len(starts)):
            if bounds[k] <= stats[it - 2]["time_s"] and stats[it]["time_s"] <= bounds[k + 1]:
                out[k].append(links[it]["nbytes"] / links[it]["seconds"])
    return out


@needs_bed
@pytest.mark.slow  # 24 s; a real run's link shapes by default: ...train_inject_applies...
def test_bandwidth_steps_mid_run_show_in_link_samples_and_on_the_report(
    make_config: Callable[..., RunConfig], tmp_path: Path, bed: Bed, state_dir: Path
) -> None:
    run, _ = prepare(_config(make_config, tmp_path / "run"))
    # A link sample times a send from post to completion, and a gloo send completes once
    # its bytes are in the socket's buffer (Linux grows it to 4 MiB): the bed caps the
    # hosts' send buffers, so a 0.5 MiB send completes about when it has crossed.
    for host in bed.hosts[1:]:
        wmem = host.run(["sysctl", "-n", "net.ipv4.tcp_wmem"], timeout=10, check=True,
                        capture_output=True, text=True).stdout  # fmt: skip
        assert wmem.split()[-1] == str(netbed.SEND_BUFFER)
    scenario = tmp_path / "steps.toml"
    entries = [
        {"kind": "link_shape", **({"at_s": 0} if at is None else {"at_iteration": at}), "rate": r}
        for r, at in STEPS
    ]
    scenario.write_text(_toml(bed.prefix, state_dir, [{**e, "host": 2} for e in entries]))
    summary = _managed_run(bed, run, scenario)
    assert summary["iterations"] == ITERATIONS
    assert _tc_rates(bed, 2) == ("none", "none")  # the link is given back at the end

    records = [json.loads(line) for line in run.telemetry.read_text().splitlines()]
    events = [r for r in records if r["type"] == "event" and r["kind"].startswith("injection")]
    shapes = [(e["kind"], e["detail"].get("shape"), e["detail"].get("reason")) for e in events]
    assert shapes == [
        ("injection-start", "20 mbit", None),
        ("injection-start", "100 mbit", None),
        ("injection-end", None, "replaced"),
        ("injection-start", "40 mbit", None),
        ("injection-end", None, "replaced"),
        ("injection-end", None, "stopped"),
    ]
    starts = [e["time_s"] for e in events if e["kind"] == "injection-start"]
    medians = []
    for src in (0, 1):  # activations 0 -> 1 and gradients 1 -> 0 both cross host 2's link
        per_step = _per_step(records, src, starts)
        assert all(len(s) >= 3 for s in per_step), per_step
        medians.append([statistics.median(s) / 1e6 for s in per_step])
    print(f"median MB/s per step {[r for r, _ in STEPS]}: 0 -> 1 {medians[0]}, 1 -> 0 {medians[1]}")
    for slow, fast, middle in medians:
        assert slow <= 1.2 * 20e6 / 8 / 1e6  # no faster than 20 Mbit/s can carry
        assert fast >= 3 * slow  # 20 -> 100 Mbit/s
        assert 1.4 * slow <= middle <= 0.7 * fast  # 100 -> 40 Mbit/s

    # The report's time line: one span per step, each at the iteration it came in.
    page = make_report(run.root).read_text()
    for rate in ("20 mbit", "100 mbit", "40 mbit"):
        assert f"link_shape host 2: {rate}" in page
    assert (run.root / "report" / "links.png").exists()
    log = load_run(run.root)
    stats = [r for r in log.records if isinstance(r, StageStats)]
    t0 = min(r.time_s for r in log.records)
    marks = run_marks(log, stats, t0, max(r.time_s for r in log.records) - t0)
    spans = [(m.label, m.start_it, m.end_it) for m in marks if m.kind == "injection"]
    assert [label for label, _, _ in spans] == [
        f"link_shape host 2: {r[:-4]} mbit" for r, _ in STEPS
    ]
    for (_, start, end), (_, at) in zip(spans, STEPS, strict=True):
        assert start is not None and end is not None and start < end
        if at is not None:  # the manager starts it once it has seen iteration at - 1 end
            assert at - 1 <= start <= at + 1.5, spans
