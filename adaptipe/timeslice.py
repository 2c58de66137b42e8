"""``adaptipe cluster run``: Gavel's round-based mechanism over real adaptipe runs on
this machine, with device types made of CPU quotas (cgroup ``cpu`` controller).

A spec (TOML) names the device types (``cpus``: the share of cores a worker of that
type may use, e.g. 1.0 against 0.4), the jobs (each an adaptipe run config) and the
policy. Each job's throughput on each type is measured first, unless given: a short
run of ``measure_iterations`` iterations inside that type's quota, iterations per
second from its metrics. Then, round by round (``round_s``), the policy's allocation
over the jobs still running is realised by `adaptipe.cluster.mechanism.place_round`:
a placed job runs ``adaptipe train`` (``--resume`` once it has a checkpoint) inside a
cgroup with its type's quota; at the end of the round it is stopped with SIGTERM and
resumes later from its latest checkpoint (``checkpoint_every`` of the spec, so little
is lost), which adaptipe's resume makes exact. The log (``cluster-run.json``) holds
every round's placements, each job's rounds per type against what the allocation asked
for, and, with ``check_alone``, whether each job's final parameters equal the same
config trained alone, bitwise.

Needs write access to the cgroup ``cpu`` controller (root); refused with the reason
otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from adaptipe.cluster.mechanism import RoundRobinState, place_round
from adaptipe.cluster.policies import POLICIES, Policy, allocate
from adaptipe.cluster.spec import Cluster, ClusterJob
from adaptipe.errors import PlanError

__all__ = ["SliceJob", "SliceSpec", "cgroup_root", "load_spec", "run_sliced"]

_CPU_V1 = Path("/sys/fs/cgroup/cpu")
_CPU_V2 = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # a short period: throttling shows within a short measurement


@dataclass(frozen=True, slots=True, kw_only=True)
class SliceJob:
    name: str
    config: Path
    throughputs: Mapping[str, float] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SliceSpec:
    devices: tuple[tuple[str, int, float], ...]  # (type, count, cpus)
    jobs: tuple[SliceJob, ...]
    policy: Policy = "max_min_fairness"
    aware: bool = True
    round_s: float = 20.0
    checkpoint_every: int = 2
    measure_iterations: int = 12
    check_alone: bool = True

    def cluster(self) -> Cluster:
        return Cluster(
            types=tuple(d[0] for d in self.devices), workers=tuple(d[1] for d in self.devices)
        )


def _get(
    where: str, raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any
) -> Any:
    value = raw.get(key, default)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise PlanError(f"{where}: {key} must be a {names} (got {value!r})")
    return value


def load_spec(path: str | Path) -> SliceSpec:
    """Read a spec; errors name the file, the field and what is allowed."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PlanError(f"{p}: cannot read the spec ({exc})") from None
    top = ("policy", "aware", "round_s", "checkpoint_every", "measure_iterations",
           "check_alone", "device", "job")  # fmt: skip
    extra = sorted(set(raw) - set(top))
    if extra:
        raise PlanError(f"{p}: unknown field {extra[0]!r} (allowed: {', '.join(top)})")
    policy = _get(str(p), raw, "policy", str, "max_min_fairness")
    if policy not in POLICIES:
        raise PlanError(f"{p}: policy {policy!r} (allowed: {', '.join(POLICIES)})")
    scalars = {
        "aware": _get(str(p), raw, "aware", bool, True),
        "round_s": float(_get(str(p), raw, "round_s", (int, float), 20.0)),
        "checkpoint_every": _get(str(p), raw, "checkpoint_every", int, 2),
        "measure_iterations": _get(str(p), raw, "measure_iterations", int, 12),
        "check_alone": _get(str(p), raw, "check_alone", bool, True),
    }
    devices = []
    for i, d in enumerate(_get(str(p), raw, "device", list, [])):
        where = f"{p}: device[{i}]"
        cpus = float(_get(where, d, "cpus", (int, float), 1.0))
        if not 0.05 <= cpus <= (os.cpu_count() or 1):
            raise PlanError(f"{where}: cpus must be in [0.05, {os.cpu_count()}] (got {cpus})")
        devices.append((_get(where, d, "type", str, ""), _get(where, d, "count", int, 1), cpus))
    jobs = []
    for i, j in enumerate(_get(str(p), raw, "job", list, [])):
        where = f"{p}: job[{i}]"
        config = p.parent / _get(where, j, "config", str, "")
        if not config.is_file():
            raise PlanError(f"{where}: config {str(config)!r} is not a file")
        tput = j.get("throughputs")
        jobs.append(SliceJob(name=_get(where, j, "name", str, f"job{i}"), config=config,
                             throughputs=None if tput is None else dict(tput)))  # fmt: skip
    if not devices or not jobs:
        raise PlanError(f"{p}: give at least one [[device]] and one [[job]]")
    return SliceSpec(devices=tuple(devices), jobs=tuple(jobs), policy=policy, **scalars)


