"""A stage worker's executor: one loop over its instruction list.

A stage holds an ordered list of **layer slots** per local chunk (virtual stage), each
with its own module, optimizer and random stream (`adaptipe.runtime.slots`), so layers
can leave one end of a stage with their state (`adaptipe.runtime.stagestate.Stage`).

Weights: synchronous schedules use the live parameters directly (one version, the
step after the flush). Asynchronous schedules (PipeDream weight stashing, vertical
sync, 2BW) compute with *version snapshots*: a micro-batch's forward and backward use
the tensors of the version its instruction names, while the optimizer updates the live
parameters in place; gradients computed on a snapshot are added into the live
parameters' ``.grad`` before the step (dissertation §2.4, §3.2.1).

Batched weight gradients (``batch_weight_grads``, synchronous schedules of one job): a
micro-batch's backward through an ``nn.Linear`` computes only the input gradient; the
weight gradients of all micro-batches are one GEMM each, before the optimizer step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor
from torch.func import functional_call

from adaptipe.profile.wgrad import WeightGradStash, defer_weight_grads
from adaptipe.runtime.binder import Binder
from adaptipe.runtime.iteration_stats import IterationStats
from adaptipe.runtime.jobclip import JobClip
from adaptipe.runtime.memory import MemoryManager
from adaptipe.runtime.program_needs import plan_receives, versions_needed_after
from adaptipe.runtime.recipe import scale_params
from adaptipe.runtime.slots import LayerSlot
from adaptipe.runtime.trace import TraceRecorder
from adaptipe.runtime.transport import ACTIVATION, GRADIENT, TensorSpec, TransferKey, Transport
from adaptipe.runtime.windowcut import RoundGate, WindowRounds, rounds_of
from adaptipe.schedule.types import (
    Backward,
    Forward,
    Instruction,
    OptimizerStep,
    Recompute,
    RecvActivation,
    RecvGradient,
    Schedule,
    SendActivation,
    SendGradient,
)

__all__ = ["IterationStats", "LayerSlot", "MicroBatches", "StageExecutor"]

MicroBatches = Sequence[tuple[Tensor | None, Tensor | None]]
"""One job's ``(input, target)`` per micro-batch; read when a block first needs one."""


@dataclass(slots=True)
class _Stashed:
    inp: Tensor  # the chunk's input (a leaf that requires grad when it is a float tensor)
    out: Tensor | None  # the chunk's output, or the scaled loss on the last virtual stage
    version: int = 0


@dataclass(slots=True)
class _Iteration:
    """What one run of the instruction list holds between its instructions."""

    base: int  # the weight version when the iteration began
    microbatches: Sequence[MicroBatches]
    stats: IterationStats = field(default_factory=IterationStats)
    inputs: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)
    stash: dict[tuple[int, int, int], _Stashed] = field(default_factory=dict)
    grads_out: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)
    received_grads: dict[tuple[int, int, int], Tensor] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    compute: float = 0.0


