"""The simulator's link model against real, shaped links between namespace hosts.

A test bed of three namespace hosts (`adaptipe.netbed`; needs root, ``ip``, ``tc``):
host 0 runs ``adaptipe manage``, hosts 1 and 2 one stage each through torchrun, over
links shaped with ``tc`` to each rate in ``--rates``. Per rate: ``adaptipe link``
measures latency and bandwidth between the two stage hosts, the job trains (an MLP wide
enough that its activations make communication a large share of an iteration at the
lowest rate; 1F1B over 2 stages, one thread each) with a few iterations traced, and the
simulator predicts the iteration time from the run's traced compute times (the
profile's per-layer times scaled to the traced ones, as ``bench_fidelity.py``'s
``replay``), so what is judged is the link model, with the measured latency and
bandwidth. ``error`` is (predicted - measured) / measured; ``error_compute_only`` is
the same prediction with free links, and ``comm_share`` = 1 - compute-only prediction /
measured (what the link costs). Rates run in ``--rounds`` paired rounds; figures are
medians over rounds. Target: |error| <= 15% at every rate.

``veth_overhead``: the link probe's 1 MiB round trip between the two stage hosts (over
veth and the bridge) against the same probe between two processes of one host over its
loopback shaped to the same rate (tbf on ``lo``), at the lowest rate, in the same
round: veth / loopback - 1. (A training run over a shaped ``lo`` is no reference: both
directions share its one queue, where each veth link has its own.)

Prints one JSON object.

    python bench/bench_links.py [--rates 20,50,200] [--rounds 3] [--iterations 24]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from adaptipe import netbed
from adaptipe.models import get_model
from adaptipe.netbed import Bed, Host, LinkShape
from adaptipe.plan.partition import Partition
from adaptipe.profile import profile_model
from adaptipe.profile.link import probe_link
from adaptipe.runtime.bedrun import run_on_bed
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.launch import prepare
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.trace import compare

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fidelity import _per_microbatch, _replayed

MODEL = {
    "name": "mlp",
    "config": {
        "in_features": 1024,
        "hidden": 1024,
        "depth": 4,
        "out_features": 16,
        "num_samples": 4096,
    },
}
BATCH, MICROBATCHES = 128, 4  # 32 samples x 1024 floats = 128 KiB per transfer
PORT = 29519


def _config(run_dir: Path, iterations: int, warmup: int) -> RunConfig:
    spec = get_model(MODEL["name"], **MODEL["config"])  # type: ignore[arg-type]
    partition = Partition.even(model=spec.name, num_layers=spec.num_layers, num_stages=2)
    return RunConfig.from_dict(
        {
            "model": MODEL,
            "data": {"batch_size": BATCH, "microbatches": MICROBATCHES},
            "optimizer": {"name": "sgd", "lr": 1e-3},
            "pipeline": {"stages": 2, "schedule": "1f1b", "partition": list(partition.bounds)},
            "train": {
                "iterations": warmup + iterations,
                "threads_per_stage": 1,
                "trace_start": warmup,
                "trace_iterations": 5,
                "checkpoint_every": 0,
                "run_dir": str(run_dir),
            },
        },
        source="bench_links",
    )


def _train(
    manager_host: Host, workers: list[Host], run_dir: Path, iterations: int, warmup: int
) -> RunDir:
    """Train the job with one torchrun per host of ``workers`` (one stage each, or both
    stages on a lone host), managed from ``manager_host``; the run directory when done."""
    run, _ = prepare(_config(run_dir, iterations, warmup))
    run_on_bed(run, manager_host, workers, port=PORT)
    return run


def _shape_lo(host: Host, rate_mbit: float | None) -> None:
    """Shape (or unshape) the loopback of ``host``'s namespace: tbf at the rate."""
    base = ["ip", "netns", "exec", host.namespace, "tc", "qdisc"]
    subprocess.run([*base, "del", "dev", "lo", "root"], capture_output=True, timeout=10)
    if rate_mbit is not None:
        subprocess.run(
            [*base, "add", "dev", "lo", "root", "tbf", "rate", f"{rate_mbit}mbit",
             "burst", "256kb", "latency", "200ms", "mtu", "70000"],
            check=True, capture_output=True, timeout=10,
        )  # fmt: skip


