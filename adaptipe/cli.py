"""The ``adaptipe`` command: thin sub-commands over the library.

Every step writes a plan file and reads one (profile -> partition -> schedule ->
simulation), so a user can inspect, diff and hand-edit what flows between them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adaptipe.errors import AdaptipeError, PlanError
from adaptipe.units import format_bytes, parse_bandwidth, parse_bytes

__all__ = ["main"]


def _parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``--set n_layer=6`` -> ``{"n_layer": 6}`` (values parsed as JSON when they can be)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PlanError(f"--set {pair!r} must look like name=value (e.g. --set n_layer=6)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _floats(text: str, *, what: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise PlanError(f"{what} {text!r} must be comma-separated numbers (e.g. 1,1.5,1)") from None


# --------------------------------------------------------------------------- profile
def _cmd_profile(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from adaptipe.models import get_model
    from adaptipe.profile import profile_model
    from adaptipe.serial import write_json

    spec = get_model(args.model, **_parse_overrides(args.set))
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=args.json) as bar:
        task = bar.add_task(f"profiling {spec.name}", total=spec.num_layers)

        def step(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, description=f"profiling {spec.name}: {name}")

        prof = profile_model(
            spec,
            microbatch=args.microbatch,
            device=args.device,
            warmup=args.warmup,
            repeats=args.repeats,
            optimizer=args.optimizer,
            threads=args.threads,
            progress=step,
            wgrad_microbatches=args.wgrad_microbatches,
        )
    if args.out:
        write_json(args.out, prof.to_json())
    if args.json:
        print(json.dumps(prof.to_json()))
        return 0
    from rich.table import Table

    table = Table(
        title=f"{prof.model}, micro-batch {prof.microbatch}, {prof.device}, {prof.threads} thread(s)"
    )
    for col in ("layer", "kind", "fwd ms", "bwd ms", "activation", "stash", "params"):
        table.add_column(col, justify="left" if col in ("layer", "kind") else "right")
    for lp in prof.layers:
        table.add_row(
            lp.name,
            lp.kind,
            f"{lp.forward_s * 1e3:.3f}",
            f"{lp.backward_s * 1e3:.3f}",
            format_bytes(lp.activation_bytes),
            format_bytes(lp.saved_bytes),
            format_bytes(lp.param_bytes),
        )
    Console().print(table)
    if args.out:
        print(f"wrote {args.out}")
    return 0


# --------------------------------------------------------------------------- link
def _cmd_link(args: argparse.Namespace) -> int:
    from adaptipe.profile.link import probe_link

    result = probe_link(backend=args.backend, repeats=args.repeats)
    if args.json:
        print(
            json.dumps(
                {
                    "backend": args.backend,
                    "sizes": list(result.sizes),
                    "rtt_s": list(result.rtt_s),
                    "latency_s": result.latency_s,
                    "bandwidth_Bps": result.bandwidth_Bps,
                }
            )
        )
        return 0
    for size, rtt in zip(result.sizes, result.rtt_s, strict=True):
        print(f"  {format_bytes(size):>10}: round trip {rtt * 1e3:.3f} ms (median)")
    print(
        f"{args.backend} link: latency {result.latency_s * 1e6:.0f} us, bandwidth "
        f"{result.bandwidth_Bps / 1e9:.2f} GB/s; simulate with --latency "
        f"{result.latency_s:.6f} --bandwidth {result.bandwidth_Bps / 1e9:.2f}GB/s"
    )
    return 0


# --------------------------------------------------------------------------- plan
def _cmd_plan(args: argparse.Namespace) -> int:
    from adaptipe.plan.api import plan, stage_times
    from adaptipe.plan.pipedream import Level
    from adaptipe.plan.staleness import StalenessModel
    from adaptipe.profile import Profile
    from adaptipe.serial import load_json_file, write_json

    prof = load_json_file(args.profile, Profile.from_json)
    bandwidth: float | list[float]
    bws = [parse_bandwidth(b) for b in args.bandwidth.split(",")]
    bandwidth = bws[0] if len(bws) == 1 else bws
    levels = None
    if args.levels:
        levels = []
        for item in args.levels.split(","):
            workers, sep, bw = item.partition(":")
            if not sep or not workers.isdigit():
                raise PlanError(
                    f"--levels item {item!r} must look like WORKERS:BANDWIDTH (e.g. 4:10GB/s)"
                )
            levels.append(Level(workers=int(workers), bandwidth_Bps=parse_bandwidth(bw)))
    staleness = None
    if args.staleness:
        staleness = StalenessModel(**_parse_overrides(args.staleness))
    partition = plan(
        prof,
        planner=args.planner,
        num_stages=args.stages,
        bandwidth_Bps=bandwidth,
        levels=levels,
        memory_limit_bytes=parse_bytes(args.memory_limit, what="--memory-limit")
        if args.memory_limit
        else None,
        staleness=staleness,
        top_k=args.top_k,
        max_stages=args.max_stages,
    )
    if args.out:
        write_json(args.out, partition.to_json())
    if args.json:
        print(json.dumps(partition.to_json()))
        return 0
    times = stage_times(prof, partition, bandwidth_Bps=bandwidth)
    print(f"{partition.planner} partition of {prof.model} into {partition.num_stages} stage(s):")
    for s in range(partition.num_stages):
        layers = partition.layers(s)
        names = f"{prof.layers[layers[0]].name}..{prof.layers[layers[-1]].name}"
        rep = f" x{partition.replicas[s]}" if partition.replicas[s] > 1 else ""
        print(
            f"  stage {s}: layers {layers.start}-{layers.stop - 1} ({names}){rep}  {times[s] * 1e3:.3f} ms"
        )
    if partition.predicted_s is not None:
        print(f"predicted time per micro-batch: {partition.predicted_s * 1e3:.3f} ms")
    if args.out:
        print(f"wrote {args.out}")
    return 0


# --------------------------------------------------------------------------- simulate
def _cmd_simulate(args: argparse.Namespace) -> int:
    import numpy as np

    from adaptipe.plan import Partition
    from adaptipe.profile import Profile
    from adaptipe.schedule.build import build_schedule
    from adaptipe.serial import load_json_file, write_json
    from adaptipe.sim import CostModel, plot_gantt, simulate, simulate_iterations

    schedule = build_schedule(
        args.schedule,
        stages=args.stages,
        microbatches=args.microbatches,
        chunks=args.virtual,
        recompute=args.recompute,
        vertical_sync=args.vertical_sync,
        update_every=args.update_every,
    )
    slowdown = None
    if args.slowdown:
        slowdown = _floats(args.slowdown, what="--slowdown")
        if len(slowdown) != args.stages or any(f <= 0 for f in slowdown):
            raise PlanError(
                f"--slowdown needs {args.stages} positive factors, one per stage (got {args.slowdown!r})"
            )
    if (args.profile is None) != (args.partition is None):
        raise PlanError(
            "--profile and --partition go together (give both, or neither for uniform costs)"
        )
    if args.profile:
        prof = load_json_file(args.profile, Profile.from_json)
        part = load_json_file(args.partition, Partition.from_json)
        if part.num_stages != schedule.num_virtual_stages:
            raise PlanError(
                f"{args.partition}: has {part.num_stages} stages but the {args.schedule} schedule needs "
                f"{schedule.num_virtual_stages} (stages x virtual = {args.stages} x {args.virtual})"
            )
        costs = CostModel.from_profile(
            prof,
            part,
            bandwidth_Bps=parse_bandwidth(args.bandwidth),
            latency_s=args.latency,
            slowdown=slowdown,
            batch_weight_grads=args.batch_weight_grads,
            microbatches=args.microbatches,
        )
    elif args.batch_weight_grads:
        raise PlanError(
            "--batch-weight-grads needs --profile and --partition (a profile measured with "
            "--wgrad-microbatches)"
        )
    else:
        costs = CostModel.uniform_for(schedule)
        if slowdown is not None:
            costs = costs.with_slowdown(slowdown)
    result = simulate(schedule, costs, record=args.gantt is not None)
    out: dict[str, Any] = result.to_json()
    out.pop("timeline", None)
    out.update(
        schedule=args.schedule,
        stages=args.stages,
        microbatches=args.microbatches,
        virtual=args.virtual,
    )
    if args.iterations > 1:
        many = simulate_iterations(schedule, costs, args.iterations)
        out["iterations"] = args.iterations
        out["mean_iteration_s"] = float(np.mean(many.iteration_s))
    if args.gantt:
        plot_gantt(
            result, args.gantt, title=f"{args.schedule}, S={args.stages}, M={args.microbatches}"
        )
    if args.out:
        write_json(args.out, out)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{args.schedule}: {args.stages} stage(s), {args.microbatches} micro-batches, virtual {args.virtual}"
    )
    print(f"  makespan      {result.makespan:.6g}")
    print(f"  bubble ratio  {result.bubble_ratio:.4f}")
    print(f"  throughput    {result.throughput:.6g} micro-batches per time unit")
    for s in range(args.stages):
        print(
            f"  stage {s}: busy {result.busy_s[s]:.6g}, peak activations "
            f"{format_bytes(result.peak_activation_bytes[s])}, weights {format_bytes(result.peak_weight_bytes[s])}"
        )
    if args.gantt:
        print(f"wrote {args.gantt}")
    return 0


# --------------------------------------------------------------------------- train
def _cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Table

    from adaptipe.runtime import train

    if (args.config is None) == (args.resume is None):
        raise PlanError(
            "give a CONFIG.toml to start a run, or --resume RUN_DIR to continue one (not both)"
        )
    console = Console(stderr=True)
    columns = (
        TextColumn("[bold]train[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} samples/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, disable=args.json or args.no_progress) as bar:
        task = bar.add_task("train", total=None, loss="-", rate="-")

        def on_iteration(rec: dict[str, Any], total: int) -> None:
            loss = "-" if rec["loss"] is None else f"{rec['loss']:.4f}"
            rate = "-" if rec["samples_per_s"] is None else f"{rec['samples_per_s']:.0f}"
            bar.update(task, total=total, completed=rec["iteration"] + 1, loss=loss, rate=rate)

        summary = train(
            args.config if args.config is not None else Path(args.resume),
            run_dir=args.resume if args.resume is not None else args.run_dir,
            resume=args.resume is not None,
            on_iteration=on_iteration,
            inject=args.inject,
            inject_seed=args.inject_seed,
        )
    if args.json:
        print(json.dumps(summary.to_json()))
        return 0
    out = Console()
    done = summary.start_iteration + summary.iterations
    loss = "-" if summary.final_loss is None else f"{summary.final_loss:.4f}"
    if summary.jobs:  # a job-array: the last iteration's mean over the jobs still training
        loss += " (mean over the jobs training at the end; each job's below)"
    out.print(
        f"trained iterations {summary.start_iteration}..{done} in {summary.wall_s:.1f} s: "
        f"final loss {loss}, {summary.samples_per_s:.0f} samples/s (steady state)",
        soft_wrap=not out.is_terminal,  # a log keeps the sentence on one line
    )
    if summary.stages:
        table = Table(title="per-stage time per iteration (mean)")
        states = all("resident_jobs" in st for st in summary.stages)  # a job-array
        cols = ["stage", "compute ms", "waiting ms", "communication ms"]
        for col in cols + (["job states resident (max)", "state wait ms (host)"] if states else []):
            table.add_column(col, justify="right")
        for s, st in enumerate(summary.stages):
            cells = [
                str(s),
                f"{st['compute_s'] * 1e3:.1f}",
                f"{st['wait_s'] * 1e3:.1f}",
                f"{st['comm_s'] * 1e3:.1f}",
            ]
            if states:
                cells += [f"{st['resident_jobs']:.0f}", f"{st['state_wait_s'] * 1e3:.1f}"]
            table.add_row(*cells)
        _print_wide(out, table)
    if summary.jobs:
        plan = Path(summary.run_dir) / "japsp-solution.json"
        if plan.exists():  # how the array was scheduled (as `adaptipe prepare` says)
            solution = json.loads(plan.read_text())
            rounds = solution.get("window", {}).get("rounds", 1)
            quality = (
                "optimal"
                if solution.get("optimal")
                else f"within {100 * float(solution.get('gap') or 0):.1f}% of its lower bound"
            )
            from adaptipe.japsp.window import ROUND_ORDERS

            order = solution.get("window", {}).get("round_order", "given")
            how = (
                "" if order == "given" else f", in the {ROUND_ORDERS.get(order, order)} round order"
            )
            out.print(
                f"job-array: {len(summary.jobs)} jobs, block order by the {solution['solver']} "
                f"solver ({quality}), windows of {rounds} iteration(s) with all jobs{how} "
                "(see japsp-solution.json)",
                soft_wrap=not out.is_terminal,
            )
            after = _replans_said(Path(summary.run_dir), ROUND_ORDERS)
            if after:
                out.print(f"after stops: {after}", soft_wrap=not out.is_terminal)
        _print_ranking(out, summary.jobs)
    out.print(
        f"run directory: {summary.run_dir}"
        + (f"; checkpoint: {summary.checkpoint}" if summary.checkpoint else "")
    )
    return 0


def _replans_said(run_dir: Path, names: dict[str, str]) -> str:
    """The windows a job-array switched to after stops, in one line ("" when none)."""
    from adaptipe.runtime.control import replans
    from adaptipe.runtime.rundir import RunDir

    parts = []
    for row in replans(RunDir(run_dir)):
        jobs = f"{row['jobs']} job" + ("s" if row["jobs"] != 1 else "")
        order = names.get(row["round_order"], row["round_order"])
        parts.append(
            f"from iteration {row['iteration']}, windows of {row['window']} with {jobs} "
            f"({order} round order)"
        )
    return "; ".join(parts)


def _print_ranking(out: Any, jobs: list[dict[str, Any]]) -> None:
    """The sweep's jobs ranked by validation loss, every job name in full."""
    from rich.table import Table

    ranking = Table(title="jobs ranked by validation loss")
    for col in ("rank", "#", "job", "val loss", "train loss", "stopped"):
        left = col in ("job", "stopped")
        # A terminal folds a long name onto more lines rather than cut it.
        ranking.add_column(col, justify="left" if left else "right", overflow="fold")
    for row in jobs:
        train_loss = "-" if row.get("train_loss") is None else f"{row['train_loss']:.4f}"
        ranking.add_row(
            str(row["rank"]),
            str(row["job"]),  # the index `adaptipe stop` takes, like the name
            row["name"],
            f"{row['val_loss']:.4f}",
            train_loss,
            "- (stop came in the last window)"
            if "stop_unadopted" in row
            else _how_stopped(row.get("stopped")),
        )
    _print_wide(out, ranking)


