"""Which plan version a worker adopts at a boundary, and when a streamed move switches.

Most versions are adopted where the workers first agree on them (`PlanFollower`). A
version whose partition moves layers *streamed* (`adaptipe.runtime.streamed`) is
proposed at that boundary but adopted only once its layers have crossed: until then
training goes on on the partition in force, and the version is recorded (and replayed
by a resumed run) where the switch happened. Whether a move streams is one answer on
every worker: the config's ``[adapt] transfer``, and for ``"auto"`` the minimum of every
sender's vote on the crossover rule (`vote`), each over the slower of its link's two
directions as their senders measured them (`link_floors`: a direction that carries light
sends reads fast however slow the link, since a light send completes into the socket
buffer). A streamed move whose gradient log the link could not carry goes by
stop-and-copy at the boundary where the workers agree on that (`PlanSwitch.move`).

A streamed move's work runs in threads of the stage process or, with ``[adapt] streamer
= "process"``, in the worker's helper process (`adaptipe.runtime.courier_move`), started
with the worker so that no move waits for it. ``"auto"`` is threads for now: on the
H100 a helper that replays on the GPU adds a CUDA context beside the stage's, and it
did not stream cheaper there (docs/benchmarks.md, session 17).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from adaptipe.plan.partition import Partition
from adaptipe.runtime.config import RunConfig
from adaptipe.runtime.courier import Courier
from adaptipe.runtime.courier_move import CourierMove
from adaptipe.runtime.follower import PlanFollower
from adaptipe.runtime.iteration_stats import IterationStats
from adaptipe.runtime.migration import Move, layers_of, migrate, plan_moves
from adaptipe.runtime.planversion import PlanVersion
from adaptipe.runtime.slots import LayerSlot
from adaptipe.runtime.stagestate import Stage
from adaptipe.runtime.streamed import StreamedMove
from adaptipe.runtime.streamproto import LAG_CAUSE, WAIT, StreamSettings, base_pace
from adaptipe.runtime.transport import P2PTransport
from adaptipe.schedule.types import Schedule
from adaptipe.sim.migration import UNMEASURED_BPS, MigrationCost, choose_transfer

__all__ = ["PlanSwitch", "link_floors", "vote"]

Log = Callable[[dict[str, Any]], None]
Reported = Callable[[str, dict[str, Any]], None]  # (event, a migration report as JSON)


@dataclass(slots=True, kw_only=True)
class PlanSwitch:
    """A worker's view of plan changes at boundaries (see the module doc)."""

    config: RunConfig
    follower: PlanFollower
    stage: Stage
    transport: P2PTransport
    start: int  # the first boundary of this process (a fresh start or a resume)
    streaming: StreamedMove | CourierMove | None = None  # a streamed migration in flight
    last: IterationStats | None = None  # the last window's measurements
    last_rounds: int = 1
    sent_Bps: float = 0.0  # what this stage sent per second over the last window
    courier: Courier | None = None  # the worker's streaming helper ([adapt] streamer)
    _sent: int = 0

    def __post_init__(self) -> None:
        if self._through_helper():
            self.courier = self._courier()
            if self.config.adapt.repartition:  # scripted moves: the first may come soon
                self.courier.ready.wait(self.config.adapt.timeout_s)

    def note(self, stats: IterationStats, rounds: int) -> None:
        """The window that just ran (what a vote on the crossover rule reads)."""
        sent, self._sent = self.transport.bytes_sent - self._sent, self.transport.bytes_sent
        self.last, self.last_rounds = stats, rounds
        self.sent_Bps = sent / stats.iteration_s if stats.iteration_s > 0 else 0.0

    def at(self, it: int, partition: Partition, schedule: Schedule, log: Log) -> PlanVersion | None:
        """The version to adopt at boundary ``it`` (every worker), or None; ``partition``
        and ``schedule`` are the ones in force."""
        proposed = self.follower.propose(it)
        streaming = self.streaming
        rank = self.stage.rank
        if streaming is not None:
            if proposed is not None and proposed.version == streaming.version:
                if streaming.boundary() == WAIT:
                    return None
            else:  # superseded by a newer version: that one moves by stop-and-copy
                streaming.close()
                self.streaming = None
                log({"event": "stream_dropped", "stage": rank, "iteration": it,
                     "version": streaming.version})  # fmt: skip
        elif proposed is not None and self._streams(proposed, it, partition, schedule, log):
            assert proposed.partition is not None
            self.streaming = self._start(proposed, partition, schedule)
            log({"event": "stream_start", "stage": rank, "iteration": it,
                 "version": proposed.version, "bounds": list(proposed.partition.bounds)})  # fmt: skip
            return None
        if proposed is not None:
            self.follower.take(proposed, it)
        return proposed

    def move(
        self, old: Partition, new: Partition, schedule: Schedule, *, wire: torch.device,
        seq: int, log: Reported,
    ) -> bool:  # fmt: skip
        """Move layers live from ``old`` to ``new`` at this boundary (every worker): switch
        the streamed move under way, or copy them now (stop-and-copy, ``seq`` numbering
        its messages), also where a streamed move failed because the link could not carry
        its gradient log. ``log`` gets each report as a ``migration`` event (the streamed
        one that lagged as ``stream_lagged``); False when the old partition stays."""
        streaming, instead_of = self.take_streaming(), ""
        if streaming is not None:
            report = streaming.switch(layers_of(new, schedule, self.stage.rank))
            if report.ok or not report.lagged:
                log("migration", report.to_json())
                return report.ok
            log("stream_lagged", report.to_json())
            instead_of = LAG_CAUSE
        report = migrate(
            self.stage, old=old, new=new, schedule=schedule, wire=wire,
            timeout_s=self.config.adapt.timeout_s, seq=seq,
        )  # fmt: skip
        report.instead_of = instead_of
        log("migration", report.to_json())
        return report.ok

    def take_streaming(self) -> StreamedMove | CourierMove | None:
        """The streamed move whose version is being adopted now (None: stop-and-copy)."""
        streaming, self.streaming = self.streaming, None
        return streaming

    def close(self) -> None:
        if self.streaming is not None:
            self.streaming.close(wait=True)
            self.streaming = None
        if self.courier is not None:
            self.courier.close()
            self.courier = None

    def _through_helper(self) -> bool:
        """Whether streamed moves run in a helper process (`adaptipe.runtime.courier`)."""
        adapt = self.config.adapt
        if adapt.method != "live" or adapt.transfer == "stop_and_copy" or self.config.sweep:
            return False
        return adapt.streamer == "process"  # auto: threads (see the module doc)

    def _courier(self) -> Courier:
        low = self.config.adapt.prioritise and self.stage.device.type == "cuda"
        return Courier(low=low, threads=torch.get_num_threads(), device=str(self.stage.device))

    def _streams(
        self, plan: PlanVersion, it: int, partition: Partition, schedule: Schedule, log: Log
    ) -> bool:
        adapt = self.config.adapt
        if (
            plan.partition is None
            or plan.partition.bounds == partition.bounds
            or adapt.method != "live"
            or adapt.transfer == "stop_and_copy"
            or it == self.start
            or self.follower.replaying(plan)  # the switch replays where it happened
            or self.config.sweep is not None
            or schedule.weights != "sync"
        ):
            return False
        if adapt.transfer == "streamed":
            return True
        stats = self.last
        floors = self._link_floors(self.config.pipeline.stages)
        inputs = {
            "iteration_s": stats.iteration_s / self.last_rounds if stats else 0.0,
            "comm_share": stats.comm_s / stats.iteration_s if stats and stats.iteration_s else 0.0,
            "sent_Bps": self.sent_Bps,
        }
        mine = vote(
            self.stage,
            plan_moves(partition, plan.partition, schedule),
            bandwidth_Bps=lambda dst: floors[dst],
            iteration_s=inputs["iteration_s"],
            comm_share=inputs["comm_share"],
            sent_Bps=inputs["sent_Bps"],
        )
        box = torch.tensor([mine], dtype=torch.int64, device=self.follower.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.follower.group)
        agreed = int(box.item()) == 1
        log({"event": "transfer_vote", "stage": self.stage.rank, "iteration": it,
             "version": plan.version, "links_Bps": floors, **inputs, "mine": mine,
             "streamed": agreed})  # fmt: skip
        return agreed

    def _link_floors(self, stages: int) -> list[float]:
        """Per worker, the slower direction of this worker's link to it (`link_floors`;
        one all-reduce of every worker's readings on every worker)."""
        rank = self.stage.rank
        box = torch.zeros((stages, stages), dtype=torch.float64, device=self.follower.device)
        for peer in range(stages):
            if peer != rank:
                box[rank, peer] = self.transport.bandwidth_Bps(peer)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(box, op=dist.ReduceOp.SUM, group=self.follower.group)
        return link_floors(box.tolist())[rank]

    def _start(
        self, plan: PlanVersion, partition: Partition, schedule: Schedule
    ) -> StreamedMove | CourierMove:
        assert plan.partition is not None
        adapt = self.config.adapt
        moves = plan_moves(partition, plan.partition, schedule)
        held = {slot.index: slot for chunk in self.stage.chunks for slot in chunk}
        outgoing = [held[i] for m in moves if m.src == self.stage.rank for i in m.layers]
        stats = self.last
        pace = base_pace(
            sum(_state_bytes(slot) for slot in outgoing),
            stats.iteration_s / self.last_rounds if stats else 0.0,
            adapt.pace_iterations,
        )
        settings = StreamSettings(
            chunk_bytes=adapt.chunk_bytes,
            prioritise=adapt.prioritise,
            timeout_s=adapt.timeout_s,
            idle_cpu=self.stage.device.type == "cuda",  # a CPU stage's core never idles
            pace_Bps=pace if adapt.prioritise else 0.0,  # pacing is part of prioritising
        )
        where = {"group": self.follower.group, "device": self.follower.device}
        if self.courier is None:
            return StreamedMove(
                self.stage, moves, version=plan.version, settings=settings,
                busy=self.transport.sending, **where,
            )  # fmt: skip
        if not self.courier.alive:  # it died in an earlier move: a fresh one (the move waits)
            self.courier.close()
            self.courier = self._courier()
        return CourierMove(
            self.stage, moves, version=plan.version, settings=settings,
            busy=self.transport.sending, courier=self.courier, **where,
        )  # fmt: skip


