"""ArrayPipe's memory manager: never more than ``budget`` job states resident, prefetches
in schedule order, and training through offloads ends bitwise where keeping every state
resident ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from adaptipe.errors import PlanError
from adaptipe.models import get_model
from adaptipe.runtime.binder import Binder
from adaptipe.runtime.config import OptimizerSection, RunConfig
from adaptipe.runtime.launch import prepare
from adaptipe.runtime.memory import MemoryManager, block_order, minimum_budget
from adaptipe.runtime.stagestate import build_stage
from adaptipe.runtime.sweep import JobSpec
from adaptipe.schedule.types import Backward, Forward, Instruction, OptimizerStep

CPU = torch.device("cpu")
# Stage 0 of a two-stage 1F1B over six jobs, one block per job: F0 F1 B0 F2 B1 F3 ... B5.
ONE_F_ONE_B = [0, 1, 0, 2, 1, 3, 2, 4, 3, 5, 4, 5]


def _binder(
    num_jobs: int = 6, width: int = 4, device: torch.device = CPU, optimizer: str = "sgd"
) -> Binder:
    def build_layer(index: int, seed: int) -> nn.Module:
        torch.manual_seed(seed * 100 + index)
        return nn.Linear(width, width).to(device)

    jobs = [
        JobSpec(
            index=j,
            name=f"job{j}",
            optimizer=OptimizerSection(name=optimizer, lr=0.1 + 0.01 * j, momentum=0.9),
            batch_size=4,
            seed=j,
            data_seed=j,
        )
        for j in range(num_jobs)
    ]
    return Binder(
        layers=[0, 1],
        jobs=jobs,
        build_layer=build_layer,
        make_optimizer=lambda job, params: job.optimizer.build(params),
    )


@dataclass
class _Trace:
    """What a simulated stage saw: residency after every call, evictions that hit pins."""

    occupancy: list[int] = field(default_factory=list)
    bad_evictions: list[tuple[int, int]] = field(default_factory=list)
    blocks: int = 0
    # (length of the manager's log, position in the order) at every call: the log
    # entries from there on were made at that block
    calls: list[tuple[int, int]] = field(default_factory=list)


def _check(mm: MemoryManager, trace: _Trace, since: int, pinned: set[int]) -> None:
    trace.occupancy.append(len(mm.resident | mm.loading))
    for event, job in mm.log[since:]:
        if event == "evict" and job in pinned:
            trace.bad_evictions.append((len(trace.occupancy), job))


def _simulate(
    binder: Binder,
    mm: MemoryManager,
    order: list[int],
    *,
    iterations: int,
    compute: bool = True,
    sleep_s: float = 0.0,
) -> _Trace:
    """Run a stage's blocks: a job's first block is its forward, its last its backward and
    just-in-time step (both in one block when it has one), as the executor would."""
    first = {j: order.index(j) for j in set(order)}
    last = {j: len(order) - 1 - order[::-1].index(j) for j in set(order)}
    trace = _Trace()
    for it in range(iterations):
        losses: dict[int, Tensor] = {}
        in_flight: set[int] = set()
        for pos, job in enumerate(order):
            since = len(mm.log)
            trace.calls.append((since, pos))
            mm.before_block(job)
            trace.blocks += 1
            assert job in mm.resident, f"job {job} not resident for block {pos}"
            assert in_flight <= mm.resident, f"in-flight {in_flight} not all resident"
            _check(mm, trace, since, in_flight | {job})
            if pos == first[job]:
                in_flight.add(job)
                if compute:
                    gen = torch.Generator().manual_seed(1000 * it + job)
                    x, y = torch.randn(4, 4, generator=gen), torch.randn(4, 4, generator=gen)
                    device = binder.states[job][0].params["weight"].device
                    out = binder.run(job, [0, 1], x.to(device))
                    y = y.to(device)
                    losses[job] = nn.functional.mse_loss(out, y)
            if pos == last[job]:
                in_flight.discard(job)
                if compute:
                    torch.autograd.backward(losses.pop(job))
                    binder.step(job)
                since = len(mm.log)
                trace.calls.append((since, pos))
                mm.after_step(job)
                _check(mm, trace, since, in_flight)
            if sleep_s:
                time.sleep(sleep_s)
    mm.synchronize()
    return trace


def _state(binder: Binder, job: int) -> list[Tensor]:
    out: list[Tensor] = []
    for st_ in binder.states[job].values():
        assert st_.optimizer is not None
        for p in st_.params.values():
            out.append(p.detach().clone())
            for value in st_.optimizer.state.get(p, {}).values():
                out.append(value.clone())  # momentum, Adam's moments and step count
    return out


def _train(
    budget: int,
    *,
    iterations: int = 3,
    device: torch.device = CPU,
    optimizer: str = "sgd",
    sleep_s: float = 0.0,
) -> tuple[Binder, MemoryManager]:
    binder = _binder(device=device, optimizer=optimizer)
    mm = MemoryManager(binder, budget=budget, device=device, order=ONE_F_ONE_B)
    _simulate(binder, mm, ONE_F_ONE_B, iterations=iterations, sleep_s=sleep_s)
    return binder, mm


def _replayed_peak(mm: MemoryManager, start: set[int]) -> int:
    resident, peak = set(start), len(start)
    for event, job in mm.log:
        if event == "evict":
            resident.discard(job)
        else:
            resident.add(job)
        peak = max(peak, len(resident))
    return peak


def _is_subsequence(seq: list[int], of: list[int]) -> bool:
    it = iter(of)
    return all(any(x == y for y in it) for x in seq)


def _skipped_sooner(
    mm: MemoryManager, trace: _Trace, order: list[int], start: set[int]
) -> list[tuple[int, int, int]]:
    """Prefetches that passed over an absent job needed sooner (Belady in schedule order:
    when job j is prefetched after block p, every job whose next block after p comes
    before j's is resident or loading). Replays the log; returns the violations."""
    n = len(order)

    def next_use(job: int, pos: int) -> int:
        return next(d for d in range(1, n + 1) if order[(pos + d) % n] == job)

    present, bad = set(start), list[tuple[int, int, int]]()
    marks = iter([*trace.calls[1:], (len(mm.log), -1)])
    pos, (upto, upcoming) = trace.calls[0][1], next(marks)
    for i, (event, job) in enumerate(mm.log):
        while i >= upto:
            pos, (upto, upcoming) = upcoming, next(marks)
        if event == "prefetch":
            need = next_use(job, pos)
            bad += [(i, job, k) for k in set(order) - present if next_use(k, pos) < need]
        if event == "evict":
            present.discard(job)
        else:
            present.add(job)
    return bad


def _one_job() -> JobSpec:
    return JobSpec(
        index=0,
        name="a",
        optimizer=OptimizerSection(name="sgd", lr=0.1),
        batch_size=4,
        seed=0,
        data_seed=0,
    )


def _bind_one(make: Callable[[], nn.Module]) -> Binder:
    """A one-job binder of layer 3, built by ``make``."""
    return Binder(
        layers=[3],
        jobs=[_one_job()],
        build_layer=lambda index, seed: make(),
        make_optimizer=lambda job, params: job.optimizer.build(params),
    )


def test_a_layer_with_buffers_is_refused_by_the_binder() -> None:
    # Blocks would share job 0's batch-norm statistics: the jobs would not train as alone.
    with pytest.raises(PlanError, match=r"layer 3 \(BatchNorm1d\) has buffers \(running_mean"):
        _bind_one(lambda: nn.BatchNorm1d(4))

    class Masked(nn.Linear):  # a constant buffer, left out of checkpoints, may be shared
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.register_buffer("mask", torch.ones(4), persistent=False)

    assert set(_bind_one(Masked).states[0][3].params) == {"weight", "bias"}


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), r"1 \(Dropout p=0.1\)"),
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.RReLU()), r"1 \(RReLU\)"),
        (lambda: nn.MultiheadAttention(4, 2, dropout=0.2), "MultiheadAttention dropout=0.2"),
    ],
)
def test_a_layer_that_draws_random_numbers_is_refused_by_the_binder(
    make: Callable[[], nn.Module], named: str
) -> None:
    # The jobs' blocks interleave on one random stream: each would draw other masks.
    with pytest.raises(PlanError, match=f"layer 3 .*draws random numbers in training .*{named}"):
        _bind_one(make)
    quiet = _bind_one(lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)))  # draws nothing
    assert set(quiet.states[0][3].params) == {"0.weight", "0.bias"}