def _print_wide(out: Any, table: Any) -> None:
    """Print ``table``; into a log or a pipe as wide as it takes (one line per row, no
    cell cut at 80 columns), on a terminal folded to its width."""
    from rich.console import Console
    from rich.measure import Measurement

    if not out.is_terminal:
        wide = Measurement.get(out, out.options.update_width(10_000), table).maximum
        out = Console(file=out.file, width=max(out.width, wide))
    out.print(table)


def _how_stopped(stop: dict[str, Any] | None) -> str:
    """How and when a job stopped: ``halving @ 40``, ``by hand @ 40`` (and the reason
    given to ``adaptipe stop --reason``), or ``-`` for a job that trained to the end.

    The iteration is where the stop took effect. Only halving records the rung it was
    ``decided_at``; its reason ("successive halving at iteration 40") says no more.
    """
    if stop is None:
        return "-"
    halving = stop.get("decided_at") is not None
    at = stop.get("iteration")
    at = stop.get("decided_at") if at is None else at
    cell = "halving" if halving else "by hand"
    if at is not None:
        cell += f" @ {at}"
    reason = str(stop.get("reason", "user"))
    if not halving and reason not in ("user", "by hand"):
        cell += f": {reason}"
    return cell


# --------------------------------------------------------------------------- stop
def _cmd_stop(args: argparse.Namespace) -> int:
    from adaptipe.runtime.control import array_jobs, manager_running, stop_jobs
    from adaptipe.runtime.rundir import RunDir

    stopped = stop_jobs(args.run_dir, args.jobs, reason=args.reason)
    run = RunDir(Path(args.run_dir))
    names, _ = array_jobs(run)
    which = ", ".join(f"{names[j]} (#{j})" for j in stopped)
    print(f"asked {args.run_dir} to stop job(s) {which}")
    started = run.metrics.exists() or any((run.root / "stages").glob("stage-*.jsonl"))
    manager = manager_running(run)
    if manager is not False:  # here, or on another host
        print("the manager re-plans the array; the workers switch at the next window boundary")
    elif not started:
        print(
            "note: this run has not started training and no manager acts on the request; "
            "a new `adaptipe train` of the config starts afresh without it (leave the jobs "
            "out of the [sweep] instead)",
            file=sys.stderr,
        )
    else:
        print(
            "note: no `adaptipe train` manages this run now (it stopped before its last "
            "iteration, or its workers run under torchrun); the request applies when "
            f"`adaptipe train --resume {args.run_dir}` continues it",
            file=sys.stderr,
        )
    return 0


