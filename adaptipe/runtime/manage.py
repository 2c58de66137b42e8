"""The manager of a run whose workers another launcher starts: ``adaptipe manage RUN_DIR``.

`adaptipe train` starts one worker per stage on this machine and manages them. Across
hosts torchrun starts the workers; `manage` is the same manager on its own. It marks
itself in the run directory (``control/manager.json``, `adaptipe.runtime.managerinfo`)
with the address its telemetry collector listens on and the CURVE keys the workers
publish with (off loopback, telemetry is always encrypted and authenticated), then
merges the metrics, answers stop and re-partition requests, decides halvings, logs
migrations and writes the summary, exactly as `adaptipe train` does. It cannot see the
workers' processes, so it follows them through the run directory: a stage is done when
its log says so, failed when it wrote its error file, and lost when no stage has
reported anything for ``wait_s`` seconds.

Start it before the workers (they look it up when they start)::

    adaptipe prepare run.toml --run-dir /shared/runs/r
    adaptipe manage /shared/runs/r --bind 192.0.2.1 &
    torchrun --nnodes 2 ... -m adaptipe.runtime.worker --run-dir /shared/runs/r

With ``--inject SCENARIO`` it runs an interference scenario on the run's clock, as
`adaptipe train --inject` does: link shapes on a bed of namespace hosts, hogs and memory
pressure on this host; kills, slowdowns and throttles are refused
(`adaptipe.runtime.interference`).
"""

from __future__ import annotations

import ipaddress
import os
import time
from pathlib import Path

from adaptipe.errors import PlanError
from adaptipe.monitor.collector import Collector
from adaptipe.runtime.adapt_loop import DeciderFactory
from adaptipe.runtime.host import this_host
from adaptipe.runtime.interference import load_interference
from adaptipe.runtime.launch import ProgressFn, _resumable, _run
from adaptipe.runtime.managerinfo import ManagerInfo, write_manager
from adaptipe.runtime.metrics_merge import MetricsFollower
from adaptipe.runtime.rundir import RunDir
from adaptipe.runtime.summary import TrainSummary
from adaptipe.runtime.supervisor import StageFailed, Workers

__all__ = ["manage"]


def manage(
    run_dir: str | os.PathLike[str],
    *,
    bind: str = "127.0.0.1",
    resume: bool = False,
    on_iteration: ProgressFn | None = None,
    poll_s: float = 0.05,
    wait_s: float = 600.0,
    inject: str | os.PathLike[str] | None = None,
    inject_seed: int = 0,
    decider: DeciderFactory | None = None,
) -> TrainSummary:
    """Manage the prepared run in ``run_dir`` while workers started elsewhere train it;
    return its summary.

    Args:
        bind: the address of this host that the workers reach (the collector listens
            there on a free port); off loopback, telemetry needs CURVE, which this
            sets up. Not a wildcard: the workers are told this address.
        resume: the workers were started with ``--resume`` (the run goes on from its
            latest checkpoint).
        on_iteration: called with each merged metrics record and the total.
        wait_s: how long no stage may report anything before the run counts as lost.
        inject: an interference scenario (TOML) to run on the run's clock, from this
            host; its events join the telemetry. Kills, slowdowns and throttles are
            refused (they need workers this process started).
        inject_seed: seed of the scenario's random draws.
        decider: builds ``[adapt].controller``'s controller (as for `launch.train`).
    """
    run = RunDir(Path(run_dir))
    if resume:
        run, cfg, start = _resumable(run)
    else:
        if not run.config_json.exists():
            raise PlanError(
                f"{run.root}: not a prepared run directory (no config.json); "
                "run `adaptipe prepare CONFIG --run-dir DIR` first"
            )
        cfg, start = run.read_config(), 0
    if cfg.adapt.method == "restart":
        raise PlanError(
            f"{run.config_json}: [adapt].method = 'restart' needs the launcher to start the "
            "workers again, which `adaptipe train` does and `adaptipe manage` cannot; use "
            "'live' or 'checkpoint'"
        )
    address = _check_bind(bind)
    schedule = run.read_schedule()
    if max(run.read_partition().replicas) > 1:
        raise PlanError(
            f"{run.partition_json}: replicas {list(run.read_partition().replicas)} replicate a "
            "stage, which `adaptipe train` runs (one host) and `adaptipe manage` does not yet "
            "(its torchrun workers are counted per stage); train it with `adaptipe train`"
        )
    scenario = None
    if inject is not None:
        scenario = load_interference(
            inject,
            num_stages=schedule.num_stages,
            num_cores=this_host().cores,
            seed=inject_seed,
            remote=True,
        )
    elsewhere = _Torchrun(address, wait_s=wait_s, stages=schedule.num_stages)
    return _run(
        run,
        cfg,
        cfg.model.spec(),
        schedule,
        start=start,
        resume=resume,
        on_iteration=on_iteration,
        poll_s=poll_s,
        scenario=scenario,
        inject_seed=inject_seed,
        elsewhere=elsewhere,
        decider=decider,
    )


