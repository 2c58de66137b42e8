"""DynPipe's interference model: a random forest from a stage's device status and static
features to its slowdown ratio against a solo run (DynPipe §V-A: 128 trees).

Inputs (`INPUTS`, in order): the device feature vector of `adaptipe.monitor.features`
(`FEATURES`, as the runtime's `Observation.device` rows carry it), then the stage's
static features (`StageInfo`), which a profile gives for any candidate stage:

=================  ==========================================================================
stage_solo_ms      log1p of the stage's solo compute per micro-batch in ms (profile: forward
                   + backward of its layers; collect CSV: ``baseline_step_s``)
stage_layers       layers in the stage
stage_in_mib       log1p of the input activation's MiB (what the stage receives)
stage_out_mib      log1p of the output activation's MiB (what it sends)
stage_param_mib    log1p of the parameters' MiB (memory and cache pressure)
=================  ==========================================================================

The stage's measured recent slowdown is *not* an input: the forest is asked what a
stage (possibly one a re-partition has not built yet) would suffer on a device in this
state, and "the last measured slowdown" is the stale-information baseline it is judged
against (`adaptipe.envs.interference_cv`).

Prediction does not go through scikit-learn's ``predict``, whose per-call overhead
(input validation, a joblib dispatch over the trees) is about a millisecond even with
``n_jobs=1``: the fitted trees are packed into flat arrays once and every row descends
all 128 trees at once, one numpy step per level (`_PackedForest`), with the same result
(batches of 256 rows and more go to scikit-learn, faster in bulk).

The artifact (model ``interference``) is the scikit-learn forest as a skops file, loaded
only with an explicit list of trusted types (`TRUSTED_TYPES`): nothing else in the file
can be instantiated, and no pickle runs.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from adaptipe.controllers.artifacts import load_artifact, shipped
from adaptipe.errors import PlanError
from adaptipe.monitor.features import FEATURES, feature_vector
from adaptipe.monitor.schema import DeviceSample
from adaptipe.profile.types import Profile

__all__ = [
    "FOREST_PARAMS",
    "INPUTS",
    "InterferenceModel",
    "StageInfo",
    "features",
    "load_interference",
    "stage_info",
]

Array = npt.NDArray[np.float64]
MODEL = "interference"
FORMAT = 1
FOREST_FILE = "forest.skops"
_MIB = float(2**20)
_BULK_ROWS = 256  # from here on scikit-learn's predict is faster (bench_interference)

#: The forest's hyper-parameters. 128 trees as DynPipe; leaves of at least 8 rows and
#: at most 12 levels keep the shipped file small (0.7 MB deflated on 48k rows) and the
#: packed descent short (docs/interference.md).
FOREST_PARAMS: dict[str, Any] = {
    "n_estimators": 128,
    "max_depth": 12,
    "min_samples_leaf": 8,
    "max_features": 1.0,
}

#: The types the skops file may instantiate beyond skops' own safe defaults (builtins,
#: numpy arrays and dtypes): a fitted forest's. The Tree is the one skops does not trust
#: by default; the estimators are named so that a skops release that stops trusting
#: scikit-learn estimators by default still loads exactly these.
TRUSTED_TYPES: tuple[str, ...] = (
    "sklearn.ensemble._forest.RandomForestRegressor",
    "sklearn.tree._classes.DecisionTreeRegressor",
    "sklearn.tree._tree.Tree",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInfo:
    """A stage's static features (see the module doc); bytes and seconds per micro-batch."""

    NAMES: ClassVar[tuple[str, ...]] = (
        "stage_solo_ms",
        "stage_layers",
        "stage_in_mib",
        "stage_out_mib",
        "stage_param_mib",
    )

    solo_s: float
    layers: int
    input_bytes: float
    output_bytes: float
    param_bytes: float

    def vector(self) -> Array:
        return np.array(
            [
                math.log1p(max(self.solo_s, 0.0) * 1e3),
                float(self.layers),
                math.log1p(max(self.input_bytes, 0.0) / _MIB),
                math.log1p(max(self.output_bytes, 0.0) / _MIB),
                math.log1p(max(self.param_bytes, 0.0) / _MIB),
            ]
        )


INPUTS: tuple[str, ...] = (*FEATURES, *StageInfo.NAMES)


def stage_info(profile: Profile, bounds: Sequence[int], stage: int) -> StageInfo:
    """Stage ``stage`` of the partition ``bounds`` of ``profile``'s model."""
    if not 0 <= stage < len(bounds) - 1:
        raise PlanError(f"stage_info: stage {stage} not in 0..{len(bounds) - 2}")
    lo, hi = int(bounds[stage]), int(bounds[stage + 1])
    layers = profile.layers[lo:hi]
    if not layers:
        raise PlanError(f"stage_info: stage {stage} of {list(bounds)} holds no layer")
    return StageInfo(
        solo_s=sum(x.forward_s + x.backward_s for x in layers),
        layers=hi - lo,
        input_bytes=float(
            profile.input_bytes if lo == 0 else profile.layers[lo - 1].activation_bytes
        ),
        output_bytes=float(layers[-1].activation_bytes),
        param_bytes=float(sum(x.param_bytes for x in layers)),
    )