def cgroup_root() -> tuple[Path, str]:
    """Where CPU-quota cgroups can be made here, and the version ("v1" or "v2")."""
    if (_CPU_V1 / "cpu.cfs_quota_us").exists() and os.access(_CPU_V1, os.W_OK):
        return _CPU_V1, "v1"
    controllers = _CPU_V2 / "cgroup.controllers"
    if controllers.exists() and os.access(_CPU_V2, os.W_OK) and "cpu" in controllers.read_text():
        return _CPU_V2, "v2"
    raise PlanError(
        "adaptipe cluster run needs write access to the cgroup cpu controller "
        "(/sys/fs/cgroup/cpu or a cgroup v2 hierarchy with cpu): run it as root"
    )


class _Quota:
    """One cgroup with a CPU quota; processes started through `wrap` run inside it."""

    def __init__(self, name: str, cpus: float) -> None:
        root, version = cgroup_root()
        self.path = root / f"adaptipe-{os.getpid()}-{name}"
        self.path.mkdir(exist_ok=True)
        quota = max(int(cpus * PERIOD_US), 1000)
        if version == "v1":
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        enter = f'echo $$ > {self.path}/cgroup.procs && exec "$@"'
        return ["sh", "-c", enter, "sh", *cmd]

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _train_cmd(config: Path, run_dir: Path, *, resume: bool, **over: int) -> list[str]:
    cmd = [sys.executable, "-m", "adaptipe.timeslice", str(config), "--run-dir", str(run_dir)]
    cmd += ["--resume"] if resume else []
    for key, value in over.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes], *, timeout: float = 60.0) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return int(proc.returncode)


def _iteration(run_dir: Path) -> int:
    """Iterations done as the latest committed checkpoint says (0 without one)."""
    from adaptipe.runtime import checkpoint as ckpt

    latest = ckpt.latest(run_dir / "checkpoints")
    if latest is None:
        return 0
    record = json.loads((latest / "COMMITTED.json").read_text())
    return int(record.get("iteration", 0))


