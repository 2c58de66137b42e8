"""The child process in which `adaptipe.inject.collect` times a stage under interference.

It is a process of its own so that it can be pinned to one core with one torch thread
(the hogs target that core) and so that the collector, which never imports torch, stays
out of the measurement. The collector drives it through :class:`StageProbe`: one JSON
request per line on stdin (build a stage, measure it), one JSON reply per line on
stdout. Building a stage reports its features (:data:`STAGE_FEATURES`); measuring it
reports per-window step times and the device features sampled during the windows.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from adaptipe.errors import AdaptipeError
from adaptipe.monitor.features import FEATURES

__all__ = [
    "KIND_VOCABULARY",
    "STAGE_FEATURES",
    "VARIANTS",
    "CollectError",
    "StageProbe",
    "start_probe",
]

#: Layer kinds counted per stage; a kind outside the list counts as "Other".
KIND_VOCABULARY = ("Linear", "Conv", "Block", "Embedding", "Head", "Classifier")
STAGE_FEATURES: tuple[str, ...] = (
    "stage_params",
    "stage_flops",
    "stage_input_bytes",
    "stage_activation_bytes",
    "stage_stash_bytes",
    "stage_layers",
    "stage_microbatch",
    *(f"stage_n_{k.lower()}" for k in (*KIND_VOCABULARY, "Other")),
)
_REPLY_TIMEOUT_S = 180.0

# Model variants (config overrides) with the micro-batch sizes that keep a full-model step
# under ~50 ms on one core; stages are slices, so most steps are shorter.
VARIANTS: dict[str, tuple[tuple[dict[str, int], tuple[int, ...]], ...]] = {
    "mlp": (({}, (16, 64, 256)), ({"hidden": 128}, (16, 64, 256)), ({"hidden": 512}, (16, 64))),
    "gpt": (({}, (1, 2, 4, 8)), ({"d_model": 64}, (2, 4, 8)), ({"n_layer": 6}, (1, 2, 4))),
    "cnn": (({}, (8, 32, 128)), ({"width": 2}, (8, 16, 32))),
}


class CollectError(AdaptipeError, RuntimeError):
    """The measuring process died, did not start, or stopped answering."""


def _worker_main() -> None:
    """The stage process: ``python -c '...' CORE``; JSON requests on stdin, replies on stdout."""
    core = int(sys.argv[1])
    os.sched_setaffinity(0, {core})
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)

    def send(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg) + "\n")

    from adaptipe.models import get_model

    layers = {m: [get_model(m, **c).num_layers for c, _ in v] for m, v in VARIANTS.items()}
    send({"op": "hello", "pid": os.getpid(), "torch": torch.__version__, "layers": layers})
    step: Callable[[], None] | None = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "stage":
                step, features = _build_stage(msg)
                send({"op": "stage", **features})
            else:
                assert step is not None, "measure before stage"
                send({"op": "measured", **_measure(step, msg["windows"], msg["window_s"])})
        except Exception as exc:
            send({"op": "error", "error": f"{type(exc).__name__}: {exc}"})


def _build_stage(msg: dict[str, Any]) -> tuple[Callable[[], None], dict[str, Any]]:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from adaptipe.models import get_model

    spec = get_model(msg["model"], **msg["config"])
    start, stop, seed = msg["start"], msg["stop"], msg["seed"]
    x, target = spec.dataset().sample_batch(msg["microbatch"], seed=seed)
    with torch.no_grad():
        inp = spec.build(0, start, seed=seed)(x).detach() if start else x
    if start and inp.is_floating_point():
        inp.requires_grad_(True)  # a later stage sends its input's gradient back
    stage = spec.build(start, stop, seed=seed)
    params = list(stage.parameters())
    last = stop == spec.num_layers
    opt = torch.optim.SGD(params, lr=1e-4, foreach=False) if params else None
    with torch.no_grad():
        out = stage(inp)
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(out.shape, generator=gen, dtype=out.dtype)

    def step() -> None:
        y = stage(inp)
        if last:
            torch.autograd.backward(spec.loss(y, target))
        else:
            torch.autograd.backward(y, grad)
        inp.grad = None
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    ptrs = {p.untyped_storage().data_ptr() for p in params}
    stash: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in ptrs:
            stash[ptr] = max(stash.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(inp)
    step()
    with FlopCounterMode(display=False) as flops:
        step()
    began, steps = time.perf_counter(), 0
    while steps < 3 or time.perf_counter() - began < 0.1:  # warm up, estimate the step
        step()
        steps += 1
    kinds = spec.layer_kinds()[start:stop]
    counts = {f"stage_n_{k.lower()}": kinds.count(k) for k in KIND_VOCABULARY}
    counts["stage_n_other"] = sum(k not in KIND_VOCABULARY for k in kinds)
    features = {
        "stage_params": sum(p.numel() for p in params),
        "stage_flops": int(flops.get_total_flops()),
        "stage_input_bytes": inp.numel() * inp.element_size(),
        "stage_activation_bytes": out.numel() * out.element_size(),
        "stage_stash_bytes": sum(stash.values()),
        "stage_layers": stop - start,
        "stage_microbatch": msg["microbatch"],
        **counts,
    }
    return step, {"features": features, "step_s": (time.perf_counter() - began) / steps}


def _measure(step: Callable[[], None], windows: int, window_s: float) -> dict[str, Any]:
    """Per-step time of each window, and the device features averaged over the windows."""
    from adaptipe.monitor.device import sample_device
    from adaptipe.monitor.features import feature_vector

    sample_device()  # rates in the next sample cover the first window only
    times, vectors = [], []
    for _ in range(windows):
        began, steps = time.perf_counter(), 0
        while True:
            step()
            steps += 1
            elapsed = time.perf_counter() - began
            if elapsed >= window_s:
                break
        times.append(elapsed / steps)
        vectors.append(feature_vector(sample_device()))
    mean = [sum(v[i] for v in vectors) / len(vectors) for i in range(len(FEATURES))]
    return {"step_s": times, "features": mean}


class StageProbe:
    """The stage process seen from the collector: requests out, replies in, with timeouts."""

    def __init__(self, core: int) -> None:
        root = Path(__file__).resolve().parents[2]  # the folder holding the adaptipe package
        path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 (close() closes it)
        code = "from adaptipe.inject.stage_probe import _worker_main; _worker_main()"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, str(core)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the collector, which ends this cleanly
        )
        self.pid = self._proc.pid
        try:
            self.hello = self._reply("hello")
        except BaseException:
            self.close()
            raise

    def request(self, msg: dict[str, Any], expect: str) -> dict[str, Any]:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write((json.dumps(msg) + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        return self._reply(expect)

    def _reply(self, expect: str) -> dict[str, Any]:
        out = self._proc.stdout
        assert out is not None
        readable, _, _ = select.select([out], [], [], _REPLY_TIMEOUT_S)
        if not readable:
            raise CollectError(f"stage process {self.pid} did not answer in {_REPLY_TIMEOUT_S} s")
        line = out.readline()
        if not line:
            raise self._died()
        reply: dict[str, Any] = json.loads(line)
        if reply["op"] == "error":
            raise CollectError(f"stage process {self.pid}: {reply['error']}")
        assert reply["op"] == expect, reply
        return reply

    def _died(self) -> CollectError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        self._errors.seek(0)
        lines = self._errors.read().decode(errors="replace").strip().splitlines()
        why = f": {lines[-1]}" if lines else ""
        return CollectError(f"stage process {self.pid} exited ({self._proc.returncode}){why}")

    def close(self) -> None:
        """End the process (EOF, then SIGKILL after 5 s) and reap it."""
        if self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._errors.close()


@contextlib.contextmanager
def start_probe(core: int) -> Iterator[StageProbe]:
    """The stage process pinned to ``core`` for a ``with`` block; ended and reaped after it."""
    worker = StageProbe(core)
    try:
        yield worker
    finally:
        worker.close()
