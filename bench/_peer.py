"""Reference points for adaptipe's pipeline benchmark.

* `run_single`: one process trains the whole model (one thread by default); its
  throughput times the number of stage processes is "the limit" (`limit`).
* `run_peer`: PyTorch's own `torch.distributed.pipelining` (ScheduleGPipe or
  Schedule1F1B) over `stages` loopback gloo processes, one pinned core and one thread
  each, on the same model, data, loss and optimiser.

Every measurement runs in fresh child processes (clean thread settings and allocator
state); children are started in their own session, given a deadline and always killed
by pid. The parent never imports torch.

CLI (prints one JSON object)::

    python bench/_peer.py single [--microbatches 8] ...
    python bench/_peer.py peer --schedule 1f1b [--stages 2] ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Literal, cast

Schedule = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b")
LR = 1e-3
_WORKER_FLAG = "_worker"
_STDERR_TAIL = 4000


class PeerRunError(RuntimeError):
    """A child process failed or ran past its deadline.

    `pids` are the children's process ids (all dead when this is raised); `stderr`
    maps a child index (the rank for `run_peer`) to the tail of its stderr.
    """

    def __init__(self, message: str, pids: list[int], stderr: dict[int, str]) -> None:
        super().__init__(message)
        self.pids = pids
        self.stderr = stderr


def limit(single_samples_per_s: float, processes: int) -> float:
    """The throughput target: one single-thread process's throughput times `processes`."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    return single_samples_per_s * processes