# --------------------------------------------------------------------------- trace
def _cmd_trace(args: argparse.Namespace) -> int:
    from adaptipe.runtime.rundir import RunDir
    from adaptipe.runtime.trace import compare, read_trace, summarise

    if args.sim_png and not args.profile:
        raise PlanError("--sim-png needs --profile (the profile to simulate the run with)")
    run = RunDir(args.run_dir)
    events, (first, end) = read_trace(run.trace)
    iterations = end - first
    summary = summarise(events, iterations=iterations)
    if args.png:
        from adaptipe.sim.gantt import plot_timeline

        workers = max(e.worker for e in events) + 1
        plot_timeline(
            events,
            args.png,
            workers=workers,
            title=f"{run.root.name}: iterations {first}-{end - 1} as run (gaps: waiting)",
        )
    found = None
    if args.profile:
        from adaptipe.profile import Profile
        from adaptipe.serial import load_json_file

        found = compare(
            run,
            load_json_file(args.profile, Profile.from_json),
            latency_s=args.latency,
            bandwidth_Bps=parse_bandwidth(args.bandwidth),
        )
        if args.sim_png:
            from adaptipe.sim import plot_gantt

            plot_gantt(found.simulation, args.sim_png, title=f"{run.root.name}: simulated")
    if args.json:
        out: dict[str, Any] = {"iterations": [first, end], "stages": summary}
        if found is not None:
            out["simulated"] = {
                "measured_s": found.measured_s,
                "predicted_s": found.predicted_s,
                "error": found.error,
                "stages": found.simulated,
            }
        print(json.dumps(out))
        return 0
    print(f"{run.root}: iterations {first}-{end - 1}, per iteration:")
    for stage, row in summary.items():
        kinds = ", ".join(
            f"{k} {v['count']} x {v['mean_s'] * 1e3:.2f} ms" for k, v in row["kinds"].items()
        )
        print(
            f"  stage {stage}: busy {row['busy_s'] * 1e3:.1f} ms, idle "
            f"{row['idle_s'] * 1e3:.1f} ms ({kinds})"
        )
        if found is not None:
            sim = found.simulated[stage]
            print(
                f"    simulated: busy {sim['busy_s'] * 1e3:.1f} ms, idle {sim['idle_s'] * 1e3:.1f} ms"
            )
    if found is not None:
        print(
            f"iteration: measured {found.measured_s * 1e3:.1f} ms, simulated "
            f"{found.predicted_s * 1e3:.1f} ms ({found.error:+.1%})"
        )
    for path in (args.png, args.sim_png):
        if path:
            print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------- prepare
