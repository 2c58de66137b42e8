"""The learned chain: ``[adapt] controller = "ppo"`` live (issue 22, AutoPipe §4).

One decision runs, on one `Observation`:

1. **interference** (`adaptipe.controllers.interference`, DynPipe's forest): per stage
   in force, the slowdown its device's status predicts for the layers it holds;
2. **slowdowns** (`combine`): per stage the measured one (the window's median, what
   `adaptipe.controllers.replan.stage_slowdowns` gives), except

   - a stage the window did not measure (fewer than half its iterations carry the
     stage's layer times: *stale*) takes the forest's, where it has one;
   - a co-located load arriving at the end of the window, which the median still
     hides, is *anticipated* where two signals agree: the last two iterations' measured
     slowdowns (the smaller of them) and the forest's all above the median by more than
     `RISE`; the stage then takes the smaller of the two signals;

3. **candidates** (`adaptipe.controllers.candidates.top_k`): the best `CANDIDATES`
   partitions on those slowdowns by the simulator;
4. **predictor** (`adaptipe.controllers.predictor`, AutoPipe's meta-network): the mean
   seconds per iteration over its horizon for the partition in force and each
   candidate; the best candidate is the one it predicts fastest;
5. **policy** (`adaptipe.controllers.switch_policy`, AutoPipe's arbiter): keep or move
   to that candidate. It reads the encoded observation
   (`adaptipe.controllers.encode`) with the candidate's seconds as the predictor's
   ratio to the partition in force times the analytic in-force seconds, the units it
   was trained on. No candidate predicted at least ``min_gain`` faster than the
   partition in force: keep, without asking it. Live, ``min_gain`` comes from
   ``[adapt].margin`` as the threshold controller reads it (in force at least
   ``1 + margin`` times the best: ``margin / (1 + margin)`` of the in-force seconds,
   1/6 at the default 0.2); `MIN_GAIN` (5%) is the floor the held-out scores were
   measured with. On the quiet-machine bench (docs/benchmarks.md, session 15) 5% let
   the chain move before any slowdown, on slowdowns that were the run's offset from
   its profile. A smaller difference is within the
   predictor's error (0.4-6.3% MAPE on the held-out traces, 11-13% on the recorded
   runs, docs/predictor.md), and on a real run the policy moved for one: in the first
   live run of the chain (tiny MLP, 4 stages, nothing injected yet) it moved for a
   predicted 0.8% and the next window measured 69% slower, the switch included.

A check whose measured iteration is more than twice what the model's usual factor puts
the partition in force at keeps, waiting for the telemetry of what slowed it
(`adaptipe.controllers.model_lag`): a link's first readings after a step come a check
after its slow iterations.

Where a model cannot serve, the chain falls back and says so in the decision's
``inputs["fallbacks"]``: no forest or no device status on this run (measured
slowdowns only); no predictor or one trained for another pipeline (the simulator's
seconds rank the candidates). The optional `adaptipe.controllers.online.OnlineTuner`
fine-tunes the predictor on the run's own measurements between decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptipe.controllers.base import Decision
from adaptipe.controllers.candidates import score, top_k
from adaptipe.controllers.encode import encode
from adaptipe.controllers.model_lag import ModelLag
from adaptipe.controllers.observation import Observation
from adaptipe.controllers.recall import Recall, measured_iteration_s
from adaptipe.controllers.replan import (
    latest_ratios,
    predicted_time,
    stage_ratios,
    stage_slowdowns,
)
from adaptipe.errors import PlanError

if TYPE_CHECKING:
    from adaptipe.controllers.interference import InterferenceModel, StageInfo
    from adaptipe.controllers.online import OnlineTuner
    from adaptipe.controllers.predictor import Predictor
    from adaptipe.controllers.switch_policy import SwitchPolicy

__all__ = ["CANDIDATES", "MIN_GAIN", "RISE", "Chain", "combine", "forest_slowdowns"]

CANDIDATES = 4  # the simulator's best partitions the predictor ranks (bench: 4 + in force)
RISE = 0.25  # a load is anticipated when latest and forest both exceed the median by this
MIN_GAIN = 0.05  # a move predicted to save less (a fraction of the in-force seconds): keep


def _ms(seconds: float) -> float | None:
    return round(seconds * 1e3, 3) if math.isfinite(seconds) else None


def _stage_info(obs: Observation, stage: int) -> StageInfo:
    """The forest's static features of a stage in force, from the observation alone: its
    profiled seconds and layers; the activation half of what the cuts around it carry
    (`adaptipe.controllers.candidates.layer_costs`' split; 0 into the first stage, whose
    input the observation does not hold); half its state bytes as parameters (the
    observation carries parameters plus optimizer state)."""
    from adaptipe.controllers.interference import StageInfo

    lo, hi = obs.bounds[stage], obs.bounds[stage + 1]
    cut = obs.boundary_bytes
    return StageInfo(
        solo_s=sum(obs.layer_forward_s[lo:hi]) + sum(obs.layer_backward_s[lo:hi]),
        layers=hi - lo,
        input_bytes=float(cut[lo - 1] - cut[lo - 1] // 2) if lo > 0 else 0.0,
        output_bytes=float(cut[hi - 1] - cut[hi - 1] // 2),
        param_bytes=sum(obs.state_bytes[lo:hi]) / 2,
    )


def forest_slowdowns(
    model: InterferenceModel, obs: Observation
) -> tuple[list[float | None], str | None]:
    """Per stage in force, the forest's slowdown (None for a stage without a device
    sample); and why it gave none at all (no device status), else None."""
    from adaptipe.controllers.interference import features

    rows = [tuple(r) for r in obs.device[: obs.num_stages]]
    have = [s for s, row in enumerate(rows) if any(v != 0 for v in row)]
    if not have:
        return [None] * obs.num_stages, "interference: no device status on this run"
    predicted = model.predict(np.stack([features(rows[s], _stage_info(obs, s)) for s in have]))
    out: list[float | None] = [None] * obs.num_stages
    for s, value in zip(have, predicted, strict=True):
        out[s] = float(value)
    return out, None


def combine(
    measured: Sequence[float],
    latest: Sequence[float],
    forest: Sequence[float | None],
    fresh: Sequence[bool],
) -> tuple[list[float], list[str]]:
    """Per stage the slowdown the candidates are listed on, and where it came from
    (``measured``, ``forest`` for a stale stage, ``anticipated``): the rule of the
    module doc."""
    out, source = [], []
    for m, last, f, ok in zip(measured, latest, forest, fresh, strict=True):
        if not ok and f is not None:
            out.append(f)
            source.append("forest")
        elif ok and f is not None and min(last, f) > m * (1 + RISE):
            out.append(min(last, f))
            source.append("anticipated")
        else:
            out.append(m)
            source.append("measured")
    return out, source


class Chain:
    """The learned chain as a `Controller` ("ppo"): see the module doc. ``predictor``
    and ``interference`` may be None (the chain falls back); ``why`` names models that
    could not be loaded, logged with every decision; ``switch_folder`` is where
    ``policy`` was loaded from (`artifacts`)."""

    name = "ppo"

    def __init__(
        self,
        policy: SwitchPolicy,
        *,
        predictor: Predictor | None = None,
        interference: InterferenceModel | None = None,
        tuner: OnlineTuner | None = None,
        candidates: int = CANDIDATES,
        why: Sequence[str] = (),
        switch_folder: Path | None = None,
        min_gain: float = MIN_GAIN,
        recall: Recall | None = None,
        lag: ModelLag | None = None,
    ) -> None:
        self.policy, self.predictor, self.interference = policy, predictor, interference
        self.recall = recall
        self.lag = lag if lag is not None else ModelLag()
        self.min_gain = min_gain
        self.switch_folder = switch_folder
        self.tuner, self.k, self.why = tuner, candidates, list(why)

    def decide(self, observation: Observation) -> Decision:
        return self.explain(observation)[0]

    def settled(self) -> bool:
        """The same readings give the same decision (`adaptipe.controllers.unchanged`):
        the chain keeps no count between checks; an online tuner changes its weights; a
        check that waited for the model decides again at the next."""
        return self.tuner is None and not self.lag.waited

    def explain(
        self, obs: Observation, *, times: Mapping[int, float] | None = None
    ) -> tuple[Decision, dict[str, Any]]:
        """The decision and what it was made on (the event's ``inputs["chain"]``).
        ``times``: the measured seconds of each iteration under the partition in force
        (the online tuner's labels)."""
        if obs.num_stages != self.policy.config.stages:
            raise PlanError(
                f"ppo: the policy was trained for {self.policy.config.stages} stages, the "
                f"observation has {obs.num_stages}"
            )
        fallbacks = list(self.why)
        slow, info = self._slowdowns(obs, fallbacks)
        current = predicted_time(obs, obs.bounds, slow) * obs.microbatches
        measured = measured_iteration_s(obs)
        usual = self.lag.wait(measured, current)
        found = top_k(obs, slow, self.k)
        if self.recall is not None:  # measured partitions are candidates too
            have = {b for b, _ in found} | {tuple(obs.bounds)}
            extra = [b for b in self.recall.known(obs, slow) if b not in have]
            found = [*found, *score(obs, extra, slow)] if extra else found
        info["fallbacks"] = fallbacks
        if self.tuner is not None:
            info["online"] = self.tuner.summary()
        if not found:
            return Decision(reason="ppo keeps: no other partition"), info
        cands = [b for b, _ in found]
        predicted = self._predict(obs, cands, fallbacks, times)
        if predicted is None:  # the simulator ranks them, on the combined slowdowns
            now = score(obs, [obs.bounds], slow)[0][1]
            predicted = [now, *(t for _, t in found)]
            info["ranked_by"] = "simulator"
        else:
            info["ranked_by"] = "predictor"
        now_s, cand_s = predicted[0], predicted[1:]
        if self.recall is not None:
            self.recall.observe(obs, slow)
            cand_s = [
                self.recall.corrected(obs, b, t, in_force_s=now_s, slowdowns=slow)
                for b, t in zip(cands, cand_s, strict=True)
            ]
            # what the partitions held under these conditions measured (ms)
            info["recalled_ms"] = self.recall.measured(obs, slow)
            info["left_ms"] = self.recall.left_ms(obs, slow)  # the revisit guard's
        best = min(range(len(cands)), key=lambda i: (cand_s[i], cands[i]))
        gain = now_s - cand_s[best]
        info |= {
            "candidates": [
                {"bounds": list(b), "simulated_ms": _ms(t), "predicted_ms": _ms(p)}
                for (b, t), p in zip(found, cand_s, strict=True)
            ],
            "in_force_predicted_ms": _ms(now_s),
            "best": list(cands[best]),
            "predicted_gain_ms": _ms(gain),
        }
        if not gain > self.min_gain * now_s:
            info["chosen"] = None
            why = f"ppo keeps: no candidate predicted {self.min_gain:.0%} faster"
            return Decision(reason=why), info
        if usual is not None and measured is not None:  # a wait had a measurement
            info["chosen"] = None
            why = (
                f"ppo waits a check: measured {measured / current:.1f}x the model's figure for the "
                f"partition in force against {usual:.1f}x at the checks before"
            )
            return Decision(reason=why), info
        action = self.policy.act(encode(obs, [cand_s[best] / now_s * current], slowdowns=slow))
        info["policy_action"] = action
        if action != 1:
            info["chosen"] = None
            return Decision(reason=f"ppo keeps (action {action})", predicted_gain_s=gain), info
        bounds = cands[best]
        info["chosen"] = list(bounds)
        if self.tuner is not None:
            self.tuner.planned(obs, bounds)
        why = f"ppo moves to {list(bounds)} ({cand_s[best] * 1e3:.1f} ms, {info['ranked_by']})"
        return Decision(bounds=bounds, reason=why, predicted_gain_s=gain), info

    def _slowdowns(
        self, obs: Observation, fallbacks: list[str]
    ) -> tuple[list[float], dict[str, Any]]:
        measured = list(stage_slowdowns(obs))
        ratios = stage_ratios(obs)
        need = max(1, len(ratios) // 2)
        fresh = [sum(math.isfinite(r[s]) for r in ratios) >= need for s in range(obs.num_stages)]
        last = latest_ratios(ratios, obs.num_stages)
        latest = [v if math.isfinite(v) else m for v, m in zip(last, measured, strict=True)]
        forest: list[float | None] = [None] * obs.num_stages
        if self.interference is not None:
            forest, why = forest_slowdowns(self.interference, obs)
            if why is not None:
                fallbacks.append(why)
        slow, source = combine(measured, latest, forest, fresh)
        info: dict[str, Any] = {
            "measured_slowdowns": [round(v, 3) for v in measured],
            "latest_slowdowns": [round(v, 3) for v in latest],
            "forest_slowdowns": [None if v is None else round(v, 3) for v in forest],
            "slowdowns": [round(v, 3) for v in slow],
            "sources": source,
        }
        return slow, info

    def _predict(
        self,
        obs: Observation,
        cands: Sequence[tuple[int, ...]],
        fallbacks: list[str],
        times: Mapping[int, float] | None,
    ) -> list[float] | None:
        """The predictor's seconds for the partition in force then ``cands``; None (and
        why, in ``fallbacks``) where it cannot serve."""
        if self.predictor is None:
            return None
        cfg = self.predictor.config
        if (obs.num_layers, obs.num_stages) != (cfg.layers, cfg.stages):
            fallbacks.append(
                f"predictor: trained for {cfg.layers} layers on {cfg.stages} stages, the "
                f"run has {obs.num_layers} on {obs.num_stages}: the simulator ranks"
            )
            return None
        try:
            seconds, enc = self.predictor.predict_encoded(obs, [obs.bounds, *cands])
        except PlanError as exc:
            fallbacks.append(f"predictor: {exc}: the simulator ranks")
            return None
        if self.tuner is not None:
            self.tuner.observed(obs, enc, seconds, [obs.bounds, *cands], times or {})
        if not all(math.isfinite(v) and v > 0 for v in seconds):
            fallbacks.append("predictor: a non-finite prediction: the simulator ranks")
            return None
        return seconds

    def artifacts(self) -> list[Path]:
        """The folders of the models it decides with (predictor: the adapted weights
        once a resume restored or a checkpoint saved them)."""
        from adaptipe.controllers.artifacts import shipped

        out = [self.switch_folder or shipped("switch")]
        if self.predictor is not None:
            adapted = self.tuner.saved_path if self.tuner is not None else None
            out.append(adapted if adapted is not None else shipped("predictor"))
        if self.interference is not None:
            out.append(shipped("interference"))
        return out

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lag": self.lag.state_dict()}
        if self.tuner is not None:
            out["online"] = self.tuner.state_dict()
        if self.recall is not None:
            out["recall"] = self.recall.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tuner is not None and isinstance(state.get("online"), dict):
            self.tuner.load_state_dict(state["online"])
        if self.recall is not None and isinstance(state.get("recall"), dict):
            self.recall.load_state_dict(state["recall"])
        if isinstance(state.get("lag"), dict):
            self.lag.load_state_dict(state["lag"])