def _check_bind(bind: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        address = ipaddress.ip_address(bind.strip("[]"))
    except ValueError:
        raise PlanError(
            f"--bind {bind!r} is not an IP address; give this host's address that the "
            "workers reach (e.g. 192.0.2.1), or 127.0.0.1 when they run here"
        ) from None
    if address.is_unspecified:
        raise PlanError(
            f"--bind {bind!r} is a wildcard; the workers are told this address, so give one "
            "they reach (e.g. 192.0.2.1)"
        )
    return address


class _Torchrun:
    """Workers torchrun starts: a collector on ``address`` and the run directory."""

    def __init__(
        self, address: ipaddress.IPv4Address | ipaddress.IPv6Address, *, wait_s: float, stages: int
    ) -> None:
        self.address, self.wait_s, self.stages = address, wait_s, stages

    def start(
        self, run: RunDir, follower: MetricsFollower, *, monitored: bool
    ) -> tuple[Collector | None, Workers]:
        from adaptipe.monitor.publisher import CurveKeys

        collector = None
        info = ManagerInfo.here()
        if monitored:
            host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
            keys = None if self.address.is_loopback else CurveKeys.generate()
            collector = Collector(
                jsonl=run.telemetry,
                bind=f"tcp://{host}:*",
                curve=keys.for_server() if keys is not None else None,
            )  # driven by the manager's loop (`launch._follow`), as `adaptipe train`'s
            info = ManagerInfo.here(
                telemetry=collector.address,
                **(
                    {
                        "server_public": keys.server_public.decode(),
                        "client_public": keys.client_public.decode(),
                        "client_secret": (keys.client_secret or b"").decode(),
                    }
                    if keys is not None
                    else {}
                ),
            )
        write_manager(run, info)
        return collector, _RemoteWorkers(run, follower, self.stages, self.wait_s)


class _RemoteWorkers:
    """Stages followed through the run directory alone (their processes are elsewhere)."""

    def __init__(self, run: RunDir, follower: MetricsFollower, stages: int, wait_s: float) -> None:
        self.run, self.follower, self.stages, self.wait_s = run, follower, stages, wait_s
        self.since = time.monotonic()

    def codes(self) -> list[int | None]:
        codes: list[int | None] = []
        for s in range(self.stages):
            if self.run.error(s).exists():
                codes.append(1)
            else:
                codes.append(0 if s in self.follower.done else None)
        heard = max(self.since, self.follower.heard)
        if None in codes and time.monotonic() - heard > self.wait_s:
            waiting = [s for s, c in enumerate(codes) if c is None]
            started = "no stage has" if self.follower.ready == 0 else "no stage has since"
            raise StageFailed(
                f"{self.run.root}: stages {waiting} unheard for {self.wait_s:.0f} s; "
                f"{started} reported (are the workers running, e.g. `torchrun ... -m "
                f"adaptipe.runtime.worker --run-dir {self.run.root}`?)"
            )
        return codes

    def respawn(self) -> None:
        raise PlanError("restarting the workers needs the launcher that started them")

    def stop(self) -> None:
        pass  # their launcher owns them; a failed peer ends them through the process group
