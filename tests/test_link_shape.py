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
import subprocess
import time
from collections.abc import Iterator
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
from adaptipe.netbed import Bed, LinkShape
from adaptipe.netbed.system import namespaces

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
    path.write_text(
        "\n".join(f"{k} = {json.dumps(v)}" for k, v in data.items() if isinstance(v, str))
        + "\n"
        + "".join(
            f"[[{section}]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items())
            for section, tables in data.items()
            if isinstance(tables, list)
            for t in tables
        )
    )
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
