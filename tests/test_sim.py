"""The discrete-event simulator on tiny hand-built schedules with hand-computed timelines."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptipe.errors import PlanError, ScheduleError
from adaptipe.plan.partition import Partition
from adaptipe.profile.types import Profile
from adaptipe.schedule.build import build_schedule
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
from adaptipe.sim import CostModel, SimResult, plot_gantt, simulate, simulate_iterations
from adaptipe.sim.result import Event


def _sched(
    *stages: list[Instruction], jobs: int = 1, chunks: int = 1, mbs: int = 2, **kw: object
) -> Schedule:
    return Schedule(
        name="hand",
        num_stages=len(stages),
        num_microbatches=mbs,
        num_jobs=jobs,
        num_chunks=chunks,
        stages=tuple(tuple(s) for s in stages),
        **kw,  # type: ignore[arg-type]
    )


def _boxes(result: SimResult, where: str = "worker") -> list[tuple[int, str, int, float, float]]:
    return [
        (e.worker, e.kind, e.microbatch, e.start, e.end)
        for e in result.timeline
        if e.where == where
    ]


# Two workers, two forwards each: worker 0 sends both activations over one link.
FORWARDS_ONLY = _sched(
    [Forward(0, 0), SendActivation(0, 0, 0, 1), Forward(0, 1), SendActivation(0, 1, 0, 1)],
    [RecvActivation(0, 0, 0, 0), Forward(0, 0), RecvActivation(0, 1, 0, 0), Forward(0, 1)],
)


def test_link_fifo_latency_and_bandwidth() -> None:
    # 100 bytes at 100 B/s plus 0.5 s latency: 1.5 s per transfer, one at a time.
    costs = CostModel(
        forward_s=[[1.0, 1.0]],
        backward_s=[[2.0, 2.0]],
        activation_bytes=[[100, 0]],
        bandwidth_Bps=100.0,
        latency_s=0.5,
    )
    r = simulate(FORWARDS_ONLY, costs)
    # Worker 0 posts mb0 at 1 (arrives 2.5) and mb1 at 2, which waits for the link until 2.5 (arrives 4).
    assert _boxes(r, "link") == [(0, "activation", 0, 1.0, 2.5), (0, "activation", 1, 2.5, 4.0)]
    assert _boxes(r) == [
        (0, "forward", 0, 0.0, 1.0),
        (0, "forward", 1, 1.0, 2.0),
        (1, "forward", 0, 2.5, 3.5),
        (1, "forward", 1, 4.0, 5.0),
    ]
    assert r.makespan == 5.0
    assert r.busy_s == (2.0, 2.0)
    assert r.bubble_ratio == pytest.approx(1 - 4 / 10)
    assert r.end_s == (2.0, 5.0)
    assert r.link_free_s == {(0, 1): 4.0}
    assert r.throughput == pytest.approx(2 / 5)


def test_per_link_override_and_free_communication() -> None:
    base = CostModel(forward_s=[[1.0, 1.0]], backward_s=[[2.0, 2.0]], activation_bytes=[[100, 0]])
    assert simulate(FORWARDS_ONLY, base).makespan == 3.0  # infinite bandwidth, zero latency
    slow_link = dataclasses.replace(base, links={(0, 1): (50.0, 0.0)})  # 2 s per transfer
    assert _boxes(simulate(FORWARDS_ONLY, slow_link), "link") == [
        (0, "activation", 0, 1.0, 3.0),
        (0, "activation", 1, 3.0, 5.0),
    ]
    other_link = dataclasses.replace(base, links={(1, 0): (50.0, 0.0)})  # not the one used
    assert simulate(FORWARDS_ONLY, other_link).makespan == 3.0


def test_links_are_full_duplex() -> None:
    # Activation 0->1 at t=1..2, gradient 1->0 at t=4..5 on the reverse link.
    sched = _sched(
        [Forward(0, 0), SendActivation(0, 0, 0, 1), RecvGradient(0, 0, 0, 1), Backward(0, 0)],
        [RecvActivation(0, 0, 0, 0), Forward(0, 0), Backward(0, 0), SendGradient(0, 0, 0, 0)],
        mbs=1,
    )
    costs = CostModel(
        forward_s=[[1.0, 1.0]],
        backward_s=[[1.0, 1.0]],
        activation_bytes=[[10, 0]],
        gradient_bytes=[[0, 10]],
        bandwidth_Bps=10.0,
    )
    r = simulate(sched, costs)
    assert _boxes(r, "link") == [(0, "activation", 0, 1.0, 2.0), (1, "gradient", 0, 4.0, 5.0)]
    assert r.makespan == 6.0
    # An activation and a gradient posted at the same time travel at the same time.
    crossing = _sched(
        [Forward(0, 0), SendActivation(0, 0, 0, 1), RecvGradient(0, 1, 0, 1), Backward(0, 1)],
        [Forward(0, 1, 0), SendGradient(0, 1, 0, 0), RecvActivation(0, 0, 0, 0), Forward(0, 0)],
    )
    crossing_costs = dataclasses.replace(costs, gradient_bytes=[[0, 10]])
    lr = simulate(crossing, crossing_costs)
    assert _boxes(lr, "link") == [(0, "activation", 0, 1.0, 2.0), (1, "gradient", 1, 1.0, 2.0)]


def test_slowdown_scales_compute_only() -> None:
    costs = CostModel(
        forward_s=[[1.0, 1.0]],
        backward_s=[[2.0, 2.0]],
        activation_bytes=[[100, 0]],
        bandwidth_Bps=100.0,
        slowdown=(2.0, 1.0),
    )
    r = simulate(FORWARDS_ONLY, costs)
    assert _boxes(r) == [
        (0, "forward", 0, 0.0, 2.0),
        (0, "forward", 1, 2.0, 4.0),
        (1, "forward", 0, 3.0, 4.0),
        (1, "forward", 1, 5.0, 6.0),
    ]
    assert r.busy_s == (4.0, 2.0)
    with pytest.raises(PlanError, match="slowdown has 3 entries"):
        simulate(FORWARDS_ONLY, dataclasses.replace(costs, slowdown=(1.0, 1.0, 1.0)))


def test_switch_cost_between_jobs_and_update_cost() -> None:
    sched = _sched(
        [
            Forward(0, 0),
            Forward(1, 0),
            Backward(1, 0),
            Backward(0, 0),
            OptimizerStep(0),
            OptimizerStep(1),
        ],
        jobs=2,
        mbs=1,
    )
    costs = CostModel(
        forward_s=[[1.0], [1.0]],
        backward_s=[[2.0], [2.0]],
        switch_s=[[0.25], [0.5]],
        update_s=[[0.125], [0.25]],
    )
    r = simulate(sched, costs)
    assert [
        (k, j, s, e)
        for (_, k, _, s, e), j in zip(_boxes(r), [ev.job for ev in r.timeline], strict=True)
    ] == [
        ("forward", 0, 0.0, 1.0),
        ("switch", 1, 1.0, 1.5),
        ("forward", 1, 1.5, 2.5),
        ("backward", 1, 2.5, 4.5),
        ("switch", 0, 4.5, 4.75),
        ("backward", 0, 4.75, 6.75),
        ("step", 0, 6.75, 6.875),
        ("step", 1, 6.875, 7.125),
    ]
    assert r.makespan == 7.125
    assert r.busy_s == (6.375,)  # switches are not useful work
    assert r.throughput == pytest.approx(2 / 7.125)


def test_step_sums_chunks_and_local_transfers_are_free() -> None:
    # One worker holding two chunks (virtual stages 0 and 1): its "sends" go to itself.
    sched = _sched(
        [
            Forward(0, 0, 0),
            SendActivation(0, 0, 0, 0),
            RecvActivation(0, 0, 1, 0),
            Forward(0, 0, 1),
            Backward(0, 0, 1),
            SendGradient(0, 0, 1, 0),
            RecvGradient(0, 0, 0, 0),
            Backward(0, 0, 0),
            OptimizerStep(0),
        ],
        chunks=2,
        mbs=1,
    )
    costs = CostModel(
        forward_s=[[1.0, 0.5]],
        backward_s=[[2.0, 1.0]],
        update_s=[[0.25, 0.5]],
        activation_bytes=[[1e9, 0]],
        bandwidth_Bps=1.0,
    )
    r = simulate(sched, costs)
    assert r.makespan == 1.0 + 0.5 + 1.0 + 2.0 + 0.75
    assert _boxes(r)[-1] == (0, "step", -1, 4.5, 5.25)
    assert _boxes(r, "link") == []


def test_deadlock_names_blocked_workers() -> None:
    sched = _sched(
        [RecvGradient(0, 0, 0, 1), Forward(0, 0), SendActivation(0, 0, 0, 1), Backward(0, 0)],
        [RecvActivation(0, 0, 0, 0), Forward(0, 0), Backward(0, 0), SendGradient(0, 0, 0, 0)],
        mbs=1,
    )
    with pytest.raises(
        ScheduleError, match=r"deadlocks.*worker 0 at instruction 0.*worker 1 at instruction 0"
    ):
        simulate(sched, CostModel.uniform(2))
    missing = _sched([Forward(0, 0)], [RecvActivation(0, 0, 0, 0), Forward(0, 0)], mbs=1)
    with pytest.raises(ScheduleError, match=r"worker 1 .*no matching send"):
        simulate(missing, CostModel.uniform(2))


def test_cost_model_must_fit_schedule() -> None:
    with pytest.raises(PlanError, match="3 virtual stages"):
        simulate(FORWARDS_ONLY, CostModel.uniform(3))
    with pytest.raises(PlanError, match="backward_s must be a 1 x 2"):
        CostModel(forward_s=[[1.0, 1.0]], backward_s=[[1.0]])
    with pytest.raises(PlanError, match="bandwidth_Bps must be a number > 0"):
        CostModel(forward_s=[[1.0]], backward_s=[[1.0]], bandwidth_Bps=0.0)
    with pytest.raises(PlanError, match="finite numbers >= 0"):
        CostModel(forward_s=[[-1.0]], backward_s=[[1.0]])


@pytest.mark.parametrize("recompute", [False, True])
def test_activation_memory_peaks(recompute: bool) -> None:
    S, M, saved, inp = 4, 8, 1000, 10
    costs = CostModel.uniform(S)
    costs = dataclasses.replace(costs, saved_bytes=[[saved] * S], input_bytes=[[inp] * S])
    gpipe = simulate(
        build_schedule("gpipe", stages=S, microbatches=M, recompute=recompute), costs, record=False
    )
    ofob = simulate(
        build_schedule("1f1b", stages=S, microbatches=M, recompute=recompute), costs, record=False
    )
    if recompute:  # inputs of every in-flight micro-batch, plus one stash while recomputing
        assert gpipe.peak_activation_bytes == (M * inp + saved,) * S
        assert ofob.peak_activation_bytes == tuple((S - s) * inp + saved for s in range(S))
    else:  # GPipe keeps all M micro-batches, 1F1B keeps S - s on worker s
        assert gpipe.peak_activation_bytes == (M * saved,) * S
        assert ofob.peak_activation_bytes == tuple((S - s) * saved for s in range(S))


def test_weight_memory_counts_live_versions() -> None:
    S, M, param, opt = 4, 8, 100, 50
    costs = dataclasses.replace(
        CostModel.uniform(S), param_bytes=[param] * S, optimizer_bytes=[opt] * S
    )
    sync = simulate(build_schedule("1f1b", stages=S, microbatches=M), costs, record=False)
    assert sync.peak_weight_bytes == (param + opt,) * S
    stash = simulate(build_schedule("pipedream", stages=S, microbatches=M), costs, record=False)
    # PipeDream worker s stashes one version per in-flight micro-batch: S - s of them.
    assert stash.peak_weight_bytes == tuple(param + opt + (S - s - 1) * param for s in range(S))
    two = simulate(build_schedule("2bw", stages=S, microbatches=M), costs, record=False)
    assert all(param + opt <= w <= 2 * param + opt for w in two.peak_weight_bytes)
    assert max(two.peak_weight_bytes) == 2 * param + opt


# Two jobs interleaved on two workers (job-array order), so switches and steps repeat.
JOB_ARRAY = _sched(
    [
        *(x for j in (0, 1) for x in (Forward(j, 0), SendActivation(j, 0, 0, 1))),
        *(x for j in (1, 0) for x in (RecvGradient(j, 0, 0, 1), Backward(j, 0))),
        OptimizerStep(0),
        OptimizerStep(1),
    ],
    [
        *(
            x
            for j in (0, 1)
            for x in (
                RecvActivation(j, 0, 0, 0),
                Forward(j, 0),
                Backward(j, 0),
                SendGradient(j, 0, 0, 0),
            )
        ),
        OptimizerStep(0),
        OptimizerStep(1),
    ],
    jobs=2,
    mbs=1,
)


def _comm_costs(schedule: Schedule, slow: tuple[float, ...] = ()) -> CostModel:
    g = schedule.num_virtual_stages
    base = CostModel.uniform_for(schedule)
    return dataclasses.replace(
        base,
        switch_s=[[0.3] * g] * schedule.num_jobs,
        update_s=[[0.2] * g] * schedule.num_jobs,
        activation_bytes=[[300.0] * g] * schedule.num_jobs,
        gradient_bytes=[[200.0] * g] * schedule.num_jobs,
        bandwidth_Bps=1000.0,
        latency_s=0.05,
        links={(0, 1): (500.0, 0.1)},
        slowdown=slow,
    )


@pytest.mark.parametrize(
    "schedule",
    [
        build_schedule("1f1b", stages=4, microbatches=6),
        build_schedule("gpipe", stages=3, microbatches=4, recompute=True),
        build_schedule("interleaved", stages=2, microbatches=4, chunks=2),
        build_schedule("pipedream", stages=3, microbatches=5),
        build_schedule("2bw", stages=3, microbatches=6, update_every=3),
        JOB_ARRAY,
    ],
    ids=lambda s: s.name,
)
def test_iterations_equal_chained_simulations(schedule: Schedule) -> None:
    rng = np.random.default_rng(7)
    iterations, S = 6, schedule.num_stages
    slowdown = rng.uniform(0.5, 3.0, size=(iterations, S))
    costs = _comm_costs(schedule)
    fast = simulate_iterations(schedule, costs, iterations, slowdown=slowdown)
    prev = simulate(schedule, dataclasses.replace(costs, slowdown=tuple(slowdown[0])), record=False)
    np.testing.assert_allclose(fast.worker_end_s[0], prev.end_s, rtol=1e-12)
    for i in range(1, iterations):
        step_costs = dataclasses.replace(costs, slowdown=tuple(slowdown[i]))
        prev = simulate(
            schedule, step_costs, record=False, start_s=prev.end_s, link_free_s=prev.link_free_s
        )
        np.testing.assert_allclose(fast.worker_end_s[i], prev.end_s, rtol=1e-12)
    assert fast.total_s == pytest.approx(max(prev.end_s), rel=1e-12)
    assert fast.iteration_s.sum() == pytest.approx(fast.total_s)
    done = iterations * schedule.num_jobs * schedule.num_microbatches
    assert fast.throughput == pytest.approx(done / fast.total_s)


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved", "pipedream", "2bw"]),
    stages=st.integers(2, 4),
    seed=st.integers(0, 2**16),
)
def test_timeline_invariants_under_random_costs(name: str, stages: int, seed: int) -> None:
    chunks = 2 if name == "interleaved" else 1
    schedule = build_schedule(name, stages=stages, microbatches=2 * stages, chunks=chunks)
    rng = np.random.default_rng(seed)
    g = schedule.num_virtual_stages
    costs = CostModel(
        forward_s=[rng.uniform(0.1, 2.0, g)],
        backward_s=[rng.uniform(0.1, 4.0, g)],
        activation_bytes=[rng.uniform(0, 1000, g)],
        gradient_bytes=[rng.uniform(0, 1000, g)],
        bandwidth_Bps=500.0,
        latency_s=0.05,
        slowdown=tuple(rng.uniform(0.5, 2.0, stages)),
    )
    r = simulate(schedule, costs)
    lanes: dict[tuple[str, int, int], list[Event]] = {}
    for e in r.timeline:
        lanes.setdefault((e.where, e.worker, e.peer), []).append(e)
    for (where, _, _), events in lanes.items():
        # One thing at a time per worker and per directed link; links keep posting order.
        for a, b in itertools.pairwise(events):
            assert a.end <= b.start + 1e-12
        if where == "link":
            assert all(e.duration >= 0.05 - 1e-12 for e in events)  # end - start rounds
    assert r.makespan == pytest.approx(max(e.end for e in r.timeline))
    assert sum(r.busy_s) == pytest.approx(
        sum(e.duration for e in r.timeline if e.kind in ("forward", "backward", "step"))
    )
    fast = simulate_iterations(schedule, costs, 1)
    assert fast.total_s == pytest.approx(r.makespan, rel=1e-12)


def test_iterations_without_slowdown_repeat_the_single_run() -> None:
    schedule = build_schedule("1f1b", stages=3, microbatches=4)
    costs = CostModel.uniform_for(schedule)
    fast = simulate_iterations(schedule, costs, 4)
    one = simulate(schedule, costs)
    assert fast.iteration_s[0] == one.makespan
    assert fast.iterations == 4 and fast.to_json()["iterations"] == 4
    with pytest.raises(PlanError, match="slowdown must be a positive"):
        simulate_iterations(schedule, costs, 4, slowdown=np.ones((3, 3)))


def test_cost_model_json_round_trip() -> None:
    schedule = build_schedule("1f1b", stages=2, microbatches=2)
    costs = dataclasses.replace(
        _comm_costs(schedule, slow=(1.0, 1.5)),
        links={(1, 0): (math.inf, 0.25)},
        samples_per_microbatch=4,
    )
    again = CostModel.from_json(json.loads(json.dumps(costs.to_json(), allow_nan=False)))
    assert again == costs
    assert again.link(1, 0) == (math.inf, 0.25)
    with pytest.raises(PlanError, match="costs: forward_s"):
        CostModel.from_json({**costs.to_json(), "forward_s": [[1.0, "x"]]})


def test_sim_result_json_round_trip() -> None:
    schedule = build_schedule("1f1b", stages=2, microbatches=3)
    r = simulate(schedule, _comm_costs(schedule))
    again = SimResult.from_json(json.loads(json.dumps(r.to_json(), allow_nan=False)))
    assert again == r
    assert isinstance(again.timeline[0], Event)


def test_from_profile_sums_layers() -> None:
    base = Profile.uniform(6, forward_s=0.5, backward_s=1.0, activation_bytes=8, param_bytes=40)
    profile = dataclasses.replace(base, input_bytes=3)
    part = Partition(model="uniform", num_layers=6, bounds=(0, 1, 4, 6))
    costs = CostModel.from_profile(profile, part, bandwidth_Bps=1e9, latency_s=1e-5)
    assert costs.forward_s == ((0.5, 1.5, 1.0),)
    assert costs.backward_s == ((1.0, 3.0, 2.0),)
    assert costs.recompute_s == costs.forward_s
    assert costs.input_bytes == ((3, 8, 8),)
    assert costs.saved_bytes == ((8, 24, 16),)
    assert costs.param_bytes == (40, 120, 80)
    assert costs.transfer_s(0, 1, 1000) == pytest.approx(1e-5 + 1e-6)
    with pytest.raises(PlanError, match="partition covers 5 layers"):
        CostModel.from_profile(profile, Partition(model="uniform", num_layers=5, bounds=(0, 5)))


def test_from_profile_with_batched_weight_grads_moves_wgrad_to_the_step() -> None:
    base = Profile.uniform(4, forward_s=0.5, backward_s=1.0)
    layers = tuple(
        dataclasses.replace(lp, update_s=0.1, backward_input_s=0.6, wgrad_s=1.6)
        for lp in base.layers
    )
    profile = dataclasses.replace(base, layers=layers, wgrad_microbatches=4)
    part = Partition(model="uniform", num_layers=4, bounds=(0, 1, 4))
    plain = CostModel.from_profile(profile, part)
    assert plain.backward_s == ((1.0, 3.0),) and plain.update_s[0] == pytest.approx((0.1, 0.3))
    batched = CostModel.from_profile(profile, part, batch_weight_grads=True)
    assert batched.backward_s[0] == pytest.approx((0.6, 1.8))
    assert plain.wgrad_bytes == ((0, 0),) and batched.wgrad_bytes == ((0, 0),)  # unmeasured
    measured = dataclasses.replace(
        profile, layers=tuple(dataclasses.replace(lp, wgrad_bytes=7) for lp in layers)
    )
    assert CostModel.from_profile(measured, part, batch_weight_grads=True).wgrad_bytes == ((7, 21),)
    assert CostModel.from_profile(measured, part).wgrad_bytes == ((0, 0),)
    assert batched.update_s[0] == pytest.approx((1.7, 5.1))  # update + batched dW
    assert batched.forward_s == plain.forward_s
    # Measured for 4 micro-batches; a run with 8 computes twice the rows.
    eight = CostModel.from_profile(profile, part, batch_weight_grads=True, microbatches=8)
    assert eight.update_s[0] == pytest.approx((3.3, 9.9))
    # 1F1B over 4 micro-batches: the step now carries the weight gradients.
    sched = build_schedule("1f1b", stages=2, microbatches=4)
    assert simulate(sched, batched).makespan != simulate(sched, plain).makespan
    with pytest.raises(PlanError, match="no batched weight-gradient timings"):
        CostModel.from_profile(base, part, batch_weight_grads=True)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_batched_weight_grad_stashes_are_held_until_the_step(schedule: str) -> None:
    chunks = 2 if schedule == "interleaved" else 1
    sched = build_schedule(schedule, stages=2, microbatches=4, chunks=chunks)
    g = 2 * chunks
    ones = [[1.0] * g]
    # Only weight-gradient stashes: every micro-batch's, of every chunk, lives until the
    # step, so each worker peaks at all of them.
    only = CostModel(forward_s=ones, backward_s=ones, wgrad_bytes=[[10] * g])
    assert simulate(sched, only).peak_activation_bytes == (4 * 10 * chunks,) * 2
    # With activations as well, a peak is at least the larger of the two kinds and at
    # most their sum (GPipe's is its forward stash, before any weight gradient exists).
    saved = CostModel(forward_s=ones, backward_s=ones, saved_bytes=[[100] * g])
    both = dataclasses.replace(saved, wgrad_bytes=[[10] * g])
    plain_peaks = simulate(sched, saved).peak_activation_bytes
    both_peaks = simulate(sched, both).peak_activation_bytes
    for b, p in zip(both_peaks, plain_peaks, strict=True):
        assert max(p, 40 * chunks) <= b <= p + 40 * chunks
    assert CostModel.from_json(both.to_json()) == both


def test_gantt_writes_png(tmp_path: Path) -> None:
    schedule = build_schedule("interleaved", stages=2, microbatches=4, chunks=2, recompute=True)
    r = simulate(schedule, _comm_costs(schedule))
    out = tmp_path / "gantt.png"
    plot_gantt(r, out, title="interleaved")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000
    jobs = _sched(
        [
            Forward(0, 0),
            Forward(1, 0),
            Recompute(1, 0),
            Backward(1, 0),
            Backward(0, 0),
            OptimizerStep(0),
            OptimizerStep(1),
        ],
        jobs=2,
        mbs=1,
        recompute=True,
    )
    plot_gantt(
        simulate(jobs, CostModel(forward_s=[[1.0]], backward_s=[[2.0]], switch_s=[[0.1]])),
        tmp_path / "jobs.png",
    )
    assert (tmp_path / "jobs.png").stat().st_size > 5000
    with pytest.raises(ValueError, match="record=True"):
        plot_gantt(simulate(schedule, _comm_costs(schedule), record=False), tmp_path / "none.png")


@pytest.mark.parametrize(
    "stages",
    [
        pytest.param(((Forward(-1, 0), Backward(-1, 0)),), id="negative-job"),
        pytest.param(
            ((Forward(0, 0), Backward(0, 0)), (Forward(0, 0),)), id="more-lists-than-stages"
        ),
    ],
)
def test_malformed_schedule_built_in_python_is_rejected(
    stages: tuple[tuple[Forward | Backward, ...], ...],
) -> None:
    bad = Schedule(name="bad", num_stages=1, num_microbatches=1, stages=stages)
    with pytest.raises(ScheduleError, match=r"out of range|instruction lists"):
        simulate(bad, CostModel.uniform(1))


def test_too_few_instruction_lists_are_not_silently_idle() -> None:
    bad = Schedule(
        name="bad", num_stages=2, num_microbatches=1, stages=((Forward(0, 0), Backward(0, 0)),)
    )
    with pytest.raises(ScheduleError, match="instruction lists"):
        simulate(bad, CostModel.uniform(2))
