"""ArrayPipe's memory manager: at most ``budget`` job states resident per stage.

A stage of a job-array holds every job's parameters and optimizer state for its layers
(`Binder`). When they do not all fit, the manager keeps ``budget`` of them on the device
and the rest in host memory, and moves them along the stage's block order: before a
block it makes sure the block's job is resident, then prefetches the jobs that come next
in the order, offloading the resident job whose next use is farthest (Belady). Copies
run on two CUDA streams of their own, one for offloads and one for loads (pinned host
memory, events), or, on CPU, on one background thread, so a prefetch overlaps the
blocks before it; it is on time when a
job's state moves faster than the shortest block (Eq. (2): sum of m / b_intra <= min r).

A job whose first block on this stage ran and whose last has not (its forward ran, its
backward has not) is *in flight*: its activations reference its parameters, so it stays
resident, as does a job between its last block and its optimizer step. Moving a job
moves each parameter's ``.data``, gradient and optimizer state tensor, keeping the
``Parameter`` objects, so optimizer state keys and the structures stay valid.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from adaptipe.runtime.binder import Binder
from adaptipe.runtime.movers import CpuMover, CudaMover, Pending, StateKey
from adaptipe.runtime.recipe import STEP_KEY
from adaptipe.schedule.types import Backward, Forward, Instruction, Recompute

__all__ = ["MemoryManager", "block_order", "minimum_budget"]

LogEvent = Literal["prefetch", "load", "evict"]
LOG_LIMIT = 100_000
"""Events `MemoryManager.log` keeps (it drops the older half when full)."""
_Key = StateKey


BlockKey = tuple[int, int]
"""A block's ``(job, micro-batch)``: its forward, recompute and backward share it."""

Order = Sequence[int] | Sequence[BlockKey]
"""A stage's blocks in order, as jobs (one block group per job) or as `BlockKey` s."""


def block_order(program: Sequence[Instruction]) -> list[BlockKey]:
    """The ``(job, micro-batch)`` of a stage program's compute blocks (forward,
    recompute, backward), in order."""
    return [
        (ins.job, ins.microbatch)
        for ins in program
        if isinstance(ins, Forward | Recompute | Backward)
    ]


def _keys(order: Order) -> list[BlockKey]:
    return [(b, 0) if isinstance(b, int) else (int(b[0]), int(b[1])) for b in order]


def _spans(keys: Sequence[BlockKey]) -> dict[BlockKey, tuple[int, int]]:
    """First and last position of each block group (a job's micro-batch)."""
    spans: dict[BlockKey, tuple[int, int]] = {}
    for pos, key in enumerate(keys):
        spans[key] = (spans[key][0] if key in spans else pos, pos)
    return spans


def _needed(order: Order) -> list[set[int]]:
    """Per block: the jobs that must be resident while it runs (it and those in flight)."""
    keys = _keys(order)
    spans = _spans(keys)
    return [
        {j for (j, _), (first, last) in spans.items() if first < pos <= last} | {job}
        for pos, (job, _) in enumerate(keys)
    ]


def minimum_budget(order: Order) -> int:
    """The smallest budget that can run ``order``: the most jobs resident at one block."""
    return max((len(s) for s in _needed(order)), default=0)