def test_tied_weights_are_parameters_not_buffers() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x))

    assert "a.weight" in _bind_one(Tied).states[0][3].params


def test_a_failed_offload_copy_is_raised_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    # On CPU the copies run on a thread: a failure there must not leave a job to load
    # from host buffers that were never written.
    import adaptipe.runtime.movers as movers

    real, calls = movers.copy_all, []

    def failing(pairs: list[tuple[Tensor, Tensor]]) -> None:
        calls.append(len(pairs))
        if len(calls) == 1:  # the first job offloaded at the start (not the last one)
            raise RuntimeError("host memory exhausted")
        real(pairs)

    monkeypatch.setattr(movers, "copy_all", failing)
    with pytest.raises(RuntimeError, match="host memory exhausted"):
        MemoryManager(_binder(), budget=2, device=CPU, order=ONE_F_ONE_B)
    binder = _binder()
    mm = MemoryManager(binder, budget=2, device=CPU, order=ONE_F_ONE_B)
    calls.clear()
    with pytest.raises(RuntimeError, match="host memory exhausted"):
        _simulate(binder, mm, ONE_F_ONE_B, iterations=1)
    mm.close()


def test_a_new_order_prefetches_its_first_blocks() -> None:
    binder = _binder()
    mm = MemoryManager(binder, budget=2, device=CPU, order=ONE_F_ONE_B)
    _simulate(binder, mm, ONE_F_ONE_B, iterations=1)
    later = [3, 4, 3, 5, 4, 5]  # jobs 0-2 stopped: 3 and 4 come first, neither resident
    assert not {3, 4} & mm.resident
    mm.reorder(later)
    assert {3, 4} <= mm.resident | mm.loading  # on their way before the first block
    _simulate(binder, mm, later, iterations=1)
    assert mm.misses == 0
    mm.close()