def vote(
    stage: Stage,
    moves: Sequence[Move],
    *,
    bandwidth_Bps: Callable[[int], float],
    iteration_s: float,
    comm_share: float,
    sent_Bps: float = 0.0,
    cost: MigrationCost | None = None,
) -> int:
    """This worker's side of the crossover rule (`adaptipe.sim.migration.choose_transfer`)
    for the moves it sends: 1 to stream them, 0 for stop-and-copy (the workers take the
    minimum). ``bandwidth_Bps(dst)``: the measured link (0: unmeasured); the link is
    busy the larger of ``comm_share`` (the stage's time in sends) and ``sent_Bps`` (what
    the stage sends a second) over its bandwidth: on a link-bound pipeline sends are
    posted ahead and their time shows as waiting, not sending."""
    held = {slot.index: slot for chunk in stage.chunks for slot in chunk}
    for move in (m for m in moves if m.src == stage.rank):
        slots = [held[i] for i in move.layers]
        measured = bandwidth_Bps(move.dst)
        link = measured if measured > 0 else UNMEASURED_BPS
        choice = choose_transfer(
            cost if cost is not None else MigrationCost(),
            state_bytes=sum(_state_bytes(slot) for slot in slots),
            log_bytes=sum(_nbytes(p) for slot in slots for p in slot.module.parameters()),
            bandwidth_Bps=link,
            iteration_s=iteration_s,
            comm_share=max(comm_share, min(sent_Bps / link, 1.0)),
        )
        if choice != "streamed":
            return 0
    return 1


def link_floors(readings: Sequence[Sequence[float]]) -> list[list[float]]:
    """Per pair of workers, the slower of the link's two directions: ``readings[a][b]``
    is worker ``a``'s measured bandwidth to ``b`` (0: unmeasured), and a direction
    unmeasured leaves the other's reading (0 where neither is measured)."""
    n = len(readings)
    out = [[0.0] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            both = [r for r in (readings[a][b], readings[b][a]) if r > 0]
            out[a][b] = min(both) if both else 0.0
    return out


def _state_bytes(slot: LayerSlot) -> int:
    """What moving ``slot`` sends: its module's state and its optimizer's (counted on
    the tensors themselves, no copies)."""
    tensors = list(slot.module.state_dict().values())
    if slot.optimizer is not None:
        for p in slot.module.parameters():
            tensors += [
                v for v in slot.optimizer.state.get(p, {}).values() if isinstance(v, Tensor)
            ]
    return sum(_nbytes(t) for t in tensors)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