def features(device: DeviceSample | Sequence[float] | Array, stage: StageInfo) -> Array:
    """The model's input row (`INPUTS`) for one stage: its device status (a sample, or its
    `feature_vector` as in `Observation.device`) then ``stage``'s features."""
    vec = feature_vector(device) if isinstance(device, DeviceSample) else np.asarray(device, float)
    if vec.shape != (len(FEATURES),):
        raise PlanError(f"features: a device row has {len(FEATURES)} values (got {vec.shape})")
    return np.concatenate([vec, stage.vector()])


class _PackedForest:
    """The fitted trees as flat arrays; `predict` equals the forest's, without its overhead."""

    def __init__(self, trees: Sequence[Any]) -> None:
        offsets = np.cumsum([0, *(t.node_count for t in trees)])
        leaf = np.concatenate([t.children_left == -1 for t in trees])
        index = np.arange(offsets[-1])
        # a leaf points at itself and always goes "left": the descent's fixed point
        self.left = np.where(
            leaf,
            index,
            np.concatenate([t.children_left + o for t, o in zip(trees, offsets, strict=False)]),
        )
        self.right = np.where(
            leaf,
            index,
            np.concatenate([t.children_right + o for t, o in zip(trees, offsets, strict=False)]),
        )
        self.feature = np.where(leaf, 0, np.concatenate([t.feature for t in trees]))
        self.threshold = np.where(leaf, np.inf, np.concatenate([t.threshold for t in trees]))
        self.value = np.concatenate([t.value[:, 0, 0] for t in trees])
        self.roots = offsets[:-1]
        self.depth = max(t.max_depth for t in trees)

    def predict(self, x: Array) -> Array:
        # scikit-learn compares float32 inputs with float64 thresholds
        x = np.asarray(x, dtype=np.float32).astype(np.float64)
        node = np.broadcast_to(self.roots, (len(x), len(self.roots)))
        rows = np.arange(len(x))[:, None]
        for _ in range(self.depth):
            go_left = x[rows, self.feature[node]] <= self.threshold[node]
            node = np.where(go_left, self.left[node], self.right[node])
        out: Array = self.value[node].mean(axis=1)
        return out


class InterferenceModel:
    """A fitted forest: `predict` maps `INPUTS` rows to slowdown ratios (>= 1 is slower)."""

    def __init__(self, forest: Any, *, training: dict[str, Any] | None = None,
                 metrics: dict[str, Any] | None = None) -> None:  # fmt: skip
        if getattr(forest, "n_features_in_", None) != len(INPUTS):
            raise PlanError(
                f"interference model: the forest takes {getattr(forest, 'n_features_in_', '?')} "
                f"inputs, this adaptipe builds {len(INPUTS)}; retrain it with `adaptipe "
                "controllers train interference`"
            )
        self.forest = forest
        self.training = dict(training or {})
        self.metrics = dict(metrics or {})
        self._packed = _PackedForest([e.tree_ for e in forest.estimators_])

    @classmethod
    def fit(cls, x: Array, y: Array, *, seed: int) -> InterferenceModel:
        from sklearn.ensemble import RandomForestRegressor

        forest = RandomForestRegressor(**FOREST_PARAMS, n_jobs=1, random_state=seed)
        return cls(forest.fit(x, y))

    def predict(self, rows: Array | Sequence[Sequence[float]]) -> Array:
        """Slowdown per row of ``rows`` (``(n, len(INPUTS))``, or one row)."""
        x = np.asarray(rows, dtype=np.float64)
        one = x.ndim == 1
        x = x.reshape(1, -1) if one else x
        if x.ndim != 2 or x.shape[1] != len(INPUTS):
            raise PlanError(f"interference model: rows of {len(INPUTS)} inputs (got {x.shape})")
        if len(x) >= _BULK_ROWS:  # the descent's fancy indexing loses to sklearn's loops
            return np.asarray(self.forest.predict(x), dtype=np.float64)
        return self._packed.predict(x)

    def to_bytes(self) -> bytes:
        import skops.io as sio  # type: ignore[import-untyped]

        return bytes(sio.dumps(self.forest, compression=zipfile.ZIP_DEFLATED, compresslevel=9))

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = FOREST_FILE, **meta: Any) -> InterferenceModel:
        """The forest in a skops file; any type outside `TRUSTED_TYPES` is refused."""
        import skops.io as sio

        try:
            forest = sio.loads(data, trusted=list(TRUSTED_TYPES))
        except Exception as exc:  # skops raises UntrustedTypesFoundException, zip and key errors
            raise PlanError(
                f"{where}: not a loadable interference forest ({type(exc).__name__}: {exc}); "
                "retrain it with `adaptipe controllers train interference`"
            ) from None
        from sklearn.ensemble import RandomForestRegressor

        if not isinstance(forest, RandomForestRegressor):
            raise PlanError(
                f"{where}: holds a {type(forest).__name__}, not a RandomForestRegressor; "
                "retrain it with `adaptipe controllers train interference`"
            )
        return cls(forest, **meta)


def load_interference(path: str | Path | None = None) -> InterferenceModel:
    """The artifact in ``path`` (default: the shipped one), checked (`load_artifact`)."""
    root = Path(path) if path is not None else shipped(MODEL)
    art = load_artifact(root, model=MODEL, format=FORMAT)
    if FOREST_FILE not in art.files:
        raise PlanError(f"{root}: the artifact has no {FOREST_FILE}")
    return InterferenceModel.from_bytes(
        art.files[FOREST_FILE], where=str(root / FOREST_FILE),
        training=dict(art.training), metrics=dict(art.metrics),
    )  # fmt: skip