def test_job_states_start_in_host_memory_when_the_budget_is_below_the_jobs(
    make_config: Callable[..., RunConfig],
) -> None:
    # On an accelerator (here the meta device stands in), all J states on the device
    # at once is what the budget avoids: they are built in host memory.
    cfg = make_config(data={"microbatches": 1}, train={"iterations": 2})
    data = cfg.to_dict()
    data["sweep"] = {"grid": {"lr": [0.05, 0.1, 0.2]}, "solver": "1f1b", "memory_budget": 2}
    cfg = RunConfig.from_dict(data, source="test.toml")
    run, cfg = prepare(cfg)
    spec = get_model(cfg.model.name, **cfg.model.config)
    partition, schedule = run.read_partition(), run.read_schedule()
    meta = torch.device("meta")
    state = build_stage(spec, partition, schedule, 0, cfg, meta)
    assert state.binder is not None
    devices = {
        p.device.type
        for job in state.binder.states
        for st_ in job.values()
        for p in st_.params.values()
    }
    assert devices == {"cpu"}
    data["sweep"]["memory_budget"] = 0  # every state resident: built on the device
    everything = RunConfig.from_dict(data, source="test.toml")
    state = build_stage(spec, partition, schedule, 0, everything, meta)
    assert state.binder is not None
    assert {
        p.device.type
        for p in state.binder.states[2][next(iter(state.binder.states[2]))].params.values()
    } == {"meta"}


def test_minimum_budget_counts_jobs_in_flight() -> None:
    assert minimum_budget(ONE_F_ONE_B) == 2
    assert minimum_budget([0, 1, 2, 0, 1, 2]) == 3  # GPipe: every forward before any backward
    assert minimum_budget([0, 1, 2]) == 1  # one block per job: nothing stays in flight
    program: list[Instruction] = [
        Forward(0, 0),
        Forward(1, 0),
        Backward(0, 0),
        OptimizerStep(0),
        Backward(1, 0),
    ]
    assert block_order(program) == [(0, 0), (1, 0), (0, 0), (1, 0)]
    assert minimum_budget(block_order(program)) == 2


def test_a_window_counts_each_round_of_a_job_as_its_own_flight() -> None:
    # Job 0's round 1 starts after its round 0 ended: one job in flight at a time, so a
    # window of two rounds needs no more room than one round (not one span 0..3).
    window = [(0, 0), (0, 0), (1, 0), (0, 1), (1, 0), (0, 1)]
    assert minimum_budget(window) == 2
    assert minimum_budget([0, 0, 1, 0, 1, 0]) == 2  # plain job ids: one span per job
    assert minimum_budget([(0, 0), (1, 0), (0, 1), (0, 0), (1, 0), (0, 1)]) == 2


@pytest.mark.parametrize(("optimizer", "states"), [("sgd", 1), ("adam", 3)])
@pytest.mark.parametrize("budget", [2, 3, 4])
def test_training_through_offloads_ends_bitwise_as_with_everything_resident(
    budget: int, optimizer: str, states: int
) -> None:
    reference, everything = _train(6, optimizer=optimizer)
    assert everything.log == [] and everything.resident == set(range(6))
    binder, mm = _train(budget, optimizer=optimizer)
    assert mm.evictions > 0 and mm.prefetches > 0
    for job in range(6):
        got, want = _state(binder, job), _state(reference, job)
        assert len(got) == len(want) == 4 * (1 + states)  # 2 layers x (weight, bias)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), job
    mm.close()


