"""A controller live in the manager: the `Decider` that `adaptipe.runtime.adapt_loop`
calls, built from a run's ``[adapt]`` by `decider`.

Each call builds an `Observation` (`observe`) from the telemetry since the last plan
change, under the partition in force, and asks the controller (``[adapt].controller``:
`Threshold` with ``[adapt]``'s margin, patience, cooldown, max_per_hour and horizon; a
baseline; or for ``ppo`` the learned chain, `adaptipe.controllers.chain`) to decide.
The verdict carries what it decided on: the measured iteration time, the best
partition DynPipe's planner predicts on the measured slowdowns, and those slowdowns;
the chain adds what each of its models said (``inputs["chain"]``).

The per-layer baseline is the run's ``profile.json`` when it has one and
``[adapt].baseline`` is ``"profile"`` (the default). A run planned without a profile
(an even or a given partition) has none; profiling the model in the manager would
compete with the workers for the cores, so the loop measures one: it keeps the
partition for the first two windows (the first has the warm-up in it) and takes the
second as the baseline, per layer the median of the measured forward and backward
seconds. Its bytes (a boundary's activations and gradients per micro-batch, parameters
and optimizer state) come from the profile where there is one, else from the layers'
shapes alone, on PyTorch's meta device (no compute). Slowdowns are then relative to how
the run went before. ``baseline = "measured"`` measures it on a profiled run too: a
profile taken alone misjudges layers as a pipeline runs them (on bench_adaptive's CNN
its last two layers ran at 1.2x their profile and the first four at 0.7-0.8x, which the
planner read as a slower last stage), at the price of not seeing a stage that was slow
from the start.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from adaptipe.controllers.base import Controller, Decision, Keep
from adaptipe.controllers.observation import Observation, observe
from adaptipe.controllers.positions import Positions
from adaptipe.controllers.recall import Recall, measured_iteration_s
from adaptipe.controllers.replan import best_partition, predicted_time, stage_slowdowns
from adaptipe.controllers.threshold import Threshold, ThresholdSettings
from adaptipe.controllers.unchanged import Settles, Unchanged
from adaptipe.errors import PlanError
from adaptipe.monitor.schema import Record
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import LayerProfile, Profile
from adaptipe.runtime.adapt_config import AdaptSection
from adaptipe.runtime.adapt_loop import Verdict
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.rundir import RunDir
from adaptipe.serial import load_json_file

__all__ = ["LiveDecider", "blocks_per_iteration", "decider", "from_settings"]

_POSITIONS = "positions"  # the calibration's state beside the controller's


def from_settings(
    adapt: AdaptSection, *, stages: int | None = None, run_root: Path | None = None
) -> Controller:
    """The controller ``[adapt].controller`` names: `Threshold` with ``[adapt]``'s
    settings, a baseline (`adaptipe.controllers.baselines`, default settings) or the
    learned chain (`adaptipe.controllers.chain`: interference forest, candidates, speed
    predictor, PPO switch policy), whose policy must have been trained for ``stages``
    stages. ``run_root``: where ``[adapt].online`` saves the adapted predictor.

    Raises `PlanError` for a controller that cannot run this pipeline."""
    if adapt.controller == "threshold":
        settings = ThresholdSettings(
            margin=adapt.margin,
            patience=adapt.patience,
            cooldown=adapt.cooldown,
            max_per_hour=adapt.max_per_hour,
            horizon=adapt.horizon,
        )
        return Threshold(settings, recall=_recall(adapt))
    if adapt.controller == "ppo":
        return _chain(adapt, stages=stages, run_root=run_root)
    if adapt.controller in ("always_best", "straggler", "stale"):
        from adaptipe.controllers.baselines import BASELINES

        return BASELINES[adapt.controller]()
    return Keep()


def _switch_folder(stages: int | None) -> Path:
    """The shipped switch policy artifact for ``stages`` stages (PlanError naming the
    stage counts shipped otherwise)."""
    from adaptipe.controllers.switch_policy import switch_artifact

    return switch_artifact(stages)


def _chain(adapt: AdaptSection, *, stages: int | None, run_root: Path | None) -> Controller:
    """The learned chain: the switch policy is required; the predictor and the forest
    are used where they load (else the chain falls back and its decisions say so)."""
    import torch

    from adaptipe.controllers.artifacts import describe, shipped
    from adaptipe.controllers.chain import MIN_GAIN, Chain
    from adaptipe.controllers.interference import load_interference
    from adaptipe.controllers.online import ADAPTED_DIR, OnlineSettings, OnlineTuner
    from adaptipe.controllers.predictor import load_predictor
    from adaptipe.controllers.switch_policy import load_switch

    # Tiny networks: a second thread only waits for a core. This sets torch's intra-op
    # threads for the whole manager process (a script calling `train` included).
    torch.set_num_threads(1)
    try:
        folder = _switch_folder(stages)
        policy = load_switch(folder, stages=stages)
    except PlanError as exc:
        raise PlanError(f"[adapt].controller = 'ppo': {exc}") from None
    why, predictor, forest, tuner = [], None, None, None
    try:
        predictor = load_predictor()
    except PlanError as exc:
        why.append(f"predictor: not loaded ({exc}): the simulator ranks")
    try:
        forest = load_interference()
    except PlanError as exc:
        why.append(f"interference: not loaded ({exc}): measured slowdowns only")
    if adapt.online and predictor is not None:
        tuner = OnlineTuner(
            predictor,
            OnlineSettings(budget_s=adapt.online_budget_s),
            out=run_root / ADAPTED_DIR if run_root is not None else None,
            root=run_root,
            source=describe(shipped("predictor")),
        )
    return Chain(
        policy,
        predictor=predictor,
        interference=forest,
        tuner=tuner,
        why=why,
        switch_folder=folder,
        min_gain=max(MIN_GAIN, adapt.margin / (1.0 + adapt.margin)),
        recall=_recall(adapt),
    )


def _recall(adapt: AdaptSection) -> Recall | None:
    return Recall(revisit_checks=adapt.revisit_checks) if adapt.recall else None


class LiveDecider:
    """Observe, then decide (see the module doc); one call at a time."""

    def __init__(
        self,
        controller: Controller,
        profile: Profile | None,
        *,
        window: int,
        workers: int,
        sizes: Sequence[LayerProfile] | None = None,
        microbatches: int = 1,
        blocks_of: Callable[[int], int] | None = None,
        positions: Positions | None = None,
        unchanged: Unchanged | None = None,
    ) -> None:
        self.controller, self.profile = controller, profile
        self.unchanged = unchanged if unchanged is not None else Unchanged(tolerance=0.0)
        self.positions = positions  # each stage's readings over its place's cost
        self.name = controller.name
        self.window, self.workers, self.sizes = window, workers, sizes
        self.microbatches = microbatches
        # a job-array's blocks an iteration under each plan version (its active jobs:
        # successive halving stops some); None: ``microbatches`` always
        self.blocks_of = blocks_of

    def describe(self) -> dict[str, Any]:
        """The controller's name and the shipped artifacts it decides with (model,
        folder, sha256 of the manifest): what the run directory records."""
        from adaptipe.controllers.artifacts import describe

        folders = getattr(self.controller, "artifacts", None)
        found = folders() if callable(folders) else []
        return {"controller": self.name, "artifacts": [describe(f) for f in found]}

    def state_dict(self) -> dict[str, Any]:
        """The controller's state (`Stateful`) and, under ``"positions"``, the
        calibration's; {} for neither."""
        get = getattr(self.controller, "state_dict", None)
        out = dict(get()) if callable(get) else {}
        if self.positions is not None:
            out[_POSITIONS] = self.positions.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        mine = state.pop(_POSITIONS, None)
        if self.positions is not None and isinstance(mine, dict):
            self.positions.load_state_dict(mine)
        load = getattr(self.controller, "load_state_dict", None)
        if callable(load) and state:
            load(state)

    def carry_from(self, previous: object) -> None:
        """Take over ``previous``'s calibration (`adaptipe adapt --controller`): the
        positions are the run's, whichever controller reads them."""
        if isinstance(previous, LiveDecider) and None not in (self.positions, previous.positions):
            self.positions = previous.positions

    def __call__(self, records: Sequence[Record], partition: Partition) -> Verdict:
        if self.blocks_of is not None:
            records = self._same_blocks(records, self.blocks_of)
            if not _complete(records, partition, self.workers):
                why = "measuring after the active jobs changed"
                return Verdict(bounds=None, decision={"bounds": None, "reason": why})
        if self.profile is None:
            seen = _complete(records, partition, self.workers)
            if seen < 2 * self.window:  # the first window has the warm-up in it
                why = f"measuring the baseline: {seen} of {2 * self.window} iterations"
                return Verdict(bounds=None, decision={"bounds": None, "reason": why})
            self.profile = baseline(
                records,
                partition,
                window=self.window,
                workers=self.workers,
                sizes=self.sizes,
                microbatches=self.microbatches,
            )
        obs = observe(
            records,
            self.profile,
            partition,
            window=self.window,
            workers=self.workers,
            microbatches=self.microbatches,
        )
        if self.positions is not None:
            obs = self.positions.apply(obs)
        since = self.unchanged.since(obs)
        if since is not None:  # the readings of the check it settled on: keep
            why = f"unchanged since iteration {since}: kept"
            measured = measured_iteration_s(obs)
            ms = None if measured is None else round(measured * 1e3, 3)
            said = {"measured_ms": ms, "unchanged_since": since}
            return Verdict(bounds=None, decision=Decision(reason=why).to_json(), inputs=said)
        explain = getattr(self.controller, "explain", None)
        if callable(explain):  # the chain: what each model said
            start = time.thread_time()
            times = iteration_seconds(records, self.workers)
            decision, said = explain(obs, times=times)
            said["cpu_ms"] = round((time.thread_time() - start) * 1e3, 3)  # wall: "seconds"
            logged = inputs(obs) | {"chain": said}
        else:
            decision, logged = self.controller.decide(obs), inputs(obs)
            recall = getattr(self.controller, "recall", None)
            if isinstance(recall, Recall):  # what the partitions held here measured (ms)
                slow = stage_slowdowns(obs)
                logged["recalled_ms"] = recall.measured(obs, slow)
                logged["left_ms"] = recall.left_ms(obs, slow)  # the revisit guard's
        settles = isinstance(self.controller, Settles) and self.controller.settled()
        self.unchanged.asked(obs, settled=decision.bounds is None and settles)
        if self.positions is not None and any(f != 1.0 for f in self.positions.factors):
            logged["position_factors"] = [round(f, 3) for f in self.positions.factors]
        return Verdict(bounds=decision.bounds, decision=decision.to_json(), inputs=logged)

    def _same_blocks(
        self, records: Sequence[Record], blocks_of: Callable[[int], int]
    ) -> list[Record]:
        """``records`` less the iterations that ran another number of blocks than the
        newest one (before its jobs were stopped); sets ``microbatches`` to that number."""
        from adaptipe.monitor.schema import StageStats

        versions = [r.plan_version for r in records if isinstance(r, StageStats)]
        if not versions:
            return list(records)
        self.microbatches = blocks = blocks_of(max(versions))
        return [
            r
            for r in records
            if not isinstance(r, StageStats) or blocks_of(r.plan_version) == blocks
        ]