class StageExecutor:
    """Executes one worker's instruction lists, iteration after iteration.

    Args:
        schedule: the schedule (all workers'; this one runs ``schedule.stages[stage]``).
        stage: this worker's index.
        chunks: per local chunk, its layer slots in model order.
        loss_fn: ``loss(output, target)``, mean over the micro-batch.
        loss_scale: factor applied to each micro-batch loss before backward.
        transport: the point-to-point transport.
        boundary_specs: ``boundary_specs[(job, b)]`` is what crosses boundary ``b``
            (1..G-1) for ``job`` (jobs of an array may differ in batch size).
        binder: per-job layer states of a job-array; ``None`` for one job, whose
            parameters live in the slots' modules.
        batch_weight_grads: compute ``nn.Linear`` weight gradients once per batch at the
            optimizer step instead of once per micro-batch (one job, synchronous
            schedules; job-arrays and asynchronous schedules are rejected).
    """

    def __init__(
        self,
        *,
        schedule: Schedule,
        stage: int,
        chunks: list[list[LayerSlot]],
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        loss_scale: float,
        transport: Transport,
        boundary_specs: dict[tuple[int, int], TensorSpec],
        binder: Binder | None = None,
        memory: MemoryManager | None = None,
        batch_weight_grads: bool = False,
    ) -> None:
        self.schedule = schedule
        self.stage = stage
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.transport = transport
        self.boundary_specs = boundary_specs
        self.binder = binder
        self.memory = memory  # job-arrays with fewer resident states than jobs
        self.batch_weight_grads = batch_weight_grads
        if binder is not None and schedule.weights != "sync":
            raise ValueError(
                f"job-arrays run synchronous schedules (got weights={schedule.weights!r})"
            )
        if batch_weight_grads and (binder is not None or schedule.weights != "sync"):
            raise ValueError(
                "batch_weight_grads needs one job and a synchronous schedule (gpipe, 1f1b, "
                f"interleaved); got weights={schedule.weights!r}"
                f"{' and a job-array' if binder is not None else ''}"
            )
        self._wgrad = WeightGradStash()
        self.chunk_layers = [[slot.index for slot in chunk] for chunk in chunks]
        self.program: tuple[Instruction, ...] = schedule.stages[stage]
        self.num_vstages = schedule.num_virtual_stages
        self.versioned = schedule.weights != "sync"
        self.steps_done = 0  # optimizer steps applied so far (global weight version)
        self._draw_step = 0  # steps_done when the running iteration began (random draws)
        self._snapshots: dict[int, list[list[dict[str, Tensor]]]] = {}
        self._receives = plan_receives(schedule, stage, self.program, boundary_specs)
        self._layer_fwd: dict[int, float] = {}
        self._layer_bwd: dict[int, float] = {}
        # Injected interference: compute takes `slowdown` times as long (1.0 = none).
        self.slowdown = 1.0
        # Called with (step, slots) just before each optimizer step: a streamed migration
        # logs the gradients of the layers on their way out (`adaptipe.runtime.streamed`).
        self.step_tap: Callable[[int, list[LayerSlot]], None] | None = None
        self.job_clip: JobClip | None = None  # a job-array's clipping (`jobclip`)
        # Set by the worker for the iterations it traces ([train] trace_iterations).
        self.trace: TraceRecorder | None = None
        self._versions_after = versions_needed_after(self.program) if self.versioned else []
        self._rounds: tuple[int, list[int]] | None = None  # (per round, round of each pos)

    # ------------------------------------------------------------------ planning
    def _vstage(self, chunk: int) -> int:
        return self.schedule.vstage(self.stage, chunk)

    # ------------------------------------------------------------------ weights
    def _snapshot(self, version: int) -> list[list[dict[str, Tensor]]]:
        snap = self._snapshots.get(version)
        if snap is None:
            if version != self.steps_done:
                raise RuntimeError(
                    f"stage {self.stage}: weight version {version} is needed but was not kept "
                    f"(current version {self.steps_done})"
                )
            snap = [[_leaves(slot.module) for slot in chunk] for chunk in self.chunks]
            self._snapshots[version] = snap
        return snap

    def set_program(self, program: tuple[Instruction, ...]) -> None:
        """Run ``program``, this stage's list reordered (`adaptipe.runtime.inflight`),
        from the next iteration on."""
        self.program = program
        self._receives = plan_receives(self.schedule, self.stage, program, self.boundary_specs)
        self._versions_after = versions_needed_after(self.program) if self.versioned else []
        self._rounds = None

    def set_boundary_specs(self, specs: dict[tuple[int, int], TensorSpec]) -> None:
        """Install the negotiated boundary shapes (after `forward_only` found them)."""
        self.boundary_specs = specs
        self._receives = plan_receives(self.schedule, self.stage, self.program, specs)

    def forward_only(self, job: int, chunk: int, x: Tensor) -> Tensor:
        """Run a chunk for ``job`` with its current weights (shape inference, evaluation)."""
        if self.memory is not None:
            self.memory.ensure_resident(job)
        out = self._run(job, chunk, x, None)
        self._layer_fwd = {}
        return out

    def _run(
        self,
        job: int,
        chunk: int,
        x: Tensor,
        params: list[dict[str, Tensor]] | None,
        microbatch: int = 0,
    ) -> Tensor:
        """Forward through a chunk's layers, timing each (job-arrays through the binder).

        A layer that draws random numbers draws them from its own stream for (step, job,
        micro-batch), so a recomputed forward draws what the first one drew.
        """
        times = self._layer_fwd
        for i, slot in enumerate(self.chunks[chunk]):
            t0 = time.perf_counter()
            if self.binder is not None:
                x = self.binder.run(job, (slot.index,), x)
            else:
                with slot.draws(self._draw_step, job, microbatch, x.device):
                    if params is None:
                        x = slot.module(x)
                    else:
                        x = functional_call(slot.module, params[i], (x,))
            times[slot.index] = times.get(slot.index, 0.0) + time.perf_counter() - t0
        return x

    def _slow(self, elapsed: float) -> float:
        """Stretch a compute step by the injected slowdown; return its total time."""
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * elapsed)
            return elapsed * self.slowdown
        return elapsed

    def _done(
        self, kind: str, job: int, mb: int, chunk: int, t0: float, elapsed: float | None = None
    ) -> float:
        """Close a compute instruction begun at ``t0``: stretch it by the injected
        slowdown, trace it when tracing, and return the compute seconds it counts for."""
        spent = self._slow(time.perf_counter() - t0 if elapsed is None else elapsed)
        if self.trace is not None:
            self.trace.add(kind, job, mb, chunk, t0, time.perf_counter())
        return spent

    def _split_backward(self, layers: Sequence[int], seconds: float) -> None:
        fwd = [self._layer_fwd.get(i, 0.0) for i in layers]
        total = sum(fwd)
        for i, f in zip(layers, fwd, strict=True):
            share = f / total if total > 0 else 1.0 / len(layers)
            self._layer_bwd[i] = self._layer_bwd.get(i, 0.0) + seconds * share

    # ------------------------------------------------------------------ execution
    def run_iteration(
        self,
        iteration: int,
        microbatches: Sequence[MicroBatches],
        gate: RoundGate | None = None,
    ) -> IterationStats:
        """Execute the instruction list once.

        Args:
            iteration: global iteration index (window index for asynchronous schedules).
            microbatches: per job, per micro-batch ``(input, target)``; input is used by
                the worker holding virtual stage 0, target by the one holding the last.
            gate: for a job-array window, asked before each round whether it runs
                (`adaptipe.runtime.windowcut`); ``stats.cut_at`` says where it stopped.
        """
        t_start = time.perf_counter()
        transport = self.transport
        rounds = self._window_rounds(gate)
        # a window's later rounds may be cut: post only round 0's receives to begin with
        hold = rounds.first_posts if rounds is not None else None
        transport.start_iteration(iteration, self._receives, hold=hold)
        if self.memory is not None:
            self.memory.begin_iteration()
        # Asynchronous windows drain completely, so version 0 of this window's
        # instructions is whatever the weights are now.
        it = _Iteration(base=self.steps_done, microbatches=microbatches)
        self._draw_step = it.base
        self._layer_fwd = {}
        self._layer_bwd = {}
        self._wgrad.clear()
        clip = self.job_clip
        if clip is not None:
            clip.plan(self.schedule, at_step=self.memory is not None and self.memory.enabled)
        with self._deferring():
            for pos, ins in enumerate(self.program):
                if rounds is not None and not rounds.runs(pos):
                    if self.memory is not None and isinstance(ins, Forward | Recompute | Backward):
                        self.memory.skip_block(ins.job)
                    continue
                match ins:
                    case RecvActivation(job=j, microbatch=m, chunk=c):
                        key = TransferKey(j, m, self._vstage(c), ACTIVATION)
                        it.inputs[(j, m, c)] = transport.recv(key)
                    case RecvGradient(job=j, microbatch=m, chunk=c):
                        key = TransferKey(j, m, self._vstage(c) + 1, GRADIENT)
                        it.received_grads[(j, m, c)] = transport.recv(key)
                    case SendActivation(job=j, microbatch=m, chunk=c, peer=p):
                        key = TransferKey(j, m, self._vstage(c) + 1, ACTIVATION)
                        transport.send(it.outputs.pop((j, m, c)), p, key)
                    case SendGradient(job=j, microbatch=m, chunk=c, peer=p):
                        key = TransferKey(j, m, self._vstage(c), GRADIENT)
                        transport.send(it.grads_out.pop((j, m, c)), p, key)
                    case Forward():
                        if clip is not None:
                            clip.complete(ins.job)
                        it.compute += self._forward(ins, it)
                    case Recompute():
                        it.compute += self._recompute(ins, it)
                    case Backward():
                        it.compute += self._backward(ins, it)
                    case OptimizerStep():
                        it.compute += self._optimizer_step(ins, pos, it.base)
        if len(self._wgrad):
            raise RuntimeError(
                f"stage {self.stage}: {len(self._wgrad)} deferred weight gradients were never "
                "applied (no OptimizerStep after the last Backward)"
            )
        if clip is not None:
            clip.end_window()
        transport.flush()
        self._snapshots.clear()
        it.stats.cut_at = rounds.cut if rounds is not None else None
        return self._finish(it, t_start)

    def _window_rounds(self, gate: RoundGate | None) -> WindowRounds | None:
        if gate is None:
            return None
        if self._rounds is None or self._rounds[0] != gate.per_round:
            self._rounds = (gate.per_round, rounds_of(self.program, gate.per_round))
        receives = [
            pos
            for pos, ins in enumerate(self.program)
            if isinstance(ins, RecvActivation | RecvGradient)
        ]
        return WindowRounds(self._rounds[1], receives, gate, self.transport)

    def _forward(self, ins: Forward, it: _Iteration) -> float:
        j, m, c = ins.job, ins.microbatch, ins.chunk
        if self.memory is not None:
            self.memory.before_block(j)
        key = (j, m, c)
        g = self._vstage(c)
        last = g == self.num_vstages - 1
        # Reading the data is not the block's compute (a feed may load it now).
        x = it.microbatches[j][m][0] if g == 0 else it.inputs.pop(key)
        target = it.microbatches[j][m][1] if last else None
        assert x is not None, f"stage {self.stage}: no input for micro-batch {m}"
        t0 = time.perf_counter()
        if x.is_floating_point() and g > 0:
            x.requires_grad_(True)
        params = self._snapshot(it.base + ins.version)[c] if self.versioned else None
        recompute = self.schedule.recompute
        with torch.set_grad_enabled(not recompute):
            out = self._run(j, c, x, params, m)
            if last:
                assert target is not None, f"stage {self.stage}: no target for micro-batch {m}"
                loss = self.loss_fn(out, target)
                value = float(loss.detach())
                it.losses[j] = it.losses.get(j, 0.0) + value
                it.stats.microbatch_losses[(j, m)] = value
                out = loss * self.loss_scale
            else:
                it.outputs[key] = out.detach()
        it.stash[key] = _Stashed(
            inp=x, out=None if recompute else out, version=it.base + ins.version
        )
        it.stats.max_in_flight = max(it.stats.max_in_flight, len(it.stash))
        return self._done("forward", j, m, c, t0)

    def _recompute(self, ins: Recompute, it: _Iteration) -> float:
        j, m, c = ins.job, ins.microbatch, ins.chunk
        if self.memory is not None:
            self.memory.before_block(j)
        st = it.stash[(j, m, c)]
        last = self._vstage(c) == self.num_vstages - 1
        target = it.microbatches[j][m][1] if last else None
        t0 = time.perf_counter()
        params = self._snapshot(st.version)[c] if self.versioned else None
        with torch.enable_grad():
            out = self._run(j, c, st.inp, params, m)
            if last:
                assert target is not None
                out = self.loss_fn(out, target) * self.loss_scale
        st.out = out
        return self._done("recompute", j, m, c, t0)

    def _backward(self, ins: Backward, it: _Iteration) -> float:
        j, m, c = ins.job, ins.microbatch, ins.chunk
        if self.memory is not None:
            self.memory.before_block(j)
        t0 = time.perf_counter()
        key = (j, m, c)
        st = it.stash.pop(key)
        assert st.out is not None, (
            f"stage {self.stage}: backward of {key} before its forward/recompute"
        )
        g = self._vstage(c)
        if g == self.num_vstages - 1:
            torch.autograd.backward(st.out)
        else:
            torch.autograd.backward(st.out, it.received_grads.pop(key))
        if g > 0 and st.inp.grad is not None:
            it.grads_out[key] = st.inp.grad
        if self.versioned:
            self._move_grads(c, self._snapshots[st.version][c])
        elapsed = time.perf_counter() - t0
        self._split_backward(self.chunk_layers[c], elapsed)
        return self._done("backward", j, m, c, t0, elapsed)

    def _optimizer_step(self, ins: OptimizerStep, pos: int, base: int) -> float:
        t0 = time.perf_counter()
        if self.binder is not None:
            if self.job_clip is None:
                self._job_step(ins.job, None)
            else:
                release = None if self.memory is None else partial(self.memory.after_step, ins.job)
                apply = partial(self._job_step, ins.job)
                self.job_clip.step(ins.job, self.binder.job_params(ins.job), apply, release)
            return self._done("step", ins.job, -1, -1, t0)
        if self.batch_weight_grads:
            self._flush_weight_grads()
        self._step(pos, base)
        return self._done("step", ins.job, -1, -1, t0)

    def _job_step(self, job: int, coef: float | None) -> None:
        """A job-array's step of ``job``, its gradients scaled by ``coef`` (clipping)."""
        assert self.binder is not None
        if self.memory is not None:
            self.memory.ensure_resident(job)  # a clipped step applied later (`jobclip`)
        if coef is not None:
            scale_params((p for _, ps in self.binder.job_params(job) for p in ps), coef)
        self.binder.step(job)
        if self.memory is not None:
            self.memory.after_step(job)

    def _finish(self, it: _Iteration, t_start: float) -> IterationStats:
        stats = it.stats
        if self.memory is not None:
            stats.resident_jobs, stats.state_wait_s, stats.state_misses = self.memory.take_window()
        elif self.binder is not None:
            stats.resident_jobs = self.binder.num_jobs
        stats.wait_s, stats.comm_s = self.transport.take_times()
        stats.compute_s = it.compute
        stats.losses = losses = it.losses
        # An injected slowdown stretches every compute step (`_slow`): the layers' times
        # with it, as real interference shows in them (what the controllers read).
        slow = max(self.slowdown, 1.0)
        stats.layer_forward_s = {i: t * slow for i, t in self._layer_fwd.items()}
        stats.layer_backward_s = {i: t * slow for i, t in self._layer_bwd.items()}
        # The mean over jobs of each job's mean micro-batch loss (over a window's rounds too).
        counts: dict[int, int] = {}
        for j, _ in stats.microbatch_losses:
            counts[j] = counts.get(j, 0) + 1
        stats.loss = sum(losses[j] / counts[j] for j in losses) / len(losses) if losses else None
        stats.iteration_s = time.perf_counter() - t_start
        return stats

    def _deferring(self) -> contextlib.AbstractContextManager[object]:
        if not self.batch_weight_grads:
            return contextlib.nullcontext()
        return defer_weight_grads((slot.module for slot in self.slots()), self._wgrad)

    def _flush_weight_grads(self) -> None:
        """The batch's Linear weight gradients, charged to the layers' backward time."""
        t0 = time.perf_counter()
        self._wgrad.flush()
        self._split_backward([slot.index for slot in self.slots()], time.perf_counter() - t0)

    def _move_grads(self, chunk: int, params: list[dict[str, Tensor]]) -> None:
        """Add gradients computed on a snapshot into the live parameters' ``.grad``."""
        for slot, snap in zip(self.chunks[chunk], params, strict=True):
            for name, p in slot.module.named_parameters():
                g = snap[name].grad
                if g is None:
                    continue
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)
                snap[name].grad = None

    def _step(self, pos: int, base: int) -> None:
        if self.versioned and (self.steps_done - base) in self._versions_after[pos]:
            self._snapshot(self.steps_done)  # a later micro-batch still computes with it
        if self.step_tap is not None:
            self.step_tap(self.steps_done, list(self.slots()))
        for chunk in self.chunks:
            for slot in chunk:
                if slot.optimizer is not None:
                    slot.optimizer.step()
                    slot.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        if self.versioned:
            keep = {base + v for v in self._versions_after[pos]}
            for version in [v for v in self._snapshots if v not in keep]:
                del self._snapshots[version]

    def slots(self) -> Iterator[LayerSlot]:
        """Every layer slot of this stage, chunk by chunk, in model order."""
        for chunk in self.chunks:
            yield from chunk


def _leaves(module: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
