"""Online fine-tuning of the speed predictor on the run's own measurements (issue 22
item 2; AutoPipe's transfer learning: a network trained offline on many conditions,
then tuned on the job it serves).

**Samples.** Every decision of the chain (`adaptipe.controllers.chain`) encodes the
partition in force and its candidates (`adaptipe.controllers.predictor.encode`). The
partition in force is a free sample: its label, the mean measured seconds per
iteration (the stages' mean ``iteration_s``, as `adaptipe.envs.predictor_eval`
labels recorded runs) of the next ``horizon`` iterations, arrives with later
decisions' telemetry. A move adds the chosen candidate: its label is the first
``horizon`` iterations under it, the switch's own iteration left out (its stall is no
part of what the predictor predicts). A sample whose label does not arrive within
three horizons (the partition changed meanwhile) is dropped. At most ``capacity``
samples are kept, the newest.

**Tuning.** After a decision with new labelled samples, one round of Adam steps on the
predictor's L1 loss (its training loss, `adaptipe.envs.predictor_train`) over the
samples, on a copy of the network: at most ``passes`` passes and at most ``budget_s``
CPU seconds of the tuning thread (``time.thread_time``; a step started within the
budget finishes). The round runs on a daemon thread at the lowest priority (nice 19),
never in the decision's call; its result replaces the network the predictor serves
with at the end, so a decision never waits for it.

**Measured as it goes.** When a sample's label arrives, the prediction made at the
decision (by the network in service then) and the shipped network's prediction for
the same inputs are both scored against it: ``summary()`` has both MAPEs.

**Saved with the run.** At each checkpoint (the controller's ``state_dict``) weights
tuned since the last save are written as a predictor artifact under the run directory
(``control/adapted/predictor/round-NNNNNN/``, same format as the shipped one, its
training metadata naming the shipped artifact's sha256), never over the shipped one;
the state references it by path and manifest sha256, and a resume loads it
(`load_state_dict`). The buffer of samples is not saved: a resumed run starts
collecting again.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from adaptipe.controllers.observation import Observation
from adaptipe.controllers.predictor import FORMAT, MODEL, Encoded, Predictor, config_bytes
from adaptipe.errors import PlanError

__all__ = ["ADAPTED_DIR", "OnlineSettings", "OnlineTuner"]

ADAPTED_DIR = Path("control") / "adapted" / "predictor"
"""Where a run's adapted predictor weights go, under its run directory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OnlineSettings:
    """How the predictor is tuned online (``[adapt].online_budget_s`` is ``budget_s``)."""

    budget_s: float = 0.2  # CPU seconds of the tuning thread per round
    lr: float = 1e-3  # a third of offline training's: the shipped weights are the prior
    batch: int = 32
    passes: int = 2  # at most this many passes over the samples per round
    capacity: int = 512
    background: bool = True  # False: the round runs in the caller (tests, evaluation)

    def __post_init__(self) -> None:
        if not (0 < self.budget_s <= 60 and self.lr > 0):
            raise PlanError(f"online: budget_s in (0, 60] and lr > 0 (got {self})")
        if min(self.batch, self.passes, self.capacity) < 1:
            raise PlanError(f"online: batch, passes and capacity must be >= 1 (got {self})")


@dataclass(frozen=True, slots=True)
class _Pending:
    iteration: int  # the decision's: the label starts after it
    bounds: tuple[int, ...]
    series: npt.NDArray[np.float32]
    static: npt.NDArray[np.float32]
    candidate: npt.NDArray[np.float32]
    base_s: float  # what the network's output multiplies
    predicted_s: float  # what the network in service predicted
    moved: bool  # a move's candidate: the switch iteration is left out