def decider(run: RunDir, cfg: RunConfig) -> LiveDecider:
    """The `DeciderFactory` for ``adaptipe train`` and ``adaptipe manage``."""
    profile = (
        load_json_file(run.profile_json, Profile.from_json) if run.profile_json.exists() else None
    )
    measured = profile is None or cfg.adapt.baseline == "measured"
    # the bytes: the profile's, else from the layers' shapes; the seconds are measured
    sizes = (
        (list(profile.layers) if profile is not None else layer_sizes(cfg)) if measured else None
    )
    return LiveDecider(
        from_settings(cfg.adapt, stages=cfg.pipeline.stages, run_root=run.root),
        None if measured else profile,
        window=cfg.adapt.window,
        workers=cfg.pipeline.stages,
        sizes=sizes,
        microbatches=blocks_per_iteration(cfg, profile),
        blocks_of=_blocks_by_version(run, cfg, profile) if cfg.sweep is not None else None,
        positions=Positions() if cfg.adapt.calibrate else None,
        unchanged=Unchanged(tolerance=cfg.adapt.unchanged, most=cfg.adapt.window),
    )


def blocks_per_iteration(
    cfg: RunConfig, profile: Profile | None, jobs: Sequence[int] | None = None
) -> int:
    """How many micro-batch-sized blocks each layer runs an iteration: what the measured
    per-layer sums are divided by to compare with the profile. ``[data].microbatches``
    for one job; for a job-array the batches (one block each) of ``jobs`` (default:
    every job of the sweep) over the micro-batch the profile timed: 4 jobs of 16
    samples profiled at 16 make 4 (dividing by ``[data].microbatches``, 1 there, read
    every slowdown about 4x; counting stopped jobs reads them lower by their share)."""
    if cfg.sweep is None:
        return cfg.data.microbatches
    block = profile.microbatch if profile is not None else cfg.data.microbatch_size
    picked = cfg.sweep.jobs if jobs is None else [cfg.sweep.jobs[j] for j in jobs]
    samples = sum(job.batch_size for job in picked)
    return max(1, round(samples / max(block, 1)))