class MemoryManager:
    """Keeps at most ``budget`` of a stage's job states on ``device``, the rest on ``host``.

    Args:
        binder: the stage's per-job layer states.
        budget: job states resident at once; ``<= 0`` or ``>= J`` keeps all of them.
        device: where blocks run.
        host: where offloaded states live (pinned when ``device`` is CUDA).
        order: this stage's blocks in one iteration, in the order they run
            (`block_order` of the stage program: ``(job, micro-batch)`` pairs; plain job
            ids mean one block group per job); iterations repeat it. A job is in flight
            from a group's first block to its last (forward to backward).
        prefetch: ``False`` loads each state only when its block needs it (an ablation).

    Call `before_block` before every block, `after_step` after each job's optimizer step.
    """

    def __init__(
        self,
        binder: Binder,
        *,
        budget: int,
        device: torch.device,
        host: torch.device | None = None,
        order: Order,
        prefetch: bool = True,
    ) -> None:
        self.binder = binder
        self.device = torch.device(device)
        self.host = torch.device("cpu") if host is None else torch.device(host)
        if self.host.type != "cpu":
            raise ValueError(f"host must be a CPU device (got {self.host})")
        self.order = [job for job, _ in _keys(order)]
        num_jobs = binder.num_jobs
        for pos, job in enumerate(self.order):
            if not 0 <= job < num_jobs:
                raise ValueError(
                    f"order[{pos}] = {job} is not a job of this stage (0..{num_jobs - 1})"
                )
        self.budget = budget
        self.prefetch = prefetch
        self.enabled = 0 < budget < num_jobs and bool(self.order)
        self.log: list[tuple[LogEvent, int]] = []  # the latest events (tests, diagnostics)
        self.hits = self.misses = self.prefetches = self.evictions = 0
        self.wait_s = 0.0  # time before_block spent waiting for copies
        self._taken = (0.0, 0)  # wait_s and misses at the last take_window()
        self.resident: set[int] = set(range(num_jobs))
        self.peak_resident = num_jobs
        self._window_peak = num_jobs  # the most resident since the last take_window()
        if not self.enabled:
            return
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device} is not available (no CUDA in this torch)")
        self._set_order(order)
        self._awaiting_step: set[int] = set()
        self._loading: dict[int, Pending] = {}
        self._host_buffers: dict[int, dict[_Key, Tensor]] = {j: {} for j in range(num_jobs)}
        self._offloaded: dict[int, Any] = {}  # job -> its offload (a CUDA event or a future)
        self._mover: CpuMover | CudaMover = (
            CudaMover(self.device) if self.device.type == "cuda" else CpuMover(self.device)
        )
        keep = list(dict.fromkeys(self.order))[:budget]
        self.resident = set()
        for job in range(num_jobs):
            if job in keep:
                self._install(job, {k: t.to(self.device) for k, t in self._tensors(job).items()})
                self.resident.add(job)
            else:
                self._offload(job)
        self._mover.synchronize()
        self.peak_resident = self._window_peak = len(self.resident)

    # ------------------------------------------------------------------ public
    def carry_counters(self, old: MemoryManager) -> None:
        """Count on from ``old``'s hits, misses, copies and waits (one run's totals
        across a rebuild after the layers changed)."""
        self.hits += old.hits
        self.misses += old.misses
        self.prefetches += old.prefetches
        self.evictions += old.evictions
        self.wait_s += old.wait_s
        self.peak_resident = max(self.peak_resident, old.peak_resident)
        self._taken = (
            self.wait_s - (old.wait_s - old._taken[0]),
            self.misses - (old.misses - old._taken[1]),
        )

    @property
    def loading(self) -> set[int]:
        """Jobs whose prefetch is issued and not yet waited for (they count as resident)."""
        return set(self._loading) if self.enabled else set()

    def before_block(self, job: int) -> None:
        """Make ``job`` resident for the next block of the order, then prefetch ahead."""
        if not self.enabled:
            return
        pos = self._next_block(job, "runs")
        self._awaiting_step.discard(job)
        t0 = time.perf_counter()
        if job in self.resident:
            self.hits += 1
        elif job in self._loading:
            self._finish_loading(job)
            self.hits += 1
        else:
            self._load_now(job, pos, pinned=self._needed[pos] | self._awaiting_step)
            self.misses += 1
        self.wait_s += time.perf_counter() - t0
        self._clock += 1
        if pos in self._closes:
            self._awaiting_step.add(job)  # its gradients wait for the just-in-time step
        self._prefetch(pos, pinned=self._open_after[pos] | self._awaiting_step | {job})

    def skip_block(self, job: int) -> None:
        """The next block of the order (``job``'s) does not run: a window was cut short.
        The order goes on past it; the next window reorders anyway."""
        if not self.enabled:
            return
        self._next_block(job, "skips")
        self._clock += 1

    def _next_block(self, job: int, does: str) -> int:
        """The position of the order's next block, which must be ``job``'s."""
        pos = self._clock % self._n
        if self.order[pos] != job:
            raise RuntimeError(
                f"block {pos} of this stage's order is job {self.order[pos]}, but the executor "
                f"{does} job {job} (build the order with block_order(program))"
            )
        return pos

    def after_step(self, job: int) -> None:
        """``job``'s optimizer step on this stage is done: it may now be offloaded."""
        if not self.enabled or job not in self._awaiting_step:
            return
        self._awaiting_step.discard(job)
        pos = (self._clock - 1) % self._n
        self._prefetch(pos, pinned=self._open_after[pos] | self._awaiting_step)

    def ensure_resident(self, job: int) -> None:
        """Load ``job`` outside the block order (shape probing, evaluation); a miss if absent."""
        if not self.enabled or job in self.resident:
            return
        if job in self._loading:
            self._finish_loading(job)
            return
        ran = (self._clock - 1) % self._n  # the last block begun (next uses count from it)
        self._load_now(job, ran, pinned=self._open_after[ran] | self._awaiting_step | {job})
        self.misses += 1

    def take_window(self) -> tuple[int, float, int]:
        """Since the last call: the most job states resident at once (loads in flight
        count), the seconds blocks waited for states, and the misses (states loaded only
        when their block needed them). Resets the peak to what is resident now.

        On CUDA the wait is the host's: a block queued behind a copy that is still
        running waits on the GPU, which this does not see."""
        wait, misses = self.wait_s - self._taken[0], self.misses - self._taken[1]
        self._taken = (self.wait_s, self.misses)
        peak = self._window_peak
        self._window_peak = self._occupancy() if self.enabled else self.binder.num_jobs
        return peak, wait, misses

    def begin_iteration(self) -> None:
        """Return to the first block of the order (a no-op after a complete iteration)."""
        if self.enabled and self._clock % self._n:
            self._clock += self._n - self._clock % self._n
            self._awaiting_step.clear()

    def synchronize(self) -> None:
        """Wait for every copy, e.g. before reading offloaded states for a checkpoint."""
        if self.enabled:
            for job in list(self._loading):
                self._finish_loading(job)
            self._mover.synchronize()

    def close(self) -> None:
        """Finish every copy and stop the copy worker; states stay where they are."""
        if self.enabled:
            self.synchronize()
            self._mover.close()

    def reorder(self, order: Order) -> None:
        """Adopt a new block order at an iteration boundary (jobs of the array stopped).

        Jobs absent from the new order are offloaded to host memory, freeing their
        device memory for the others; their states stay readable (checkpoints).
        """
        jobs = [job for job, _ in _keys(order)]
        num_jobs = self.binder.num_jobs
        for pos, job in enumerate(jobs):
            if not 0 <= job < num_jobs:
                raise ValueError(
                    f"order[{pos}] = {job} is not a job of this stage (0..{num_jobs - 1})"
                )
        if not self.enabled:
            self.order = jobs
            return
        if not jobs:
            raise ValueError("reorder: the new block order is empty")
        self.synchronize()
        self._set_order(order)
        self._awaiting_step.clear()
        for job in sorted(self.resident - set(jobs)):
            self._evict(job)
        self._mover.synchronize()
        # the new order's first blocks: fetch them now, as if its last block had just run
        self._prefetch(self._n - 1, pinned=set(self._open_after[self._n - 1]))

    def set_budget(self, budget: int) -> int:
        """Keep at most ``budget`` job states resident from now on (an iteration
        boundary), offloading the farthest-used ones at once: the memory guard tightens
        the budget of a stage near its memory limit (`adaptipe.runtime.memory_guard`).

        Clamped to the least the block order runs with and below the job count; a
        manager that keeps every state resident (not enabled) is left as it is. Returns
        the budget in force.
        """
        if not self.enabled:
            return self.budget
        least = max(len(s) for s in self._needed)
        budget = max(least, min(budget, self.binder.num_jobs - 1))
        if budget == self.budget:
            return budget
        self.synchronize()
        self.budget = budget
        last = self._n - 1  # a boundary: as if the order's last block had just run
        while self._occupancy() > budget:
            self._evict(max(self.resident, key=lambda v: self._next_use(v, last)))
        self._mover.synchronize()
        self._prefetch(last, pinned=set(self._open_after[last]))
        return budget

    def _set_order(self, order: Order) -> None:
        keys = _keys(order)
        needed = _needed(keys)
        least = max(len(s) for s in needed)
        if self.budget < least:
            pos = max(range(len(needed)), key=lambda p: len(needed[p]))
            raise ValueError(
                f"memory budget {self.budget} is below the minimum {least} for this stage's "
                f"block order: at block {pos} (job {keys[pos][0]}) jobs {sorted(needed[pos])} "
                f"must be resident (a job whose forward ran and whose backward has not keeps "
                f"activations that reference its parameters); allowed: 0 (keep all) or "
                f"{least}..{self.binder.num_jobs}"
            )
        self.order = [job for job, _ in keys]
        self._n = len(keys)
        self._positions: dict[int, list[int]] = {}
        for pos, job in enumerate(self.order):
            self._positions.setdefault(job, []).append(pos)
        spans = _spans(keys)
        # After block p runs, until the next block: jobs inside one of their block groups.
        self._open_after = [
            {j for (j, _), (first, last) in spans.items() if first <= p < last}
            for p in range(self._n)
        ]
        self._needed = needed
        self._closes = {last for _, last in spans.values()}  # a group's last block
        self._clock = 0  # blocks begun since the order was set

    # ------------------------------------------------------------------ policy
    def _next_use(self, job: int, pos: int) -> int:
        """Blocks from ``pos`` to ``job``'s next block after it (cyclic; never: a huge number)."""
        places = self._positions.get(job)
        if not places:
            return 1 << 30
        i = bisect.bisect_right(places, pos)
        return places[i] - pos if i < len(places) else places[0] + self._n - pos

    def _occupancy(self) -> int:
        return len(self.resident) + len(self._loading)

    def _prefetch(self, pos: int, *, pinned: set[int]) -> None:
        """Belady after block ``pos``: fetch upcoming jobs while a farther one can make room."""
        if not self.prefetch:
            return
        upcoming: list[int] = []
        for d in range(1, self._n + 1):
            j = self.order[(pos + d) % self._n]
            if j not in upcoming:
                upcoming.append(j)
        for job in upcoming:
            if job in self.resident or job in self._loading:
                continue
            if self._occupancy() >= self.budget:
                need = self._next_use(job, pos)
                victims = [v for v in self.resident - pinned if self._next_use(v, pos) > need]
                if not victims:
                    break  # every resident job is needed before this one
                self._evict(max(victims, key=lambda v: self._next_use(v, pos)))
            self._loading[job] = self._mover.load(
                self._take_host(job), after=self._offloaded.pop(job, None)
            )
            self.prefetches += 1
            self._record("prefetch", job)

    def _load_now(self, job: int, pos: int, *, pinned: set[int]) -> None:
        """Load ``job`` synchronously at block ``pos``, evicting the farthest unpinned job."""
        if self._occupancy() >= self.budget:
            victims = (self.resident | set(self._loading)) - pinned
            if not victims:
                raise RuntimeError(
                    f"memory budget {self.budget}: no room for job {job}, jobs {sorted(pinned)} "
                    f"must stay resident (call after_step(j) right after job j's optimizer step)"
                )
            victim = max(victims, key=lambda v: self._next_use(v, pos))
            if victim in self._loading:
                self._finish_loading(victim)
            self._evict(victim)
        self._install(
            job, self._mover.load(self._take_host(job), after=self._offloaded.pop(job, None)).wait()
        )
        self.resident.add(job)
        self._record("load", job)

    def _finish_loading(self, job: int) -> None:
        pending = self._loading.pop(job)
        self._install(job, pending.wait())
        self.resident.add(job)

    def _evict(self, job: int) -> None:
        self.resident.discard(job)
        self._offload(job)
        self.evictions += 1
        self._record("evict", job)

    def _record(self, event: LogEvent, job: int) -> None:
        if len(self.log) >= LOG_LIMIT:  # a long run: keep the newer half
            del self.log[: LOG_LIMIT // 2]
        self.log.append((event, job))
        occupancy = self._occupancy()
        self.peak_resident = max(self.peak_resident, occupancy)
        self._window_peak = max(self._window_peak, occupancy)

    # ------------------------------------------------------------------ tensors
    def _tensors(self, job: int) -> dict[_Key, Tensor]:
        """Every tensor of ``job``'s state on this stage: parameters, gradients, optimizer."""
        out: dict[_Key, Tensor] = {}
        for index, st in self.binder.states[job].items():
            opt = st.optimizer
            moves_step = opt is not None and any(
                bool(g.get("capturable")) or bool(g.get("fused")) for g in opt.param_groups
            )
            for name, p in st.params.items():
                out[("param", index, name, "")] = p.data
                if p.grad is not None:
                    out[("grad", index, name, "")] = p.grad
                if opt is None:
                    continue
                for key, value in opt.state.get(p, {}).items():
                    # A non-capturable optimizer keeps its step count on the CPU, and a
                    # schedule keeps its own there always (`recipe.STEP_KEY`).
                    if (
                        isinstance(value, Tensor)
                        and key != STEP_KEY
                        and (key != "step" or moves_step)
                    ):
                        out[("state", index, name, str(key))] = value
        return out

    def _install(self, job: int, tensors: dict[_Key, Tensor]) -> None:
        for index, st in self.binder.states[job].items():
            state = st.optimizer.state if st.optimizer is not None else None
            for name, p in st.params.items():
                p.grad = None  # the new data may sit on another device than the old gradient
                p.data = tensors[("param", index, name, "")]
                p.grad = tensors.get(("grad", index, name, ""))
                if state is None or p not in state:
                    continue
                for key in state[p]:
                    t = tensors.get(("state", index, name, str(key)))
                    if t is not None:
                        state[p][key] = t

    def _offload(self, job: int) -> None:
        """Copy ``job``'s state into its host buffers (asynchronously) and point at them."""
        src = self._tensors(job)
        buffers = self._host_buffers[job]
        for k, t in src.items():
            buf = buffers.get(k)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buffers[k] = self._mover.host_buffer(t)
        self._offloaded[job] = self._mover.offload(src, buffers)
        self._install(job, {k: buffers[k] for k in src})

    def _take_host(self, job: int) -> dict[_Key, Tensor]:
        # What the job's state points at now: its host buffers, unless a checkpoint
        # restore or the optimizer replaced state tensors since it was offloaded.
        return self._tensors(job)