@pytest.mark.parametrize("budget", [2, 3, 5])
def test_residency_never_exceeds_the_budget_and_pins_hold(budget: int) -> None:
    binder = _binder()
    mm = MemoryManager(binder, budget=budget, device=CPU, order=ONE_F_ONE_B)
    start = set(mm.resident)
    trace = _simulate(binder, mm, ONE_F_ONE_B, iterations=2)
    assert max(trace.occupancy) <= budget
    assert mm.peak_resident == budget
    assert _replayed_peak(mm, start) <= budget
    assert trace.bad_evictions == []
    mm.close()


def test_prefetches_follow_the_schedule_order_and_never_miss() -> None:
    binder = _binder()
    mm = MemoryManager(binder, budget=2, device=CPU, order=ONE_F_ONE_B)
    trace = _simulate(binder, mm, ONE_F_ONE_B, iterations=3, sleep_s=0.002)
    fetched = [job for event, job in mm.log if event == "prefetch"]
    assert _is_subsequence(fetched, ONE_F_ONE_B * 4)
    # Jobs 2-5 within each iteration; jobs 0 and 1 (resident at the start) at the end of
    # each iteration, for the next one.
    assert fetched == [2, 3, 4, 5, 0, 1] * 3 and mm.prefetches == 18
    assert mm.misses == 0 and mm.hits == trace.blocks
    assert not any(event == "load" for event, _ in mm.log)
    mm.close()


def test_loading_on_demand_counts_a_miss_per_absent_job() -> None:
    order = [0, 1, 2, 3, 4, 5]
    binder = _binder()
    mm = MemoryManager(binder, budget=2, device=CPU, order=order, prefetch=False)
    _simulate(binder, mm, order, iterations=2)
    # Jobs 0 and 1 start resident; Belady then keeps the job needed soonest after the
    # next one (job 0 through iteration 1, job 5 through iteration 2): 4 hits, 8 misses.
    assert (mm.hits, mm.misses, mm.prefetches) == (4, 8, 0)
    assert [event for event, _ in mm.log if event != "evict"] == ["load"] * mm.misses
    mm.close()
    reference, _ = _train(6)
    prefetched, _ = _train(2)
    assert all(
        torch.equal(a, b)
        for j in range(6)
        for a, b in zip(_state(prefetched, j), _state(reference, j), strict=True)
    )


def test_take_window_reports_each_window_once() -> None:
    order = [0, 1, 2, 3, 4, 5]
    binder = _binder()
    mm = MemoryManager(binder, budget=2, device=CPU, order=order, prefetch=False)
    _simulate(binder, mm, order, iterations=1)
    peak, wait, misses = mm.take_window()
    assert peak == 2 and misses == 4 and wait > 0  # jobs 2-5 loaded when needed
    _simulate(binder, mm, order, iterations=1)
    assert mm.take_window()[2] == 4 and mm.misses == 8  # only the second window's
    assert mm.take_window() == (2, 0.0, 0)  # nothing ran since
    mm.close()
    resident = MemoryManager(_binder(), budget=0, device=CPU, order=order)
    assert resident.take_window() == (6, 0.0, 0)  # no budget: every state stays
    resident.close()


def test_offload_moves_into_separate_tensors_and_keeps_the_parameters() -> None:
    binder = _binder()
    params = {j: list(binder.states[j][0].params.values()) for j in range(6)}
    mm = MemoryManager(binder, budget=2, device=CPU, order=ONE_F_ONE_B)
    _simulate(binder, mm, ONE_F_ONE_B, iterations=1)
    away = next(j for j in range(6) if j not in mm.resident)
    weight = binder.states[away][0].params["weight"]
    assert weight is params[away][0]  # the same Parameter object: optimizer keys hold
    opt = binder.states[away][0].optimizer
    assert opt is not None and weight in opt.state
    before = _state(binder, away)
    host_ptr = weight.data_ptr()
    mm.ensure_resident(away)
    assert mm.misses == 1 and mm.log[-1] == ("load", away)
    assert weight.data_ptr() != host_ptr  # a real copy, not a pointer swap
    assert opt.state[weight]["momentum_buffer"].abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(_state(binder, away), before, strict=True))
    assert len(mm.resident | mm.loading) <= 2
    mm.close()