def _blocks_by_version(
    run: RunDir, cfg: RunConfig, profile: Profile | None
) -> Callable[[int], int]:
    """Plan version -> `blocks_per_iteration` of its active jobs (versions never change
    once committed, so each is read once)."""
    from adaptipe.runtime.planversion import read_active

    @functools.cache
    def blocks(version: int) -> int:
        try:
            jobs: Sequence[int] | None = read_active(run, version, cfg).jobs
        except (OSError, PlanError, ValueError):  # not readable: every job
            jobs = None
        return blocks_per_iteration(cfg, profile, jobs)

    return blocks


def layer_sizes(cfg: RunConfig) -> list[LayerProfile] | None:
    """Per layer, the bytes a profile would hold (no times): one micro-batch's output
    and input gradient, parameters and optimizer state, from shapes on the meta device.
    None when the model does not run there."""

    from adaptipe.profile.profiler import OPTIMIZER_STATE_FACTOR

    spec = cfg.model.spec()
    name = cfg.optimizer.name
    momentum = getattr(cfg.optimizer, "momentum", 0.0) or 0.0
    factor = OPTIMIZER_STATE_FACTOR["momentum" if name == "sgd" and momentum else name]
    microbatch = max(cfg.data.batch_size // cfg.data.microbatches, 1)
    try:
        x = spec.dataset(split=cfg.data.split).sample_input(microbatch).to("meta")
        out = []
        for i in range(spec.num_layers):
            layer = spec.build_layer(i, seed=0, device="meta")
            y = layer(x)
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            out.append(
                LayerProfile(
                    name=f"layer{i}", kind="measured", forward_s=0.0, backward_s=0.0,
                    activation_bytes=y.numel() * y.element_size(),
                    gradient_bytes=x.numel() * x.element_size() if x.is_floating_point() else 0,
                    saved_bytes=0, param_bytes=params, optimizer_bytes=params * factor,
                    num_params=sum(p.numel() for p in layer.parameters()),
                )
            )  # fmt: skip
            x = y
        return out
    except Exception:  # a layer that needs real data to run: no bytes, as before
        return None


def iteration_seconds(records: Sequence[Record], workers: int) -> dict[int, float]:
    """Per iteration every stage reported in ``records``: the stages' mean
    ``iteration_s`` (the online tuner's label, as `adaptipe.envs.predictor_eval`'s)."""
    from adaptipe.monitor.schema import StageStats

    seen: dict[int, dict[int, float]] = {}
    for rec in records:
        if isinstance(rec, StageStats):
            seen.setdefault(rec.iteration, {})[rec.stage] = float(rec.iteration_s)
    return {it: statistics.fmean(got.values()) for it, got in seen.items() if len(got) >= workers}


def _complete(records: Sequence[Record], partition: Partition, workers: int) -> int:
    """How many iterations every stage has reported in ``records``."""
    from adaptipe.monitor.schema import StageStats

    stages: dict[int, set[int]] = {}
    for rec in records:
        if isinstance(rec, StageStats):
            stages.setdefault(rec.iteration, set()).add(rec.stage)
    return sum(1 for got in stages.values() if len(got) >= workers)


def inputs(obs: Observation) -> dict[str, Any]:
    """What a decision is logged with: the measured iteration, the partition in force
    and the best one as the planner predicts them on the measured slowdowns (milliseconds
    per iteration), the best partition, the per-stage slowdowns and each stage boundary's
    bandwidth as priced (MB/s, the slower direction; null where neither is measured)."""
    slow = stage_slowdowns(obs)
    bounds, best = best_partition(obs, slow)
    best *= obs.microbatches  # cycles per micro-batch: per iteration
    measured = measured_iteration_s(obs)
    current = predicted_time(obs, obs.bounds, slow) * obs.microbatches
    return {
        "measured_ms": round(measured * 1e3, 3) if measured is not None else None,
        "in_force_ms": round(current * 1e3, 3) if math.isfinite(current) else None,
        "predicted_best_ms": round(best * 1e3, 3) if math.isfinite(best) else None,
        "best_bounds": list(bounds),
        "slowdowns": [round(s, 3) for s in slow],
        "links_MBps": [
            round(b / 1e6, 3) if math.isfinite(b) else None for b in obs.boundary_bandwidths()
        ],
        "window": list(obs.iterations[:1] + obs.iterations[-1:]),
    }


def baseline(
    records: Sequence[Record],
    partition: Partition,
    *,
    window: int,
    workers: int,
    sizes: Sequence[LayerProfile] | None = None,
    microbatches: int = 1,
) -> Profile:
    """A profile of measured per-layer seconds per micro-batch (of ``microbatches`` an
    iteration): the median over the last ``window`` complete iterations in ``records``,
    with ``sizes``' bytes (0 without)."""
    zero = LayerProfile(
        name="",
        kind="measured",
        forward_s=0.0,
        backward_s=0.0,
        activation_bytes=0,
        gradient_bytes=0,
        saved_bytes=0,
        param_bytes=0,
        optimizer_bytes=0,
        num_params=0,
    )
    blank = Profile(
        model=partition.model,
        microbatch=1,
        device="measured",
        layers=(zero,) * partition.num_layers,
    )
    obs = observe(
        records, blank, partition, window=window, workers=workers, microbatches=microbatches
    )

    def median(rows: Sequence[Sequence[float]], layer: int) -> float:
        seen = [row[layer] for row in rows if math.isfinite(row[layer])]
        return statistics.median(seen) if seen else 0.0

    bytes_of = list(sizes) if sizes is not None else [zero] * partition.num_layers
    layers = tuple(
        replace(
            bytes_of[i],
            name=f"layer{i}",
            kind="measured",
            forward_s=median(obs.measured_forward_s, i),
            backward_s=median(obs.measured_backward_s, i),
        )
        for i in range(partition.num_layers)
    )
    meta = {"baseline": f"measured, iterations {obs.iterations[0]}-{obs.iterations[-1]}"}
    return Profile(model=partition.model, microbatch=1, device="measured", layers=layers, meta=meta)