def _cmd_prepare(args: argparse.Namespace) -> int:
    from adaptipe.runtime import prepare

    run, config = prepare(args.config, run_dir=args.run_dir)
    partition = run.read_partition()
    # A job-array's block order comes from its JAPSP solver, not [pipeline].schedule.
    schedule = config.pipeline.schedule
    if config.sweep is not None:
        sweep = config.sweep
        length = sweep.rounds(len(config.jobs), config.pipeline.stages)
        schedule = (
            f"{len(config.jobs)} jobs in JAPSP windows of {length} iteration(s)"
            f"{' (auto)' if sweep.window == 'auto' else ''} ([sweep].solver {sweep.solver})"
        )
    print(
        f"wrote the plans of {args.config} to {run.root}: {schedule} over "
        f"{config.pipeline.stages} stage(s), partition bounds {list(partition.bounds)}"
    )
    print(
        f"start one worker per stage with: torchrun ... -m adaptipe.runtime.worker --run-dir {run.root}"
    )
    return 0


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from adaptipe.inject import add_inject_parser
    from adaptipe.inject.collect import add_collect_parser
    from adaptipe.japsp.solve import add_japsp_parser
    from adaptipe.models import MODEL_NAMES
    from adaptipe.monitor.live import add_monitor_parser
    from adaptipe.monitor.report import add_report_parser
    from adaptipe.plan.api import PLANNERS
    from adaptipe.schedule.build import SCHEDULE_NAMES

    parser = argparse.ArgumentParser(
        prog="adaptipe", description="Adaptive pipeline-parallel training for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "profile", help="measure per-layer times and bytes of a zoo model -> Profile JSON"
    )
    p.add_argument("--model", required=True, choices=MODEL_NAMES)
    p.add_argument("--microbatch", type=int, required=True, help="samples per micro-batch")
    p.add_argument("--out", help="write the Profile JSON here")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument(
        "--optimizer", default="sgd", help="sgd, momentum, adam or adamw (optimizer-state bytes)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="model config override"
    )
    p.add_argument(
        "--wgrad-microbatches",
        type=int,
        default=0,
        metavar="M",
        help="also time batched weight gradients for M micro-batches per batch (for "
        "batch_weight_grads runs and simulate --batch-weight-grads)",
    )
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser(
        "link",
        help="measure the link between two pinned stage processes on this host (p2p round trips)",
    )
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--repeats", type=int, default=20, help="round trips per size")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_link)

    p = sub.add_parser("plan", help="partition a profiled model into stages -> Partition JSON")
    p.add_argument("--profile", required=True)
    p.add_argument(
        "--stages", type=int, default=None, help="stage count (dynpipe chooses it when omitted)"
    )
    p.add_argument("--planner", default="dynpipe", choices=PLANNERS)
    p.add_argument(
        "--bandwidth", default="inf", help="link bandwidth, e.g. 10GB/s; comma list = per boundary"
    )
    p.add_argument(
        "--levels", help="pipedream topology, e.g. 4:100GB/s,2:10GB/s (workers:bandwidth per level)"
    )
    p.add_argument("--memory-limit", help="per-device memory, e.g. 16GiB")
    p.add_argument(
        "--max-stages", type=int, default=None, help="dynpipe: largest stage count to consider"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="dynpipe: condense the model to top-k blocks first"
    )
    p.add_argument(
        "--staleness",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="dynpipe Eq. 3 constants: f0, lr, epsilon, smoothness, grad_second_moment",
    )
    p.add_argument("--out", help="write the Partition JSON here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("simulate", help="run a schedule in the discrete-event simulator")
    p.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--virtual", type=int, default=1, help="virtual stages per worker (interleaved)")
    p.add_argument("--recompute", action="store_true", help="activation recomputation")
    p.add_argument(
        "--vertical-sync", action="store_true", help="pipedream: vertical sync of weight versions"
    )
    p.add_argument(
        "--update-every", type=int, default=None, help="2bw: micro-batches per weight update"
    )
    p.add_argument(
        "--profile", help="Profile JSON (with --partition; default: uniform costs F=1, B=2)"
    )
    p.add_argument("--partition", help="Partition JSON with stages x virtual stages")
    p.add_argument(
        "--bandwidth", default="inf", help="link bandwidth, e.g. 10GB/s (with --profile)"
    )
    p.add_argument(
        "--latency", type=float, default=0.0, help="link latency in seconds (with --profile)"
    )
    p.add_argument("--slowdown", help="per-stage compute slowdown factors, e.g. 1,2.5")
    p.add_argument(
        "--batch-weight-grads",
        action="store_true",
        help="Linear weight gradients once per batch at the step ([pipeline] batch_weight_grads)",
    )
    p.add_argument(
        "--iterations", type=int, default=1, help="also simulate this many iterations back to back"
    )
    p.add_argument("--gantt", help="write a Gantt chart PNG here")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("train", help="train a run config over real stage processes")
    p.add_argument("config", nargs="?", help="run config (TOML)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    p.add_argument(
        "--run-dir", help="where plans, metrics and checkpoints go (default: from the config)"
    )
    p.add_argument(
        "--inject", metavar="SCENARIO", help="run an interference scenario (TOML) alongside"
    )
    p.add_argument("--inject-seed", type=int, default=0, help="seed of the scenario's random draws")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=_cmd_train)

    add_inject_parser(sub)
    add_collect_parser(sub)
    add_japsp_parser(sub)
    add_monitor_parser(sub)
    add_report_parser(sub)

    p = sub.add_parser("stop", help="stop jobs of a running job-array (the others keep training)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the running array")
    p.add_argument(
        "jobs",
        nargs="+",
        metavar="JOB",
        help='job names or indices in the sweep (a name wins: a job may be named "3")',
    )
    p.add_argument("--reason", default="user", help="recorded with the stop (default: user)")
    p.set_defaults(func=_cmd_stop)

    p = sub.add_parser(
        "trace",
        help="show a run's traced timeline ([train] trace_iterations): per-stage times, Gantt PNG",
    )
    p.add_argument("run_dir")
    p.add_argument("--png", help="write the timeline as a Gantt chart PNG here")
    p.add_argument("--json", action="store_true", help="print the per-stage summary as JSON")
    p.add_argument(
        "--profile", help="also simulate the run's schedule and partition with this Profile JSON"
    )
    p.add_argument("--bandwidth", default="inf", help="link bandwidth for that (e.g. 2GB/s)")
    p.add_argument("--latency", type=float, default=0.0, help="link latency in seconds for that")
    p.add_argument("--sim-png", help="with --profile: write the simulated Gantt chart here")
    p.set_defaults(func=_cmd_trace)

    p = sub.add_parser(
        "prepare", help="write a run's plans without starting workers (for torchrun)"
    )
    p.add_argument("config", help="run config (TOML)")
    p.add_argument("--run-dir", help="where to write (default: from the config)")
    p.set_defaults(func=_cmd_prepare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except AdaptipeError as exc:
        print(f"adaptipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt as exc:
        from adaptipe.runtime.launch import Terminated

        notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", []))
        if isinstance(exc, Terminated):
            print(f"terminated{notes}", file=sys.stderr)
            return 128 + signal.SIGTERM
        print(f"interrupted{notes}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