def split_blocks(blocks: int, stages: int) -> list[tuple[int, int]]:
    """Split `blocks` into `stages` contiguous [start, end) ranges, sizes differing by <= 1."""
    if stages < 1 or blocks < stages:
        raise ValueError(f"need 1 <= stages <= blocks, got stages={stages}, blocks={blocks}")
    base, extra = divmod(blocks, stages)
    bounds: list[tuple[int, int]] = []
    start = 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (bind to port 0, then release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def mlp_model(hidden: int, blocks: int, num_samples: int) -> dict[str, Any]:
    """The ``[model]`` section that makes adaptipe's ``mlp`` the benchmark model above:
    ``blocks`` x (Linear(hidden, hidden), ReLU), so adaptipe and the peer train the same."""
    return {
        "name": "mlp",
        "config": {
            "in_features": hidden,
            "hidden": hidden,
            "out_features": hidden,
            "depth": blocks,
            "num_samples": num_samples,
        },
    }


def _single_cfg(
    hidden: int,
    blocks: int,
    batch: int,
    iterations: int,
    warmup: int,
    threads: int,
    seed: int,
    microbatches: int,
    cores: Sequence[int] | None,
) -> dict[str, Any]:
    """What a ``single`` child reads: the model, its timing and where it runs."""
    return {
        "hidden": hidden,
        "blocks": blocks,
        "batch": batch,
        "iterations": iterations,
        "warmup": warmup,
        "threads": threads,
        "seed": seed,
        "microbatches": microbatches,
        "cores": sorted(cores) if cores is not None else None,
    }


def run_single(
    *,
    hidden: int = 1024,
    blocks: int = 16,
    batch: int = 256,
    iterations: int = 20,
    warmup: int = 3,
    threads: int = 1,
    seed: int = 0,
    microbatches: int = 1,
    cores: Sequence[int] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Train the whole model in one fresh process and time it.

    Sequential of `blocks` x (Linear(hidden, hidden), ReLU), MSE against a fixed random
    target, SGD(lr=1e-3). `microbatches` > 1 accumulates gradients over that many equal
    micro-batches (loss scaled by 1/microbatches, so the update equals the full-batch
    one). `cores` optionally pins the process (default: not pinned).
    Returns samples_per_s (batch * iterations / elapsed), samples_per_s_median (batch /
    median iteration time, robust to a noisy machine), iteration_s, final_loss, pids, ...
    """
    _check_common(hidden, blocks, batch, iterations, warmup, microbatches)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    cfg = _single_cfg(hidden, blocks, batch, iterations, warmup, threads, seed, microbatches, cores)
    results, pids = _launch([("single", cfg, _child_env(threads))], timeout_s)
    out = results[0]
    out["pids"] = pids
    return out


def run_concurrent_singles(
    processes: int,
    *,
    hidden: int = 1024,
    blocks: int = 16,
    batch: int = 256,
    iterations: int = 20,
    warmup: int = 3,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """``processes`` independent single-thread trainings at once, one per core.

    What the machine itself allows ``processes`` busy processes (shared memory bandwidth
    and caches, turbo): the ceiling a pipeline of that many stage processes can reach,
    as opposed to the nominal limit of one process's throughput times ``processes``.
    Returns the summed samples_per_s (each child's own median rate) and each child's.
    """
    _check_common(hidden, blocks, batch, iterations, warmup, 1)
    cores = sorted(os.sched_getaffinity(0))
    jobs = []
    for i in range(processes):
        cfg = _single_cfg(
            hidden, blocks, batch, iterations, warmup, 1, seed + i, 1, [cores[i % len(cores)]]
        )
        jobs.append(("single", cfg, _child_env(1)))
    results, pids = _launch(jobs, timeout_s)
    each = [float(r["samples_per_s_median"]) for r in results]
    return {"samples_per_s": sum(each), "each": each, "pids": pids}


def run_peer(
    *,
    schedule: Schedule,
    stages: int = 2,
    hidden: int = 1024,
    blocks: int = 16,
    batch: int = 256,
    microbatches: int = 8,
    iterations: int = 20,
    warmup: int = 3,
    threads_per_stage: int = 1,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Train with `torch.distributed.pipelining` over `stages` loopback gloo processes.

    Rank r builds the same seeded model, keeps its contiguous share of blocks as a
    `PipelineStage` (static shapes given), pins itself to core r % cpu_count, and runs
    `ScheduleGPipe`/`Schedule1F1B` (loss_fn=MSE, grads scaled by 1/microbatches) then
    SGD step and zero_grad. The clock starts after a barrier following `warmup` steps
    and stops after a barrier following `iterations` steps; samples_per_s = batch *
    iterations / (slowest rank's elapsed); samples_per_s_median uses rank 0's median
    iteration time. final_loss (last iteration, mean over micro-batches) should match
    `run_single`'s for the same seed.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    _check_common(hidden, blocks, batch, iterations, warmup, microbatches)
    split_blocks(blocks, stages)  # validates stages
    if threads_per_stage < 1:
        raise ValueError(f"threads_per_stage must be >= 1, got {threads_per_stage}")
    if schedule == "1f1b" and microbatches < stages:
        raise ValueError(f"1f1b needs microbatches >= stages, got {microbatches} < {stages}")
    port = free_port()
    jobs: list[tuple[str, dict[str, Any], dict[str, str]]] = []
    for rank in range(stages):
        cfg: dict[str, Any] = {
            "schedule": schedule,
            "rank": rank,
            "stages": stages,
            "hidden": hidden,
            "blocks": blocks,
            "batch": batch,
            "microbatches": microbatches,
            "iterations": iterations,
            "warmup": warmup,
            "threads": threads_per_stage,
            "seed": seed,
            "timeout_s": timeout_s,
        }
        env = _child_env(threads_per_stage)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(stages),
            LOCAL_RANK=str(rank),
        )
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        jobs.append(("peer", cfg, env))
    results, pids = _launch(jobs, timeout_s)
    elapsed = max(float(r["elapsed_s"]) for r in results)
    last = results[-1]
    return {
        "bench": "peer",
        "schedule": schedule,
        "stages": stages,
        "hidden": hidden,
        "blocks": blocks,
        "batch": batch,
        "microbatches": microbatches,
        "iterations": iterations,
        "warmup": warmup,
        "threads_per_stage": threads_per_stage,
        "seed": seed,
        "samples_per_s": batch * iterations / elapsed,
        "samples_per_s_median": batch / statistics.median(results[0]["iteration_s"]),
        "elapsed_s": elapsed,
        "iteration_s": results[0]["iteration_s"],
        "final_loss": last["final_loss"],
        "rank_elapsed_s": [r["elapsed_s"] for r in results],
        "rank_iteration_s": [r["iteration_s"] for r in results],
        "rank_cpu_s": [r["cpu_s"] for r in results],
        "rank_cores": [r["cores"] for r in results],
        "rank_blocks": [r["blocks_range"] for r in results],
        "torch": last["torch"],
        "cpu_count": last["cpu_count"],
        "pids": pids,
    }


# --------------------------------------------------------------------------- parent side


def _check_common(
    hidden: int, blocks: int, batch: int, iterations: int, warmup: int, microbatches: int
) -> None:
    """Validate the arguments shared by `run_single` and `run_peer`."""
    if min(hidden, blocks, batch, iterations, microbatches) < 1 or warmup < 0:
        raise ValueError("hidden, blocks, batch, iterations, microbatches must be >= 1")
    if batch % microbatches:
        raise ValueError(f"batch {batch} is not divisible by microbatches {microbatches}")


def _child_env(threads: int) -> dict[str, str]:
    """Environment for a child: thread pools sized to `threads`, no DETAIL debug checks."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # DETAIL turns on per-microbatch tensor validation inside pipelining; not a fair setup.
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _tail(path: Path) -> str:
    """The last few KB of a text file ('' if missing)."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-_STDERR_TAIL:].decode("utf-8", errors="replace")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill a child and its process group by id, then reap it.

    The group id is the child's pid (start_new_session=True); it is only signalled while
    the child is unreaped, so the id cannot have been reused by an unrelated process.
    """
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _launch(
    jobs: Sequence[tuple[str, dict[str, Any], dict[str, str]]], timeout_s: float
) -> tuple[list[dict[str, Any]], list[int]]:
    """Run one child per (kind, config, env) job; return their result dicts and pids.

    Raises PeerRunError (with each failing child's stderr tail) when a child exits
    non-zero or the deadline passes; every child is killed in any case.
    """
    script = str(Path(__file__).resolve())
    procs: list[subprocess.Popen[bytes]] = []
    files: list[IO[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="adaptipe-peer-") as tmp_name:
        tmp = Path(tmp_name)
        failed: list[int] = []
        timed_out = False
        try:
            for i, (kind, cfg, env) in enumerate(jobs):
                out = open(tmp / f"{i}.out", "wb")  # noqa: SIM115 - closed in finally
                files.append(out)
                err = open(tmp / f"{i}.err", "wb")  # noqa: SIM115 - closed in finally
                files.append(err)
                argv = [
                    sys.executable,
                    script,
                    _WORKER_FLAG,
                    kind,
                    json.dumps(cfg),
                    str(tmp / f"{i}.json"),
                ]
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in procs]
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                _kill(p)
            for f in files:
                f.close()
        pids = [p.pid for p in procs]
        if failed or timed_out:
            bad = failed if failed else list(range(len(procs)))
            stderr = {i: _tail(tmp / f"{i}.err") for i in bad}
            what = (
                f"timed out after {timeout_s:g} s"
                if timed_out
                else "failed: "
                + ", ".join(f"child {i} exit code {procs[i].returncode}" for i in failed)
            )
            detail = "\n".join(f"--- child {i} stderr ---\n{s}" for i, s in stderr.items())
            raise PeerRunError(f"{jobs[0][0]} run {what}\n{detail}", pids, stderr)
        results = [
            cast(dict[str, Any], json.loads((tmp / f"{i}.json").read_text()))
            for i in range(len(procs))
        ]
    return results, pids


# --------------------------------------------------------------------------- child side


def _pin(cores: Sequence[int] | None) -> list[int]:
    """Pin this process (and threads it creates later) to `cores`; return the affinity."""
    if cores is not None:
        os.sched_setaffinity(0, set(cores))
    return sorted(os.sched_getaffinity(0))


def _cpu_s() -> float:
    """CPU time (user + system) of this process so far, all threads."""
    return time.process_time()


def _build(hidden: int, blocks: int, batch: int, seed: int) -> tuple[Any, Any, Any]:
    """The seeded model, input and target, identical in every process."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = nn.Sequential(*layers)
    x = torch.randn(batch, hidden)
    y = torch.randn(batch, hidden)
    return model, x, y


def _single_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Child body of `run_single`."""
    cores = _pin(cfg["cores"])
    import torch
    from torch import nn

    torch.set_num_threads(int(cfg["threads"]))
    model, x, y = _build(cfg["hidden"], cfg["blocks"], cfg["batch"], cfg["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.MSELoss()
    m = int(cfg["microbatches"])
    xs, ys = x.chunk(m), y.chunk(m)

    def step() -> float:
        if m == 1:
            loss = loss_fn(model(x), y)
            loss.backward()
            value = loss.detach()
        else:
            value = torch.zeros(())
            for xc, yc in zip(xs, ys, strict=True):
                loss = loss_fn(model(xc), yc) / m
                loss.backward()
                value += loss.detach()
        opt.step()
        opt.zero_grad()
        return float(value)

    for _ in range(int(cfg["warmup"])):
        step()
    times: list[float] = []
    cpu0 = _cpu_s()
    t0 = time.perf_counter()
    last = t0
    final_loss = float("nan")
    for _ in range(int(cfg["iterations"])):
        final_loss = step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    elapsed = last - t0
    return {
        "bench": "single",
        **{k: v for k, v in cfg.items() if k != "cores"},
        "samples_per_s": cfg["batch"] * cfg["iterations"] / elapsed,
        "samples_per_s_median": cfg["batch"] / statistics.median(times),
        "elapsed_s": elapsed,
        "iteration_s": times,
        "final_loss": final_loss,
        "cpu_s": _cpu_s() - cpu0,
        "cores": cores,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
    }


def _peer_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Child body of `run_peer` for one rank."""
    from datetime import timedelta

    rank, stages = int(cfg["rank"]), int(cfg["stages"])
    cores = _pin([rank % (os.cpu_count() or 1)])
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(int(cfg["threads"]))
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=stages,
        timeout=timedelta(seconds=float(cfg["timeout_s"])),
    )
    try:
        hidden, batch, m = int(cfg["hidden"]), int(cfg["batch"]), int(cfg["microbatches"])
        model, x, y = _build(hidden, int(cfg["blocks"]), batch, int(cfg["seed"]))
        lo, hi = split_blocks(int(cfg["blocks"]), stages)[rank]
        submod = nn.Sequential(*list(model)[2 * lo : 2 * hi])
        del model
        is_first, is_last = rank == 0, rank == stages - 1
        mb = batch // m
        # Static shapes: no metadata exchange, recv buffers sized up front.
        stage = PipelineStage(
            submod,
            stage_index=rank,
            num_stages=stages,
            device=torch.device("cpu"),
            input_args=torch.empty(mb, hidden, requires_grad=not is_first),
            output_args=torch.empty(mb, hidden, requires_grad=True),
        )
        cls = ScheduleGPipe if cfg["schedule"] == "gpipe" else Schedule1F1B
        schedule = cls(stage, n_microbatches=m, loss_fn=nn.MSELoss())
        opt = torch.optim.SGD(submod.parameters(), lr=LR)
        losses: list[torch.Tensor] = []

        def step() -> None:
            losses.clear()
            args = (x,) if is_first else ()
            if is_last:
                schedule.step(*args, target=y, losses=losses, return_outputs=False)
            else:
                schedule.step(*args, return_outputs=False)
            opt.step()
            opt.zero_grad()

        for _ in range(int(cfg["warmup"])):
            step()
        dist.barrier()
        times: list[float] = []
        cpu0 = _cpu_s()
        t0 = time.perf_counter()
        last = t0
        for _ in range(int(cfg["iterations"])):
            step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        dist.barrier()
        elapsed = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
        final_loss = float(torch.stack(losses).mean()) if is_last else None
        return {
            "rank": rank,
            "elapsed_s": elapsed,
            "iteration_s": times,
            "cpu_s": cpu,
            "final_loss": final_loss,
            "cores": cores,
            "blocks_range": [lo, hi],
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
        }
    finally:
        dist.destroy_process_group()


def _worker_main(argv: Sequence[str]) -> None:
    """Entry point of a child: `_worker {single,peer} CONFIG_JSON RESULT_PATH`."""
    kind, cfg_json, result_path = argv
    cfg = cast(dict[str, Any], json.loads(cfg_json))
    result = _single_worker(cfg) if kind == "single" else _peer_worker(cfg)
    Path(result_path).write_text(json.dumps(result))


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    """CLI argument parser."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--hidden", type=int, default=1024)
    common.add_argument("--blocks", type=int, default=16)
    common.add_argument("--batch", type=int, default=256)
    common.add_argument("--iterations", type=int, default=20)
    common.add_argument("--warmup", type=int, default=3)
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--timeout-s", type=float, default=300.0)
    single = sub.add_parser("single", parents=[common], help="one process, whole model")
    single.add_argument("--threads", type=int, default=1)
    single.add_argument("--microbatches", type=int, default=1)
    single.add_argument("--cores", type=int, nargs="+", default=None, help="pin to these")
    peer = sub.add_parser("peer", parents=[common], help="torch.distributed.pipelining")
    peer.add_argument("--schedule", choices=SCHEDULES, required=True)
    peer.add_argument("--stages", type=int, default=2)
    peer.add_argument("--microbatches", type=int, default=8)
    peer.add_argument("--threads-per-stage", type=int, default=1)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: run one measurement and print its JSON object."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [_WORKER_FLAG]:
        _worker_main(args[1:])
        return
    ns = _parser().parse_args(args)
    common = {
        "hidden": ns.hidden,
        "blocks": ns.blocks,
        "batch": ns.batch,
        "iterations": ns.iterations,
        "warmup": ns.warmup,
        "seed": ns.seed,
        "microbatches": ns.microbatches,
        "timeout_s": ns.timeout_s,
    }
    if ns.cmd == "single":
        out = run_single(threads=ns.threads, cores=ns.cores, **common)
    else:
        out = run_peer(
            schedule=ns.schedule,
            stages=ns.stages,
            threads_per_stage=ns.threads_per_stage,
            **common,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
