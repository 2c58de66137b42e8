"""A worker's stage: the layer slots it owns, the state behind them, and its executor.

One job keeps its parameters in the slots' modules (keys ``layers.{i}.*``,
``optim.{i}.*``). A job-array keeps one public structure per layer and per-job states in
a `Binder` (keys ``jobs.{j}.layers.{i}.*``). Keys name global layer indices, so a
checkpoint loads under any partition, and a layer's state can leave one stage and join
another: `Stage.detach` takes slots off either end and returns their whole state
(parameters, optimizer state with its step count) as safetensors bytes that share no
storage with the stage; `Stage.attach` builds the layers on the receiving stage and
loads that state; `Stage.build_executor` rebuilds the executor (instruction list,
receives, boundary shapes, the memory manager's view) for the new partition, in the
same process. Training on is then bitwise what it would have been unmoved: each layer
is built from (seed, layer), steps its own optimizer and draws from its own random
stream (`adaptipe.runtime.slots`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import safetensors.torch
import torch
from torch import Tensor

import adaptipe.runtime.checkpoint as ckpt
from adaptipe.errors import PlanError
from adaptipe.models import ModelSpec
from adaptipe.plan.partition import Partition
from adaptipe.runtime.binder import Binder
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.data import loss_scale as default_loss_scale
from adaptipe.runtime.jobclip import JobClip, job_clip
from adaptipe.runtime.memory import MemoryManager
from adaptipe.runtime.recipe import GlobalClip, global_clip
from adaptipe.runtime.slots import LayerSlot
from adaptipe.runtime.stage import StageExecutor
from adaptipe.runtime.transport import TensorSpec, Transport
from adaptipe.schedule.types import Schedule

__all__ = ["End", "Stage", "build_stage", "pack_payload", "payload_layers", "payload_metadata"]

End = Literal["first", "last"]
_KIND = "adaptipe.layer_slots"


class Stage:
    """One worker's layer slots (per local chunk), the binder behind them for a
    job-array, the optimizer steps done and the executor built from them.

    Build one with `build_stage`.
    """

    def __init__(
        self,
        *,
        spec: ModelSpec,
        config: RunConfig,
        device: torch.device,
        rank: int,
        chunks: list[list[LayerSlot]],
        binder: Binder | None,
    ) -> None:
        self.spec = spec
        self.config = config
        self.device = device
        self.rank = rank
        self.chunks = chunks
        self.binder = binder
        self.memory: MemoryManager | None = None  # set when job states are offloaded
        self.executor: StageExecutor | None = None
        self._resumed_steps = 0  # steps done before this process (a resumed run)
        self._memory_layers: list[int] = []  # the layers the memory manager was built for
        self._step_tap: Callable[[int, list[LayerSlot]], None] | None = None
        self._clip: Callable[[list[LayerSlot]], None] | None = None
        self._job_clip: JobClip | None = None

    # ------------------------------------------------------------------ state
    def layers(self) -> list[int]:
        return [slot.index for chunk in self.chunks for slot in chunk]

    @property
    def steps_done(self) -> int:
        return self.executor.steps_done if self.executor is not None else self._resumed_steps

    def resume_steps(self, steps: int) -> None:
        """Continue from ``steps`` optimizer steps done (a checkpoint's count)."""
        self._resumed_steps = steps
        if self.executor is not None:
            self.executor.steps_done = steps

    def tensors(self, layers: Sequence[int] | None = None) -> dict[str, Tensor]:
        """Every parameter and optimizer state of this stage (or of ``layers``), under
        global keys, as CPU copies."""
        wanted = self.layers() if layers is None else list(layers)
        out: dict[str, Tensor] = {}
        if self.binder is None:
            for slot in self._slots():
                if slot.index in wanted:
                    out.update(ckpt.layer_state(slot.index, slot.module, slot.optimizer))
            return out
        for job in range(self.binder.num_jobs):
            for index in wanted:
                module, opt = self.binder.state(job, index)
                out.update(
                    {f"jobs.{job}.{k}": v for k, v in ckpt.layer_state(index, module, opt).items()}
                )
        return out

    def load(self, tensors: Mapping[str, Tensor], layers: Sequence[int] | None = None) -> None:
        """Restore this stage's layers (or ``layers``) and optimizer states from global keys."""
        wanted = self.layers() if layers is None else list(layers)
        if self.binder is None:
            for slot in self._slots():
                if slot.index in wanted:
                    ckpt.load_layer_state(slot.index, slot.module, slot.optimizer, tensors)
            return
        for job in range(self.binder.num_jobs):
            prefix = f"jobs.{job}."
            mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            for index in wanted:
                module, opt = self.binder.state(job, index)
                ckpt.load_layer_state(index, module, opt, mine)

    # ------------------------------------------------------------------ moving slots
    def detach(self, *, end: End, count: int = 1) -> bytes:
        """Take ``count`` layers off ``end`` of this stage; return their whole state.

        The bytes are a safetensors file (global keys; metadata names the layers), so
        they share no storage with this stage and can cross a process or a host.
        """
        chunk = self._only_chunk("detach")
        if not 0 < count < len(chunk):
            raise PlanError(
                f"stage {self.rank}: cannot detach {count} of its {len(chunk)} layers "
                "(a stage keeps at least one layer)"
            )
        cut = slice(0, count) if end == "first" else slice(len(chunk) - count, len(chunk))
        indices = [slot.index for slot in chunk[cut]]
        payload = self.pack(indices)
        del chunk[cut]
        if self.binder is not None:
            self.binder.remove_layers(indices)
        return payload

    def attach(self, payload: bytes, *, end: End) -> list[int]:
        """Add the layers of a `detach` payload at ``end`` of this stage; return them."""
        indices, num_jobs = payload_layers(payload)
        if num_jobs != self._num_jobs():
            raise PlanError(
                f"stage {self.rank}: the payload holds {num_jobs or 1} job(s)' state, "
                f"this stage trains {self._num_jobs() or 1}"
            )
        self.attach_tensors(safetensors.torch.load(payload), indices, end=end)
        return indices

    def attach_tensors(
        self, tensors: Mapping[str, Tensor], layers: Sequence[int], *, end: End
    ) -> None:
        """Build ``layers`` at ``end`` of this stage and load their state from ``tensors``
        (global keys, as `tensors` or a checkpoint holds them)."""
        chunk = self._only_chunk("attach")
        indices = list(layers)
        here = [slot.index for slot in chunk]
        joins = indices[-1] + 1 == here[0] if end == "first" else here[-1] + 1 == indices[0]
        if indices != list(range(indices[0], indices[0] + len(indices))) or not joins:
            raise PlanError(
                f"stage {self.rank}: layers {indices} do not join its {end} end "
                f"(it holds {here[0]}..{here[-1]})"
            )
        self._settle_memory()
        at = 0 if end == "first" else len(chunk)
        chunk[at:at] = self._build_slots(indices)
        self.load(tensors, indices)

    def pack(self, layers: Sequence[int]) -> bytes:
        """The whole state of ``layers`` (held here) as a `detach` payload; the stage
        keeps them (a migration drops them only once every stage agreed)."""
        indices = list(layers)
        missing = sorted(set(indices) - set(self.layers()))
        if missing:
            raise PlanError(f"stage {self.rank}: does not hold layers {missing}")
        self._settle_memory()
        return pack_payload(self.tensors(indices), indices, self._num_jobs())

    def reshape(
        self,
        layer_lists: Sequence[Sequence[int]],
        tensors: Mapping[str, Tensor],
        *,
        built: Mapping[int, LayerSlot] | None = None,
    ) -> None:
        """Hold ``layer_lists`` (per local chunk, in model order) from now on: layers kept
        keep their slots (also from another local chunk), layers not held before are
        taken from ``built`` (slots already holding their state, `spare_slots`) or built
        and loaded from ``tensors`` (global keys), the others are dropped."""
        if len(layer_lists) != len(self.chunks):
            raise PlanError(
                f"stage {self.rank}: {len(layer_lists)} chunks given, it runs {len(self.chunks)}"
            )
        self._settle_memory()
        slots = {slot.index: slot for slot in self._slots()}
        wanted = [i for layers in layer_lists for i in layers]
        gained = [i for i in wanted if i not in slots]
        lost = [i for i in slots if i not in set(wanted)]
        if self.binder is not None:
            self.binder.remove_layers(lost)
        ready = dict(built or {})
        if ready and self.binder is not None:
            raise PlanError(f"stage {self.rank}: a job-array stage builds its own slots")
        to_build = [i for i in gained if i not in ready]
        slots.update(ready)
        slots.update(zip(to_build, self._build_slots(to_build), strict=True))
        self.chunks[:] = [[slots[i] for i in layers] for layers in layer_lists]
        self.load(tensors, to_build)

    def spare_slots(self, layers: Sequence[int], tensors: Mapping[str, Tensor]) -> list[LayerSlot]:
        """Slots for ``layers`` loaded from ``tensors`` (global keys) that this stage does
        not hold (yet): a streamed migration's copy of layers on their way here, which it
        keeps up to date and `reshape` takes over at the switch. One-job stages only."""
        if self.binder is not None:
            raise PlanError(f"stage {self.rank}: a job-array stage builds its own slots")
        slots = self._build_slots(layers)
        for slot in slots:
            ckpt.load_layer_state(slot.index, slot.module, slot.optimizer, tensors)
        return slots

    def check(self, layer_lists: Sequence[Sequence[int]]) -> None:
        """Raise `RuntimeError` unless this stage holds exactly ``layer_lists`` (per chunk,
        in order, each a contiguous range) and every parameter is in exactly one
        optimizer (its layer's; per job in a job-array). Run after every move."""
        held = [[slot.index for slot in chunk] for chunk in self.chunks]
        wanted = [list(layers) for layers in layer_lists]
        where = f"stage {self.rank}"
        if held != wanted:
            raise RuntimeError(f"{where}: holds layers {held}, the partition says {wanted}")
        for layers in held:
            if layers != list(range(layers[0], layers[0] + len(layers))):
                raise RuntimeError(f"{where}: layers {layers} are not a contiguous range")
        if self.binder is not None and self.binder.layers != sorted(self.layers()):
            raise RuntimeError(f"{where}: binds {self.binder.layers}, holds {held}")
        for label, params, optimizer in self._optimized():
            owned = [
                id(p) for g in (optimizer.param_groups if optimizer else []) for p in g["params"]
            ]
            mine = [id(p) for p in params]
            if sorted(owned) != sorted(mine) or len(set(owned)) != len(owned):
                raise RuntimeError(f"{where}: {label}: its parameters and its optimizer's differ")

    def _optimized(self) -> list[tuple[str, list[Tensor], torch.optim.Optimizer | None]]:
        """(what, parameters, optimizer) for every layer (and job) of this stage."""
        if self.binder is None:
            return [
                (f"layer {slot.index}", list(slot.module.parameters()), slot.optimizer)
                for slot in self._slots()
            ]
        return [
            (f"job {job} layer {i}", list(state.params.values()), state.optimizer)
            for job, per_layer in enumerate(self.binder.states)
            for i, state in per_layer.items()
        ]

    # ------------------------------------------------------------------ executor
    def build_executor(
        self,
        *,
        schedule: Schedule,
        transport: Transport,
        boundary_specs: dict[tuple[int, int], TensorSpec],
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        loss_scale: float | None = None,
    ) -> StageExecutor:
        """An executor for ``schedule`` over this stage's slots as they are now.

        The steps done, injected slowdown and memory manager carry over from the
        previous executor (after the layers changed, `refresh_memory` first).
        """
        if self.memory is not None and self._memory_layers != self.layers():
            raise RuntimeError(
                f"stage {self.rank}: the layers changed; refresh_memory() before building "
                "an executor"
            )
        executor = StageExecutor(
            schedule=schedule,
            stage=self.rank,
            chunks=self.chunks,
            loss_fn=loss_fn if loss_fn is not None else self.spec.loss,
            loss_scale=loss_scale if loss_scale is not None else default_loss_scale(schedule),
            transport=transport,
            boundary_specs=boundary_specs,
            binder=self.binder,
            memory=self.memory,
            batch_weight_grads=self.config.pipeline.batch_weight_grads,
        )
        self.switch_to(executor)
        return executor

    def switch_to(self, executor: StageExecutor) -> None:
        """Run ``executor`` from now on (one built by `build_executor` for these slots);
        the steps done and the injected slowdown carry over."""
        previous = self.executor
        if previous is None:
            executor.steps_done = self._resumed_steps
        elif previous is not executor:
            executor.steps_done = previous.steps_done
            executor.slowdown = previous.slowdown
        executor.step_tap = self._tap()
        executor.job_clip = self._job_clip
        self.executor = executor

    def tap_steps(self, tap: Callable[[int, list[LayerSlot]], None] | None) -> None:
        """Call ``tap(step, slots)`` just before every optimizer step from now on (None:
        stop), whichever executor runs (a streamed migration logs gradients with it)."""
        self._step_tap = tap
        if self.executor is not None:
            self.executor.step_tap = self._tap()

    def clip_gradients(self, clip: Callable[[list[LayerSlot]], None] | None) -> None:
        """Call ``clip(slots)`` before every optimizer step, ahead of the step tap (so a
        streamed migration logs the clipped gradients its copies replay)."""
        self._clip = clip
        if self.executor is not None:
            self.executor.step_tap = self._tap()

    def install_clipping(
        self, wrap: Callable[[GlobalClip | None], Callable[[list[LayerSlot]], None] | None]
    ) -> None:
        """What ``clip_grad_norm`` asks for: one job's `global_clip` (inside ``wrap``,
        which adds a replicated stage's gradient all-reduce), or a job-array's
        `job_clip`; every stage calls it once, in the same order as its other groups."""
        n = self.spec.num_layers
        if self.binder is None:
            self.clip_gradients(wrap(global_clip(self.config.optimizer.clip_grad_norm, n)))
        else:
            self.clip_jobs(
                job_clip({j.index: j.optimizer.clip_grad_norm for j in self.config.jobs}, n)
            )

    def clip_jobs(self, clip: JobClip | None) -> None:
        """Clip a job-array's jobs by their global norms (`adaptipe.runtime.jobclip`)
        in every executor from now on."""
        self._job_clip = clip
        if self.executor is not None:
            self.executor.job_clip = clip

    def _tap(self) -> Callable[[int, list[LayerSlot]], None] | None:
        clip, tap = self._clip, self._step_tap
        if clip is None:
            return tap

        def clipped(step: int, slots: list[LayerSlot]) -> None:
            clip(slots)
            if tap is not None:
                tap(step, slots)

        return clipped

    def use_memory(self, memory: MemoryManager | None) -> None:
        """Adopt the memory manager that keeps this stage's job states."""
        self.memory = memory
        self._memory_layers = self.layers()

    def refresh_memory(self, order: Sequence[tuple[int, int]]) -> None:
        """After the layers changed: a memory manager over the layers held now, starting
        on ``order`` (one that fits its budget), with the old one's counters."""
        old = self.memory
        if old is None or self._memory_layers == self.layers():
            return
        old.close()
        assert self.binder is not None
        new = MemoryManager(self.binder, budget=old.budget, device=self.device, order=order)
        new.carry_counters(old)
        self.use_memory(new)

    # ------------------------------------------------------------------ helpers
    def _slots(self) -> list[LayerSlot]:
        return [slot for chunk in self.chunks for slot in chunk]

    def _num_jobs(self) -> int:
        return self.binder.num_jobs if self.binder is not None else 0

    def _only_chunk(self, what: str) -> list[LayerSlot]:
        if len(self.chunks) != 1:
            raise PlanError(
                f"stage {self.rank}: cannot {what} layers of a stage with {len(self.chunks)} "
                "chunks (interleaved schedules); layers move between one-chunk stages"
            )
        return self.chunks[0]

    def _settle_memory(self) -> None:
        if self.memory is not None:
            self.memory.synchronize()  # no copy in flight while slots change

    def _build_slots(self, indices: Sequence[int]) -> list[LayerSlot]:
        """Fresh slots for ``indices`` (a job-array binds every job's state of them), as
        training alone would build them; their state is loaded after."""
        seed = self.config.train.seed
        if self.binder is not None:
            self.binder.add_layers(indices)
            _buffers_to(self.binder, indices, self.device)
            return [LayerSlot.build(i, self.binder.structures[i], None, seed=seed) for i in indices]
        slots = []
        for i in indices:
            module = self.spec.build_layer(i, seed=seed, device=self.device)
            params = list(module.parameters())
            optimizer = self.config.optimizer.build(params) if params else None
            slots.append(LayerSlot.build(i, module, optimizer, seed=seed))
        return slots


def _buffers_to(binder: Binder, layers: Sequence[int], device: torch.device) -> None:
    """Put the structures' constant buffers (a causal mask) where blocks run (job states
    may start in host memory; the memory manager moves those)."""
    for i in layers:
        for module in binder.structures[i].modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf.device != device:
                    setattr(module, name, buf.to(device))


def pack_payload(tensors: dict[str, Tensor], layers: Sequence[int], num_jobs: int) -> bytes:
    """The payload `Stage.pack` makes of ``tensors`` (global keys) of ``layers``."""
    return safetensors.torch.save(tensors, metadata=payload_metadata(layers, num_jobs))


def payload_metadata(layers: Sequence[int], num_jobs: int) -> dict[str, str]:
    """The safetensors metadata that names a payload's ``layers`` (`payload_layers`)."""
    return {"adaptipe": json.dumps({"kind": _KIND, "layers": list(layers), "jobs": num_jobs})}


def payload_layers(payload: bytes) -> tuple[list[int], int]:
    """The layers a `Stage.detach` payload holds and its job count (0: one job)."""
    try:
        (size,) = struct.unpack("<Q", payload[:8])
        header = json.loads(payload[8 : 8 + size])
        meta: Any = json.loads(header["__metadata__"]["adaptipe"])
        if meta.get("kind") != _KIND:
            raise ValueError(f"kind {meta.get('kind')!r}")
        layers = [int(i) for i in meta["layers"]]
        jobs = int(meta["jobs"])
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise PlanError(f"not a layer-slot payload ({exc})") from None
    if not layers:
        raise PlanError("layer-slot payload names no layer")
    return layers, jobs


def build_stage(
    spec: ModelSpec,
    partition: Partition,
    schedule: Schedule,
    rank: int,
    config: RunConfig,
    device: torch.device,
) -> Stage:
    """Build this worker's layers as training each job alone would build them."""
    layer_lists = [
        list(partition.layers(schedule.vstage(rank, c))) for c in range(schedule.num_chunks)
    ]
    seed = config.train.seed
    if config.sweep is None:
        chunks: list[list[LayerSlot]] = []
        for layers in layer_lists:
            slots = []
            for i in layers:
                module = spec.build_layer(i, seed=seed, device=device)
                params = list(module.parameters())
                optimizer = config.optimizer.build(params) if params else None
                slots.append(LayerSlot.build(i, module, optimizer, seed=seed))
            chunks.append(slots)
        return Stage(spec=spec, config=config, device=device, rank=rank, chunks=chunks, binder=None)
    # With a memory budget below the job count the job states start in host memory (the
    # memory manager brings the first ones to the device): all of them on the device at
    # once is what the budget is there to avoid. Layers are initialised on the CPU either
    # way, so where they are built changes no value.
    budget = config.sweep.memory_budget
    host_first = device.type != "cpu" and 0 < budget < len(config.jobs)

    binder = Binder(
        layers=[i for layers in layer_lists for i in layers],
        jobs=config.jobs,
        build_layer=lambda i, job_seed: spec.build_layer(
            i, seed=job_seed, device="cpu" if host_first else device
        ),
        make_optimizer=lambda job, params: job.optimizer.build(params),
    )
    _buffers_to(binder, binder.layers, device)
    chunks = [
        [LayerSlot.build(i, binder.structures[i], None, seed=seed) for i in layers]
        for layers in layer_lists
    ]
    return Stage(spec=spec, config=config, device=device, rank=rank, chunks=chunks, binder=binder)
