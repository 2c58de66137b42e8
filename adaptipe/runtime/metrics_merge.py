"""One metrics record per iteration, merged from the stage workers' reports as they grow.

Each worker appends a JSON line per iteration to its own file in the run directory; an
iteration is merged once every stage has reported it. Its span is the time between the
ends of consecutive iterations (the slowest stage's), so throughput counts pipeline
overlap; the first iteration, with no predecessor, takes its slowest stage's own time.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from adaptipe.runtime.rundir import RunDir

__all__ = ["ARRAY_FIELDS", "STAGE_FIELDS", "MetricsFollower"]

STAGE_FIELDS = ("compute_s", "wait_s", "comm_s")  # per-stage means in the summary
ARRAY_FIELDS = ("resident_jobs", "state_wait_s")  # job-arrays' memory manager


class MetricsFollower:
    """Reads the workers' per-stage reports as they grow and merges iterations."""

    def __init__(self, run: RunDir, stages: int, batch_sizes: dict[str, int]) -> None:
        self.run = run
        self.stages = stages
        self.batch_sizes = batch_sizes  # per job (sweep index as a string)
        self.offsets = [0] * stages
        self.pending: dict[int, dict[int, dict[str, Any]]] = {}
        self.merged: list[dict[str, Any]] = []
        self.ready = 0  # workers that said they are ready
        self.done: set[int] = set()  # stages that said their last iteration is done
        self.heard = 0.0  # time.monotonic() when a stage last reported anything
        self.last_end: float | None = None
        self._migrations: dict[int, dict[int, dict[str, Any]]] = {}  # iteration -> stage -> event
        self._paths = [run.stage_metrics(s, create=False) for s in range(stages)]

    def migrations(self) -> list[dict[str, Any]]:
        """The migrations every stage has reported since the last call, one event each
        (iteration, bounds, ok, moves, bytes, the slowest stage's seconds, causes; for a
        streamed move the boundaries and seconds it streamed and its gradient log's bytes)."""
        out = []
        for it in sorted(self._migrations):
            by_stage = self._migrations[it]
            if len(by_stage) < self.stages:
                continue
            del self._migrations[it]
            events = [by_stage[s] for s in range(self.stages)]
            out.append(
                {
                    "event": "migration",
                    "iteration": it,
                    "bounds": events[0]["bounds"],
                    "ok": all(e["ok"] for e in events),
                    "moves": events[0].get("moves", []),
                    "bytes": sum(int(e.get("bytes_received", 0)) for e in events),
                    "seconds": max(float(e.get("seconds", 0.0)) for e in events),
                    "causes": sorted({e["cause"] for e in events if e.get("cause")}),
                    "transfer": events[0].get("transfer", "stop_and_copy"),
                    "streamer": events[0].get("streamer", ""),
                    "streamed_iterations": max(
                        int(e.get("streamed_iterations", 0)) for e in events
                    ),
                    "streamed_s": max(float(e.get("streamed_s", 0.0)) for e in events),
                    "log_bytes": sum(int(e.get("log_bytes", 0)) for e in events),
                    "instead_of": events[0].get("instead_of", ""),
                }
            )
        return out

    def poll(self) -> list[dict[str, Any]]:
        """The iterations that every stage has reported since the last poll, merged."""
        for s in range(self.stages):
            self._read(s)
        new: list[dict[str, Any]] = []
        for it in sorted(self.pending):
            if len(self.pending[it]) < self.stages:
                break
            merged = self._merge(it, self.pending.pop(it))
            self.merged.append(merged)
            new.append(merged)
        return new

    def _read(self, s: int) -> None:
        # Polled every 10-50 ms: a stat, and the file opened only when it has grown.
        path = self._paths[s]
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return
        if size <= self.offsets[s]:
            return
        with path.open() as fh:
            fh.seek(self.offsets[s])
            chunk = fh.read()
        complete = chunk[: chunk.rfind("\n") + 1]  # a line still being written waits
        self.offsets[s] += len(complete)
        if complete:
            self.heard = time.monotonic()
        for line in complete.splitlines():
            rec = json.loads(line)
            if rec.get("event") == "ready":
                self.ready += 1
            elif rec.get("event") == "done":
                self.done.add(s)
            elif rec.get("event") == "migration":
                self._migrations.setdefault(rec["iteration"], {})[s] = rec
            elif "iteration" in rec and "event" not in rec:
                self.pending.setdefault(rec["iteration"], {})[s] = rec

    def _merge(self, it: int, recs: dict[int, dict[str, Any]]) -> dict[str, Any]:
        end = max(r["end_time"] for r in recs.values())
        span = (
            max(r["iteration_s"] for r in recs.values())
            if self.last_end is None
            else end - self.last_end
        )
        self.last_end = end
        loss = next((r["loss"] for r in recs.values() if "loss" in r), None)
        losses = next((r["losses"] for r in recs.values() if "losses" in r), None)
        jobs = losses if losses is not None else self.batch_sizes
        samples = sum(self.batch_sizes.get(j, 0) for j in jobs)
        return {
            "iteration": it,
            "window": max(int(r.get("window", 1)) for r in recs.values()),
            "loss": loss,
            "losses": losses,
            "iteration_s": span,
            "samples": samples,
            "samples_per_s": samples / span if span > 0 else None,
            "stages": [
                {
                    k: recs[s][k]
                    for k in (*STAGE_FIELDS, "iteration_s", "in_flight", *ARRAY_FIELDS)
                    if k in recs[s]
                }
                for s in range(self.stages)
            ],
        }