def _measure(
    bed: Bed, tmp: Path, tag: str, *, iterations: int, warmup: int, profile: Any
) -> dict[str, Any]:
    """The job over the links of hosts 1 and 2, managed from host 0, against the
    simulator fed its traced compute times and the measured link."""
    manager, head, other = bed.hosts
    link = probe_link(repeats=5, hosts=(head, other))
    run = _train(manager, [head, other], tmp / tag, iterations, warmup)
    measured = statistics.median(r["iteration_s"] for r in run.read_metrics()[warmup:])
    partition = run.read_partition()
    unlinked = compare(run, profile)
    per_mb = _per_microbatch(profile, partition, unlinked.real, False)
    replayed = _replayed(profile, partition, per_mb, False)
    linked = compare(run, replayed, latency_s=link.latency_s, bandwidth_Bps=link.bandwidth_Bps)
    compute_only = compare(run, replayed)
    return {
        "measured_s": measured,
        "predicted_s": linked.predicted_s,
        "error": (linked.predicted_s - measured) / measured,
        "error_compute_only": (compute_only.predicted_s - measured) / measured,
        "comm_share": 1 - compute_only.predicted_s / measured,
        "link_mbit": link.bandwidth_Bps * 8 / 1e6,
        "link_latency_s": link.latency_s,
        "link_rtt_s": dict(zip((str(n) for n in link.sizes), link.rtt_s, strict=True)),
    }


def _loopback(lone: Bed, rate: float) -> Any:
    """The link probe between two processes on one host over its loopback, shaped to
    ``rate`` (tbf on ``lo``); the probe's round trips go one way at a time, as over a
    pair of veth links."""
    host = lone.hosts[0]
    _shape_lo(host, rate)
    try:
        return probe_link(repeats=5, hosts=(host, host))
    finally:
        _shape_lo(host, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="20,50,200", help="shaped rates, Mbit/s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    reason = netbed.available()
    if reason is not None:
        raise SystemExit(f"bench_links needs a namespace test bed: {reason}")
    rates = [float(r) for r in args.rates.split(",")]
    spec = get_model(MODEL["name"], **MODEL["config"])  # type: ignore[arg-type]
    profile = profile_model(spec, microbatch=BATCH // MICROBATCHES, threads=1, repeats=7)
    prefix = "bl" + secrets.token_hex(2)
    with tempfile.TemporaryDirectory(prefix="adaptipe-links-") as tmp_name:
        tmp = Path(tmp_name)
        state = tmp / "netbed"
        bed = netbed.up(prefix=prefix, hosts=3, state_dir=state)
        lone = netbed.up(prefix=prefix + "l", hosts=1, cpus_per_host=2, state_dir=state)
        rows: dict[float, list[dict[str, Any]]] = {r: [] for r in rates}
        veth: list[float] = []
        loop: list[float] = []
        low = min(rates)
        try:
            for rnd in range(args.rounds):
                for rate in rates:
                    for h in (1, 2):
                        bed = netbed.shape(bed, h, LinkShape(rate_mbit=rate), state_dir=state)
                    row = _measure(
                        bed, tmp, f"r{rnd}-{rate:g}",
                        iterations=args.iterations, warmup=args.warmup, profile=profile,
                    )  # fmt: skip
                    rows[rate].append(row)
                    print(json.dumps({"round": rnd, "rate_mbit": rate, **row}), file=sys.stderr)
                # the link probe at the lowest rate over one host's loopback, same round
                lo = _loopback(lone, low)
                loop.append(lo.rtt_s[-1])
                veth.append(rows[low][-1]["link_rtt_s"][str(lo.sizes[-1])])
                print(json.dumps({"round": rnd, "loopback_rtt_s": loop[-1]}), file=sys.stderr)
        finally:
            netbed.down(prefix=prefix, state_dir=state)
            netbed.down(prefix=prefix + "l", state_dir=state)
    out: dict[str, Any] = {"model": MODEL, "batch": BATCH, "microbatches": MICROBATCHES}
    out["rates"] = []
    for rate in rates:
        rs = rows[rate]
        out["rates"].append(
            {
                "rate_mbit": rate,
                **{
                    k: statistics.median(r[k] for r in rs)
                    for k in rs[0]
                    if isinstance(rs[0][k], float)
                },
                "errors": [r["error"] for r in rs],
            }
        )
    out["veth_overhead"] = {
        "rate_mbit": low,
        "size_bytes": 1 << 20,
        "veth_rtt_s": statistics.median(veth),
        "loopback_rtt_s": statistics.median(loop),
        "overhead": statistics.median(v / lo - 1 for v, lo in zip(veth, loop, strict=True)),
    }
    out["target_met"] = all(abs(r["error"]) <= 0.15 for r in out["rates"])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