class OnlineTuner:
    """See the module doc. ``out``: the folder adapted weights are saved in (None: not
    saved); ``root``: the run directory state paths are relative to; ``source``: the
    shipped artifact's `describe` (its sha256 is the adapted weights' provenance)."""

    def __init__(
        self,
        predictor: Predictor,
        settings: OnlineSettings | None = None,
        *,
        out: Path | None = None,
        root: Path | None = None,
        source: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        self.predictor, self.settings = predictor, settings or OnlineSettings()
        self.out, self.root, self.source = out, root, dict(source or {})
        self._train = copy.deepcopy(predictor.network).train()
        self._shipped = copy.deepcopy(predictor.network).eval()
        self._opt = torch.optim.Adam(self._train.parameters(), lr=self.settings.lr)
        self._gen = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()  # samples and counters
        self._tuning: threading.Thread | None = None
        self._pending: list[_Pending] = []
        self._last: tuple[int, Encoded, list[tuple[int, ...]], list[float]] | None = None
        self._times: dict[int, tuple[float, tuple[int, ...]]] = {}
        self._samples: list[tuple[_Pending, float]] = []  # with the measured seconds
        self._scored: list[tuple[float, float]] = []  # |error| in service, shipped's
        self._new = 0  # samples labelled since the last round
        self.rounds, self.steps, self.cpu_s = 0, 0, 0.0
        self.round_cpu_s: list[float] = []
        self.saved: dict[str, Any] = {}  # the last save's reference (path, sha256, ...)
        self.error: str | None = None  # a restore that failed, and why

    # ------------------------------------------------------------------ samples
    def observed(
        self,
        obs: Observation,
        enc: Encoded,
        seconds: Sequence[float],
        bounds: Sequence[Sequence[int]],
        times: Mapping[int, float],
    ) -> None:
        """A decision encoded ``bounds`` (the partition in force first) as ``enc`` and
        predicted ``seconds``; ``times``: measured seconds per iteration under the
        partition in force. Labels what it can, and starts a round if any was new."""
        in_force = tuple(obs.bounds)
        with self._lock:
            for it, value in times.items():
                self._times[int(it)] = (float(value), in_force)
            keyed = [tuple(int(v) for v in b) for b in bounds]
            self._last = (obs.iteration, enc, keyed, list(seconds))
            self._pending.append(self._sample(obs.iteration, in_force, moved=False))
            self._resolve()
        self._maybe_tune()

    def planned(self, obs: Observation, bounds: Sequence[int]) -> None:
        """The decision at ``obs`` moves to ``bounds``: its encoding is a sample too."""
        key = tuple(int(v) for v in bounds)
        with self._lock:
            if self._last is not None and self._last[0] == obs.iteration and key in self._last[2]:
                self._pending.append(self._sample(obs.iteration, key, moved=True))

    def _sample(self, iteration: int, bounds: tuple[int, ...], *, moved: bool) -> _Pending:
        assert self._last is not None
        _, enc, keyed, seconds = self._last
        row = keyed.index(bounds)
        base = enc.base_s(self.predictor.config.target)
        return _Pending(
            iteration, bounds, enc.series, enc.static, enc.candidates[row],
            float(base[row]), float(seconds[row]), moved,
        )  # fmt: skip

    def _resolve(self) -> None:
        """Label the pending samples whose next ``horizon`` iterations are measured."""
        horizon = self.predictor.config.horizon
        latest = max(self._times, default=-1)
        still = []
        for p in self._pending:
            its = sorted(
                i for i, (_, b) in self._times.items() if i > p.iteration and b == p.bounds
            )
            its = its[1:] if p.moved else its
            if len(its) >= horizon and its[horizon - 1] - its[0] == horizon - 1:
                true = float(np.mean([self._times[i][0] for i in its[:horizon]]))
                self._label(p, true)
            elif latest <= p.iteration + 3 * horizon:
                still.append(p)
        self._pending = still
        keep = min((p.iteration for p in still), default=latest)
        self._times = {i: v for i, v in self._times.items() if i > keep}

    def _label(self, p: _Pending, true: float) -> None:
        with torch.inference_mode():
            out = self._shipped(
                torch.from_numpy(p.series)[None], torch.from_numpy(p.static)[None],
                torch.from_numpy(p.candidate)[None],
            )  # fmt: skip
        shipped = p.base_s * math.exp(float(out[0]))
        self._scored.append((abs(p.predicted_s / true - 1), abs(shipped / true - 1)))
        self._samples = [*self._samples, (p, true)][-self.settings.capacity :]
        self._new += 1

    # ------------------------------------------------------------------ tuning
    def _maybe_tune(self) -> None:
        if not self._new or (self._tuning is not None and self._tuning.is_alive()):
            return
        if not self.settings.background:
            self.tune()
            return
        self._tuning = threading.Thread(target=self._low, name="adaptipe-online", daemon=True)
        self._tuning.start()

    def _low(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: per thread
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        self.tune()

    def wait(self, timeout_s: float = 30.0) -> None:
        """Until a round in flight has finished (tests, evaluation, shutdown)."""
        if self._tuning is not None:
            self._tuning.join(timeout_s)

    def tune(self) -> int:
        """One round (see the module doc); the steps it took."""
        with self._lock:
            samples, self._new = list(self._samples), 0
        if not samples:
            return 0
        series = torch.from_numpy(np.stack([p.series for p, _ in samples]))
        static = torch.from_numpy(np.stack([p.static for p, _ in samples]))
        cand = torch.from_numpy(np.stack([p.candidate for p, _ in samples]))
        target = torch.tensor([math.log(t / p.base_s) for p, t in samples], dtype=torch.float32)
        cfg, n = self.settings, len(samples)
        most = cfg.passes * math.ceil(n / cfg.batch)
        start, steps = time.thread_time(), 0
        self._train.train()
        while steps < most and time.thread_time() - start < cfg.budget_s:
            idx = torch.randint(n, (min(cfg.batch, n),), generator=self._gen)
            loss = torch.nn.functional.l1_loss(
                self._train(series[idx], static[idx], cand[idx]), target[idx]
            )
            self._opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            self._opt.step()
            steps += 1
        used = time.thread_time() - start
        self.predictor.network = copy.deepcopy(self._train).eval()  # one swap: atomic
        with self._lock:
            self.rounds, self.steps = self.rounds + 1, self.steps + steps
            self.cpu_s += used
            self.round_cpu_s.append(used)
        return steps

    # ------------------------------------------------------------------ the run's record
    def summary(self) -> dict[str, Any]:
        """What the tuner has done, for the decision's inputs."""
        with self._lock:
            scored = list(self._scored)
            out: dict[str, Any] = {
                "samples": len(self._samples), "pending": len(self._pending),
                "rounds": self.rounds, "cpu_s": round(self.cpu_s, 4),
            }  # fmt: skip
        if scored:
            out["mape_in_service"] = round(float(np.mean([a for a, _ in scored])), 5)
            out["mape_shipped"] = round(float(np.mean([b for _, b in scored])), 5)
        if self.saved:
            out["weights"] = self.saved.get("path")
        if self.error:
            out["error"] = self.error
        return out

    @property
    def saved_path(self) -> Path | None:
        return self._resolve_path(self.saved["path"]) if self.saved else None

    def _resolve_path(self, path: str) -> Path:
        where = Path(path)
        return where if where.is_absolute() or self.root is None else self.root / where

    def save(self) -> dict[str, Any]:
        """Write the weights tuned since the last save (see the module doc); the
        reference to the newest saved weights ({} when none)."""
        if self.out is None or self.rounds == 0 or self.saved.get("rounds") == self.rounds:
            return dict(self.saved)
        from safetensors.torch import save as save_tensors

        from adaptipe.controllers.artifacts import describe, save_artifact

        network = self.predictor.network
        tensors = {k: v.detach().contiguous().clone() for k, v in network.state_dict().items()}
        folder = self.out / f"round-{self.rounds:06d}"
        n = 1
        while folder.exists():  # a resume from an older checkpoint: keep what newer ones name
            folder, n = self.out / f"round-{self.rounds:06d}-{n}", n + 1
        summary = self.summary()
        save_artifact(
            folder,
            model=MODEL,
            format=FORMAT,
            files={
                "weights.safetensors": save_tensors(tensors),
                "config.json": config_bytes(self.predictor.config),
            },
            training={
                "adapted_from": self.source,
                "online": asdict(self.settings),
                "rounds": self.rounds,
                "steps": self.steps,
                "cpu_s": round(self.cpu_s, 4),
            },
            metrics={k: v for k, v in summary.items() if k.startswith("mape")},
        )
        rel = (
            folder.relative_to(self.root)
            if self.root and folder.is_relative_to(self.root)
            else folder
        )
        self.saved = {
            "path": str(rel), "sha256": describe(folder)["sha256"], "rounds": self.rounds,
        }  # fmt: skip
        return dict(self.saved)

    def state_dict(self) -> dict[str, Any]:
        return self.save()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Serve with the adapted weights ``state`` references (a resume), checked by
        the manifest's sha256; on failure keep the shipped ones and say why (`summary`)."""
        if not state.get("path"):
            return
        from adaptipe.controllers.artifacts import describe
        from adaptipe.controllers.predictor import load_predictor

        where = self._resolve_path(str(state["path"]))
        try:
            digest = describe(where)["sha256"]
            if digest != state.get("sha256"):
                raise PlanError(f"{where}: manifest sha256 {digest[:16]}... is not the state's")
            loaded = load_predictor(where)
        except (OSError, ValueError) as exc:  # PlanError is a ValueError
            self.error = f"adapted weights not restored ({exc}): the shipped ones serve"
            return
        if loaded.config != self.predictor.config:
            self.error = f"{where}: built for another predictor config: the shipped ones serve"
            return
        self.predictor.network = loaded.network
        self._train.load_state_dict(loaded.network.state_dict())
        self.rounds = int(state.get("rounds", 0))
        self.saved = {k: state[k] for k in ("path", "sha256", "rounds") if k in state}
