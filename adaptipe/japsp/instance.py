"""`JapspInstance`: a job-array pipeline scheduling problem (ArrayPipe's JAPSP, §IV-A).

``J`` sibling jobs train through one pipeline of ``S`` stages; each job's mini-batch is
one block per stage per pass. Job ``j``'s forward block on stage ``s`` takes
``forward[j][s]`` (``r^j_{s,f}`` in the paper), its backward block ``backward[j][s]``
(``r^j_{s,b}``). The optional per-stage vectors are the paper's other terms:

- ``comm[j][s]``: ``eta^j``, the transfer delay across the boundary ``s -> s+1`` in
  either direction (a lag, not a machine; Eq. 5-6). The last entry is unused.
- ``switch[j][s]``: ``w^j_s``, the context switch stage ``s`` pays when it leaves a
  block of job ``j`` for a block of another job (Eq. 8-9).
- ``update[j][s]``: ``u^j_s``, job ``j``'s just-in-time optimizer step right after its
  backward block on stage ``s``; it occupies the stage (Eq. 9, Eq. 3) but the gradient
  is sent before it (Eq. 6).
- ``recompute[j][s]``: ``re^j_s``, re-materialisation added to the backward block (Eq. 6).

JSON form::

    {"stages": 4, "jobs": [{"name": "bs128", "forward": [..S..], "backward": [..S..],
                            "comm": [..], "switch": [..], "update": [..], "recompute": [..]}]}
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adaptipe.errors import PlanError

__all__ = ["OPTIONAL_FIELDS", "JapspInstance", "generate"]

OPTIONAL_FIELDS = ("comm", "switch", "update", "recompute")
_FIELDS = ("forward", "backward", *OPTIONAL_FIELDS)

Vec = tuple[float, ...]
Table = tuple[Vec, ...]


@dataclass(frozen=True, slots=True)
class JapspInstance:
    """Per-job, per-stage block costs; ``forward[j][s]`` and friends are ``J x S`` tables."""

    num_stages: int
    names: tuple[str, ...]
    forward: Table
    backward: Table
    comm: Table
    switch: Table
    update: Table
    recompute: Table

    def __post_init__(self) -> None:
        check_tables(self, source="JapspInstance")

    @property
    def num_jobs(self) -> int:
        return len(self.names)

    @classmethod
    def build(
        cls,
        forward: list[list[float]],
        backward: list[list[float]],
        *,
        names: list[str] | None = None,
        comm: list[list[float]] | None = None,
        switch: list[list[float]] | None = None,
        update: list[list[float]] | None = None,
        recompute: list[list[float]] | None = None,
    ) -> JapspInstance:
        """An instance from plain ``J x S`` lists; omitted optional tables are zero."""
        jobs, stages = len(forward), len(forward[0]) if forward else 0
        zero: Table = tuple((0.0,) * stages for _ in range(jobs))

        def table(raw: list[list[float]] | None) -> Table:
            return zero if raw is None else tuple(tuple(float(v) for v in row) for row in raw)

        return cls(
            num_stages=stages,
            names=tuple(names) if names is not None else tuple(f"job{j}" for j in range(jobs)),
            forward=table(forward),
            backward=table(backward),
            comm=table(comm),
            switch=table(switch),
            update=table(update),
            recompute=table(recompute),
        )

    def select(self, jobs: Sequence[int]) -> JapspInstance:
        """The instance of ``jobs`` only (distinct indices into this one, in that order)."""
        if not jobs or len(set(jobs)) != len(jobs) or any(not 0 <= j < self.num_jobs for j in jobs):
            raise PlanError(
                f"select: jobs {list(jobs)} must be a non-empty list of distinct jobs "
                f"0..{self.num_jobs - 1}"
            )

        def rows(table: Table) -> Table:
            return tuple(table[j] for j in jobs)

        return JapspInstance(
            num_stages=self.num_stages,
            names=tuple(self.names[j] for j in jobs),
            forward=rows(self.forward),
            backward=rows(self.backward),
            comm=rows(self.comm),
            switch=rows(self.switch),
            update=rows(self.update),
            recompute=rows(self.recompute),
        )

    def to_json(self) -> dict[str, Any]:
        jobs: list[dict[str, Any]] = []
        for j, name in enumerate(self.names):
            row: dict[str, Any] = {"name": name}
            for key in _FIELDS:
                vec = getattr(self, key)[j]
                if key in OPTIONAL_FIELDS and not any(vec):
                    continue
                row[key] = list(vec)
            jobs.append(row)
        return {"stages": self.num_stages, "jobs": jobs}

    @classmethod
    def from_json(cls, data: Any, *, source: str = "instance") -> JapspInstance:
        """Parse the JSON form; errors name ``source``, the job (index and name) and field."""
        if not isinstance(data, dict):
            raise PlanError(f"{source}: top level must be an object (got {type(data).__name__})")
        unknown = sorted(set(data) - {"stages", "jobs"})
        if unknown:
            raise PlanError(f"{source}: unknown field {unknown[0]!r} (allowed: stages, jobs)")
        if "stages" not in data:
            raise PlanError(f"{source}: stages is missing (the number of pipeline stages)")
        stages = data["stages"]
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise PlanError(f"{source}: stages must be an integer >= 1 (got {stages!r})")
        raw_jobs = data.get("jobs")
        if not isinstance(raw_jobs, list) or not raw_jobs:
            raise PlanError(f"{source}: jobs must be a non-empty list of job objects")
        names: list[str] = []
        tables: dict[str, list[Vec]] = {key: [] for key in _FIELDS}
        for j, raw in enumerate(raw_jobs):
            if not isinstance(raw, dict):
                raise PlanError(f"{source}: jobs[{j}] must be an object")
            name = raw.get("name", f"job{j}")
            where = f"{source}: jobs[{j}] ({name!r})"
            if not isinstance(name, str) or not name:
                raise PlanError(f"{source}: jobs[{j}].name must be a non-empty string")
            extra = sorted(set(raw) - {"name", *_FIELDS})
            if extra:
                raise PlanError(
                    f"{where}: unknown field {extra[0]!r} (allowed: {', '.join(_FIELDS)})"
                )
            names.append(name)
            for key in _FIELDS:
                if key not in raw and key in OPTIONAL_FIELDS:
                    tables[key].append((0.0,) * stages)
                    continue
                if key not in raw:
                    raise PlanError(f"{where}: {key} is missing ({stages} times, one per stage)")
                tables[key].append(_vector(raw[key], stages, where=f"{where}: {key}", key=key))
        for j, name in enumerate(names):
            if names.index(name) != j:
                raise PlanError(
                    f"{source}: jobs[{j}] ({name!r}): name duplicates jobs[{names.index(name)}]; "
                    "names must be unique"
                )
        return cls(
            num_stages=stages,
            names=tuple(names),
            forward=tuple(tables["forward"]),
            backward=tuple(tables["backward"]),
            comm=tuple(tables["comm"]),
            switch=tuple(tables["switch"]),
            update=tuple(tables["update"]),
            recompute=tuple(tables["recompute"]),
        )


def _vector(raw: Any, stages: int, *, where: str, key: str) -> Vec:
    if not isinstance(raw, list):
        raise PlanError(f"{where} must be a list of {stages} numbers (got {type(raw).__name__})")
    # comm may omit the unused entry after the last stage.
    if len(raw) != stages and not (key == "comm" and len(raw) == stages - 1):
        raise PlanError(f"{where} must have {stages} entries, one per stage (got {len(raw)})")
    out: list[float] = []
    for s, v in enumerate(raw):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise PlanError(f"{where}[{s}] must be a number (got {v!r})")
        if not math.isfinite(v):
            raise PlanError(f"{where}[{s}] must be finite (got {v})")
        if v < 0:
            raise PlanError(f"{where}[{s}] must be >= 0 (got {v})")
        out.append(float(v))
    if key == "comm" and len(out) == stages - 1:
        out.append(0.0)
    return tuple(out)


def check_tables(inst: JapspInstance, *, source: str) -> None:
    """Shapes, finiteness, signs and unique names; the message names job and field."""
    stages, names = inst.num_stages, inst.names
    if not names:  # first: without jobs, `build` cannot tell the stage count either
        raise PlanError(f"{source}: jobs must be a non-empty list of job objects")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise PlanError(f"{source}: stages must be an integer >= 1 (got {stages!r})")
    seen: dict[str, int] = {}
    for j, name in enumerate(names):
        if name in seen:
            raise PlanError(
                f"{source}: jobs[{j}] ({name!r}): name duplicates jobs[{seen[name]}]; names must be unique"
            )
        seen[name] = j
    for key in _FIELDS:
        table = getattr(inst, key)
        if len(table) != len(names):
            raise PlanError(
                f"{source}: {key} must have one row per job ({len(names)}, got {len(table)})"
            )
        for j, row in enumerate(table):
            where = f"{source}: jobs[{j}] ({names[j]!r}): {key}"
            if len(row) != stages:
                raise PlanError(
                    f"{where} must have {stages} entries, one per stage (got {len(row)})"
                )
            for s, v in enumerate(row):
                if not math.isfinite(v):
                    raise PlanError(f"{where}[{s}] must be finite (got {v})")
                if v < 0:
                    raise PlanError(f"{where}[{s}] must be >= 0 (got {v})")


def generate(
    jobs: int,
    stages: int,
    *,
    seed: int,
    profiles: int = 3,
    jitter: float = 0.02,
    comm: float = 0.0,
    switch: float = 0.0,
    update: float = 0.0,
    recompute: float = 0.0,
) -> JapspInstance:
    """A benchmark instance the paper's way (§V-A workload, §V-C simulation).

    Sibling jobs differ in batch size, so their block times come from a few *profiles*:
    one stage-time vector of the shared model (stages balanced to within about 20%, as
    the paper partitions them), scaled per profile by its batch size. Each job picks a
    profile and perturbs it by a small multiplicative ``jitter``; a backward block takes
    about twice its forward (1.8x to 2.2x per stage). With ``jitter=0`` jobs of one
    profile are identical, as in the paper, where jobs of one batch size train the same
    model; with the default they are only nearly identical, which the branch-and-bound
    cannot use (its symmetry rules need identical jobs, `adaptipe.japsp.partial`). A seed
    picks the same profiles whatever the jitter. ``comm``, ``switch``, ``update`` and
    ``recompute`` are fractions of the job's forward time on that stage. Times are
    rounded to integers (about 100 per forward block at the smallest batch size), which
    keeps bounds and the CP-SAT model exact.
    """
    if jobs < 1 or stages < 1 or profiles < 1:
        raise PlanError(
            f"generate: jobs, stages and profiles must be >= 1 (got {jobs}, {stages}, {profiles})"
        )
    rng = random.Random(seed)
    base = [rng.uniform(0.8, 1.2) for _ in range(stages)]
    sizes = sorted(rng.sample(range(1, 9), min(profiles, 8)))
    while len(sizes) < profiles:
        sizes.append(sizes[-1] + 1)
    bwd_ratio = [rng.uniform(1.8, 2.2) for _ in range(stages)]
    prof_f = [[100.0 * (0.25 + 0.75 * k / sizes[0]) * b for b in base] for k in sizes]
    fwd: list[list[float]] = []
    bwd: list[list[float]] = []
    names: list[str] = []
    extra: dict[str, list[list[float]]] = {k: [] for k in OPTIONAL_FIELDS}
    for j in range(jobs):
        p = rng.randrange(profiles)
        f = [max(1.0, round(t * (1.0 + rng.uniform(-jitter, jitter)))) for t in prof_f[p]]
        b = [
            max(1.0, round(t * r * (1.0 + rng.uniform(-jitter, jitter))))
            for t, r in zip(f, bwd_ratio, strict=True)
        ]
        fwd.append(f)
        bwd.append(b)
        names.append(f"job{j}-bs{sizes[p]}")
        for key, frac in (
            ("comm", comm),
            ("switch", switch),
            ("update", update),
            ("recompute", recompute),
        ):
            row = [float(round(frac * t)) for t in f]
            if key == "comm":
                row[-1] = 0.0
            extra[key].append(row)
    return JapspInstance.build(fwd, bwd, names=names, **extra)