def test_a_restored_optimizer_state_of_an_offloaded_job_is_what_loads() -> None:
    binder = _binder()
    mm = MemoryManager(binder, budget=2, device=CPU, order=ONE_F_ONE_B)
    _simulate(binder, mm, ONE_F_ONE_B, iterations=1)
    away = next(j for j in range(6) if j not in mm.resident)
    opt = binder.states[away][0].optimizer
    assert opt is not None
    saved = opt.state_dict()
    for state in saved["state"].values():
        state["momentum_buffer"] = torch.full_like(state["momentum_buffer"], 7.0)
    opt.load_state_dict(saved)  # as a checkpoint restore does: new state tensors
    mm.ensure_resident(away)
    weight = binder.states[away][0].params["weight"]
    assert torch.equal(opt.state[weight]["momentum_buffer"], torch.full((4, 4), 7.0))
    mm.close()


@pytest.mark.parametrize("budget", [0, 6, 9])
def test_a_budget_of_zero_or_at_least_all_jobs_keeps_everything(budget: int) -> None:
    binder = _binder()
    ptrs = [p.data_ptr() for s in binder.states for p in s[0].params.values()]
    mm = MemoryManager(binder, budget=budget, device=CPU, order=ONE_F_ONE_B)
    _simulate(binder, mm, ONE_F_ONE_B, iterations=1, compute=False)
    assert mm.resident == set(range(6)) and mm.log == [] and mm.hits == 0
    assert ptrs == [p.data_ptr() for s in binder.states for p in s[0].params.values()]


def test_a_budget_below_the_jobs_in_flight_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"budget 1 is below the minimum 2 .* allowed: 0 .* 2\.\.6"
    ):
        MemoryManager(_binder(), budget=1, device=CPU, order=ONE_F_ONE_B)
    with pytest.raises(ValueError, match=r"order\[1\] = 7 is not a job of this stage \(0\.\.5\)"):
        MemoryManager(_binder(), budget=2, device=CPU, order=[0, 7])


def test_a_block_out_of_order_is_an_error_and_begin_iteration_recovers() -> None:
    binder = _binder()
    mm = MemoryManager(binder, budget=3, device=CPU, order=ONE_F_ONE_B)
    mm.before_block(0)
    with pytest.raises(RuntimeError, match="block 1 of this stage's order is job 1"):
        mm.before_block(2)
    mm.begin_iteration()  # an aborted iteration: start over
    mm.before_block(0)
    assert mm.hits == 2
    mm.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offloads_to_pinned_memory_and_ends_bitwise_as_resident() -> None:
    cuda = torch.device("cuda")
    reference, _ = _train(6, device=cuda)
    binder, mm = _train(2, device=cuda)
    away = next(j for j in range(6) if j not in mm.resident)
    weight = binder.states[away][0].params["weight"]
    assert weight.device.type == "cpu" and weight.is_pinned()
    assert mm.misses == 0 and mm.peak_resident == 2
    for job in range(6):
        got = [t.cpu() for t in _state(binder, job)]
        want = [t.cpu() for t in _state(reference, job)]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), job
    mm.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
def test_a_cuda_device_without_cuda_is_refused() -> None:
    with pytest.raises(ValueError, match="device cuda is not available"):
        MemoryManager(_binder(), budget=2, device=torch.device("cuda"), order=ONE_F_ONE_B)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    num_jobs=st.integers(min_value=2, max_value=6),
    prefetch=st.booleans(),
)
def test_residency_invariant_holds_for_any_order_and_budget(
    data: st.DataObject, num_jobs: int, prefetch: bool
) -> None:
    blocks = [j for j in range(num_jobs) for _ in range(data.draw(st.integers(1, 3)))]
    order = data.draw(st.permutations(blocks))
    least = minimum_budget(order)
    budget = data.draw(st.integers(min_value=least, max_value=max(least, num_jobs - 1)))
    binder = _binder(num_jobs, width=2)
    before = [_state(binder, j) for j in range(num_jobs)]
    mm = MemoryManager(binder, budget=budget, device=CPU, order=order, prefetch=prefetch)
    start = set(mm.resident)
    trace = _simulate(binder, mm, order, iterations=2, compute=False)
    if budget < num_jobs:
        assert max(trace.occupancy) <= budget and mm.peak_resident <= budget
        assert _replayed_peak(mm, start) <= budget
        assert trace.bad_evictions == []
        fetched = [job for event, job in mm.log if event == "prefetch"]
        assert _is_subsequence(fetched, order * 3)
        assert _skipped_sooner(mm, trace, order, start) == []
    for j in range(num_jobs):  # states travel and come back unchanged
        assert all(torch.equal(a, b) for a, b in zip(_state(binder, j), before[j], strict=True))
    mm.close()