def _measure(
    spec: SliceSpec, out: Path, quotas: Mapping[str, _Quota]
) -> dict[str, dict[str, float]]:
    """Iterations per second of every job on every device type (median span after the
    first few iterations of a short run inside the type's quota)."""
    got: dict[str, dict[str, float]] = {}
    for job in spec.jobs:
        got[job.name] = dict(job.throughputs or {})
        for kind, _, _ in spec.devices:
            if kind in got[job.name]:
                continue
            run_dir = out / "measure" / f"{job.name}-{kind}"
            cmd = _train_cmd(job.config, run_dir, resume=False, iterations=spec.measure_iterations)
            proc = _start(quotas[kind].wrap(cmd), out / "measure.log")
            try:
                code = proc.wait()
            finally:
                _stop(proc)
            if code != 0:
                raise PlanError(f"measuring {job.name} on {kind} failed: see {out / 'measure.log'}")
            spans = [
                json.loads(line)["iteration_s"]
                for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            ]
            got[job.name][kind] = 1.0 / float(np.median(spans[len(spans) // 3 :]))
    return got


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("terminated (SIGTERM)")


def _slots(spec: SliceSpec) -> dict[str, list[_Quota]]:
    return {
        kind: [_Quota(f"{kind}-{i}", cpus) for i in range(count)]
        for kind, count, cpus in spec.devices
    }


def _total_iterations(config: Path) -> int:
    from adaptipe.runtime.config import parse_config

    cfg = parse_config(config)
    if cfg.train.iterations is None:
        raise PlanError(f"{config}: a time-sliced job needs [train].iterations (not epochs)")
    return cfg.train.iterations


def _round(
    spec: SliceSpec,
    out: Path,
    placed: Sequence[tuple[SliceJob, int]],
    slots: Mapping[str, list[_Quota]],
) -> tuple[dict[str, int], float]:
    """Run the placed jobs for one round; their exit codes and the round's seconds."""
    free = {kind: list(quotas) for kind, quotas in slots.items()}
    procs = {}
    start = time.monotonic()
    for job, k in placed:
        kind = spec.devices[k][0]
        run_dir = out / "jobs" / job.name
        resume = _iteration(run_dir) > 0
        cmd = _train_cmd(job.config, run_dir, resume=resume, checkpoint_every=spec.checkpoint_every)
        procs[job.name] = _start(free[kind].pop(0).wrap(cmd), out / "jobs" / f"{job.name}.log")
    try:
        while time.monotonic() - start < spec.round_s and any(
            p.poll() is None for p in procs.values()
        ):
            time.sleep(0.2)
    finally:  # an interrupted round stops its jobs too (they run in sessions of their own)
        codes = {name: _stop(p) for name, p in procs.items()}
    return codes, time.monotonic() - start


def run_sliced(spec: SliceSpec, out: Path, *, say: Any = print) -> dict[str, Any]:
    """Time-slice the spec's jobs to completion; the log `cluster-run.json` holds."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "jobs").mkdir(exist_ok=True)
    slots = _slots(spec)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        tput = _measure(spec, out, {kind: q[0] for kind, q in slots.items()})
        say(f"measured iterations/s: {json.dumps(tput)}")
        result = _run_rounds(spec, out, slots, tput, say)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for quotas in slots.values():
            for quota in quotas:
                quota.close()
    if spec.check_alone:
        result["alone"] = {job.name: _same_as_alone(job, out) for job in spec.jobs}
    (out / "cluster-run.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _run_rounds(
    spec: SliceSpec,
    out: Path,
    slots: Mapping[str, list[_Quota]],
    tput: Mapping[str, Mapping[str, float]],
    say: Any,
) -> dict[str, Any]:
    cluster = spec.cluster()
    types = cluster.types
    totals = {job.name: _total_iterations(job.config) for job in spec.jobs}
    state = RoundRobinState()
    asked = {job.name: np.zeros(len(types)) for job in spec.jobs}
    got = {job.name: np.zeros(len(types)) for job in spec.jobs}
    done: dict[str, float] = {}
    stalled: dict[str, int] = {}
    rounds: list[dict[str, Any]] = []
    began = time.monotonic()
    while len(done) < len(spec.jobs):
        active = [job for job in spec.jobs if job.name not in done]
        left = [totals[j.name] - _iteration(out / "jobs" / j.name) for j in active]
        jobs = [ClusterJob(name=j.name, throughputs=dict(tput[j.name]), steps=float(totals[j.name]))
                for j in active]  # fmt: skip
        x = allocate(jobs, cluster, policy=spec.policy, aware=spec.aware, remaining=left).x
        names = tuple(j.name for j in active)
        placed = place_round(x, state.row(names, len(types)), [1] * len(active), cluster.workers)
        runs = [(job, k) for job, k in zip(active, placed, strict=True) if k is not None]
        before = {job.name: _iteration(out / "jobs" / job.name) for job, _ in runs}
        codes, seconds = _round(spec, out, runs, slots)
        for i, job in enumerate(active):
            asked[job.name] += x[i]
        for job, k in runs:
            state.add(job.name, k)
            got[job.name][k] += 1
            finished = _iteration(out / "jobs" / job.name) >= totals[job.name]
            if codes[job.name] == 0 or finished:  # stopped just after its last checkpoint
                done[job.name] = time.monotonic() - began
            elif codes[job.name] not in (128 + signal.SIGTERM, -signal.SIGTERM):
                log = out / "jobs" / f"{job.name}.log"
                raise PlanError(f"job {job.name} failed (exit {codes[job.name]}): see {log}")
            elif _iteration(out / "jobs" / job.name) <= before[job.name]:
                stalled[job.name] = stalled.get(job.name, 0) + 1
                if stalled[job.name] >= 3:
                    raise PlanError(
                        f"job {job.name} reached no new checkpoint in 3 rounds of "
                        f"{spec.round_s:g} s on {types[k]}: starting it takes longer than a "
                        "round there; raise round_s or lower checkpoint_every"
                    )
        rounds.append({
            "round": len(rounds), "seconds": round(seconds, 3),
            "placed": {job.name: types[k] for job, k in runs},
            "allocation": {n: [round(float(v), 4) for v in x[i]] for i, n in enumerate(names)},
            "iterations": {j.name: _iteration(out / "jobs" / j.name) for j in active},
        })  # fmt: skip
        say(f"round {len(rounds) - 1}: " + ", ".join(f"{j.name} on {types[k]}" for j, k in runs)
            + f" ({seconds:.1f} s; {len(done)}/{len(spec.jobs)} done)")  # fmt: skip
    shares = {
        name: {
            "rounds": {t: int(got[name][k]) for k, t in enumerate(types)},
            "allocated": {t: round(float(asked[name][k]), 3) for k, t in enumerate(types)},
            "largest_gap_rounds": round(float(np.abs(got[name] - asked[name]).max()), 3),
        }
        for name in got
    }
    return {
        "policy": spec.policy, "aware": spec.aware, "round_s": spec.round_s,
        "devices": [{"type": t, "count": n, "cpus": c} for t, n, c in spec.devices],
        "throughputs": {k: dict(v) for k, v in tput.items()},
        "completion_s": done, "rounds": rounds, "shares": shares,
    }  # fmt: skip


def _same_as_alone(job: SliceJob, out: Path) -> dict[str, Any]:
    """Train ``job`` alone, uninterrupted and unthrottled; compare final parameters."""
    import torch

    from adaptipe.runtime import checkpoint as ckpt

    alone = out / "alone" / job.name
    proc = _start(_train_cmd(job.config, alone, resume=False), out / "alone.log")
    if proc.wait() != 0:
        raise PlanError(f"training {job.name} alone failed: see {out / 'alone.log'}")
    sliced_dir, alone_dir = (
        ckpt.latest(out / "jobs" / job.name / "checkpoints"),
        ckpt.latest(alone / "checkpoints"),
    )
    if sliced_dir is None or alone_dir is None:
        return {"equal": False, "why": "no final checkpoint"}
    a, ra = ckpt.load(sliced_dir)
    b, rb = ckpt.load(alone_dir)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {
        "equal": same,
        "tensors": len(a),
        "iteration": [ra.get("iteration"), rb.get("iteration")],
    }


def _main(argv: Sequence[str] | None = None) -> int:
    """The process a round starts: train (or resume) one config, with the spec's
    checkpoint interval, exiting 143 when preempted (SIGTERM)."""
    import argparse

    from adaptipe.runtime.config import parse_config
    from adaptipe.runtime.launch import train

    p = argparse.ArgumentParser(prog="python -m adaptipe.timeslice")
    p.add_argument("config")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--iterations", type=int)
    p.add_argument("--checkpoint-every", type=int)
    args = p.parse_args(argv)
    cfg = parse_config(args.config)
    section = cfg.train
    if args.iterations is not None:
        section = replace(section, iterations=args.iterations, checkpoint_every=0)
    if args.checkpoint_every is not None:
        section = replace(section, checkpoint_every=args.checkpoint_every)
    try:
        if args.resume:
            train(cfg, run_dir=args.run_dir, resume=True)
        else:
            train(replace(cfg, train=section), run_dir=args.run_dir)
    except KeyboardInterrupt:
        return 128 + signal.SIGTERM
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
