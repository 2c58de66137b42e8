"""The layer profiler (PipeDream §2.4.1): time and bytes of every layer, measured.

Each layer is timed on its own, fed the real activation the layers before it produce
for one micro-batch of the model's own data. Forward and backward times are medians of
``repeats`` runs after ``warmup`` runs; the last layer's times include the loss, since
the last stage computes it. As in the runtime, the first layer computes no gradient
w.r.t. the model's input. Bytes come from the tensors themselves: the output (sent
forward), the gradient w.r.t. the input (sent backward), and what autograd saves for
backward (the activation stash), found with ``saved_tensors_hooks``.

For runs with batched weight gradients (`adaptipe.profile.wgrad`), ``wgrad_microbatches``
> 0 also times each layer's backward with its Linear weight gradients deferred, and the
deferred weight gradients of that many micro-batches computed at once, as the stage
does before its optimizer step.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from adaptipe.errors import PlanError
from adaptipe.profile.types import LayerProfile, Profile
from adaptipe.profile.wgrad import WeightGradStash, defer_weight_grads

if TYPE_CHECKING:
    from adaptipe.models import ModelSpec

__all__ = ["OPTIMIZER_STATE_FACTOR", "profile_model", "resolve_device"]

# Optimizer state per parameter byte: plain SGD keeps none, momentum one buffer, Adam two.
OPTIMIZER_STATE_FACTOR: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}

ProgressFn = Callable[[int, int, str], None]


def resolve_device(device: str) -> torch.device:
    """Parse a device string; asking for CUDA without a usable GPU is a clear error."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise PlanError(
            f"device {device!r} is not a device name (allowed: cpu, cuda, cuda:N)"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PlanError(
            f"device {device!r} asked for, but no CUDA device is available here (use --device cpu)"
        )
    if dev.type not in ("cpu", "cuda"):
        raise PlanError(f"device {device!r} is not supported (allowed: cpu, cuda, cuda:N)")
    return dev


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _SavedBytes:
    """Counts distinct non-parameter storages autograd saves for backward."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.params:
                self.storages[ptr] = max(self.storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _time_layer(
    run: Callable[[], torch.Tensor],
    grad_for: Callable[[torch.Tensor], torch.Tensor | None],
    *,
    warmup: int,
    repeats: int,
    device: torch.device,
) -> tuple[float, float]:
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = run()
        _sync(device)
        t1 = time.perf_counter()
        grad = grad_for(out)  # drawn outside the timed backward: a large randn takes ~0.4 ms
        _sync(device)
        t2 = time.perf_counter()
        torch.autograd.backward(out, grad)
        _sync(device)
        t3 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
    return statistics.median(fwd), statistics.median(bwd)


def _time_deferred(
    layer: torch.nn.Module,
    run: Callable[[], torch.Tensor],
    grad_for: Callable[[torch.Tensor], torch.Tensor | None],
    *,
    microbatches: int,
    warmup: int,
    repeats: int,
    device: torch.device,
) -> tuple[float, float, int]:
    """(backward with Linear weight gradients deferred, their flush for ``microbatches``,
    the bytes one micro-batch keeps for them until the flush)."""
    recorder = WeightGradStash()
    with defer_weight_grads([layer], recorder):
        _, backward_s = _time_layer(run, grad_for, warmup=warmup, repeats=repeats, device=device)
        recorder.clear()
        out = run()
        torch.autograd.backward(out, grad_for(out))  # one micro-batch's (X, dY), to replay
    kept = sum(_nbytes(x) + _nbytes(dy) for _, _, x, dy in recorder.pairs())
    # Distinct copies per micro-batch: the flush reads as many bytes as the stage's does.
    batch = [
        (w, b, x.clone(), dy.clone())
        for _ in range(microbatches)
        for w, b, x, dy in recorder.pairs()
    ]
    params = [p for p in layer.parameters() if p.requires_grad]
    times: list[float] = []
    for i in range(warmup + repeats):
        stash = WeightGradStash()
        for pair in batch:
            stash.add(*pair)
        for p in params:
            p.grad = None  # as after the runtime's previous step
        _sync(device)
        t0 = time.perf_counter()
        stash.flush()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return backward_s, statistics.median(times), kept


def _make_optimizer(params: list[torch.nn.Parameter], optimizer: str) -> torch.optim.Optimizer:
    # foreach=False: the runtime steps one optimizer per layer the same way.
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)
    return torch.optim.SGD(
        params, lr=1e-3, momentum=0.9 if optimizer == "momentum" else 0.0, foreach=False
    )


def _time_update(
    params: list[torch.nn.Parameter],
    optimizer: str,
    *,
    warmup: int,
    repeats: int,
    device: torch.device,
) -> float:
    """Median time of one optimizer step over a layer's parameters (gradients present)."""
    if not params:
        return 0.0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt = _make_optimizer(params, optimizer)
    times: list[float] = []
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        for i in range(warmup + repeats):
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)  # timing must not change the layer
    return statistics.median(times)


def profile_model(
    spec: ModelSpec,
    *,
    microbatch: int,
    device: str = "cpu",
    warmup: int = 3,
    repeats: int = 10,
    seed: int = 0,
    optimizer: str = "sgd",
    threads: int | None = None,
    progress: ProgressFn | None = None,
    wgrad_microbatches: int = 0,
) -> Profile:
    """Measure every layer of ``spec`` at micro-batch size ``microbatch``.

    Args:
        spec: the model declaration.
        microbatch: samples per micro-batch.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        warmup: untimed runs per layer before the timed ones.
        repeats: timed runs per layer; the median is kept.
        seed: parameter initialisation seed (timings do not depend on it).
        optimizer: ``sgd``, ``momentum``, ``adam`` or ``adamw`` (sets optimizer-state bytes).
        threads: intra-op threads to use (default: leave torch's setting).
        progress: called as ``progress(done, total, layer_name)`` after each layer.
        wgrad_microbatches: also time batched weight gradients (``backward_input_s``
            and ``wgrad_s``) for this many micro-batches per batch, the run's
            ``[data].microbatches`` (0: skip).
    """
    if microbatch < 1:
        raise PlanError(f"microbatch must be >= 1 (got {microbatch})")
    if repeats < 1 or warmup < 0:
        raise PlanError(
            f"repeats must be >= 1 and warmup >= 0 (got repeats={repeats}, warmup={warmup})"
        )
    if wgrad_microbatches < 0:
        raise PlanError(f"wgrad_microbatches must be >= 0 (got {wgrad_microbatches})")
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise PlanError(
            f"optimizer {optimizer!r} unknown (allowed: {', '.join(OPTIMIZER_STATE_FACTOR)})"
        )
    dev = resolve_device(device)
    old_threads = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise PlanError(f"threads must be >= 1 (got {threads})")
        torch.set_num_threads(threads)
    try:
        return _profile(
            spec, microbatch, dev, warmup, repeats, seed, optimizer, progress, wgrad_microbatches
        )
    finally:
        torch.set_num_threads(old_threads)


def _profile(
    spec: ModelSpec,
    microbatch: int,
    dev: torch.device,
    warmup: int,
    repeats: int,
    seed: int,
    optimizer: str,
    progress: ProgressFn | None,
    wgrad_microbatches: int,
) -> Profile:
    x, target = spec.dataset(split="train").sample_batch(microbatch, seed=seed)
    x, target = x.to(dev), target.to(dev)
    input_bytes = _nbytes(x)
    names, kinds = spec.layer_names(), spec.layer_kinds()
    n = spec.num_layers
    state_factor = OPTIMIZER_STATE_FACTOR[optimizer]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    layers: list[LayerProfile] = []
    for i in range(n):
        layer = spec.build_layer(i, seed=seed, device=dev)
        params = list(layer.parameters())
        inp = x.detach()
        # The runtime never asks for the gradient of the model's input (only a layer
        # without parameters needs one there, to have a backward at all).
        if inp.is_floating_point() and (i > 0 or not any(p.requires_grad for p in params)):
            inp.requires_grad_(True)
        last = i == n - 1

        def run(
            layer: torch.nn.Module = layer, inp: torch.Tensor = inp, last: bool = last
        ) -> torch.Tensor:
            out: torch.Tensor = layer(inp)
            return spec.loss(out, target) if last else out

        def grad_for(out: torch.Tensor) -> torch.Tensor | None:
            if out.dim() == 0:
                return None
            return torch.randn(out.shape, generator=gen).to(device=dev, dtype=out.dtype)

        fwd_s, bwd_s = _time_layer(run, grad_for, warmup=warmup, repeats=repeats, device=dev)
        bwd_input_s = wgrad_s = None
        wgrad_bytes = None
        if wgrad_microbatches:
            bwd_input_s, wgrad_s, wgrad_bytes = _time_deferred(
                layer,
                run,
                grad_for,
                microbatches=wgrad_microbatches,
                warmup=warmup,
                repeats=repeats,
                device=dev,
            )
        update_s = _time_update(params, optimizer, warmup=warmup, repeats=repeats, device=dev)
        counter = _SavedBytes({p.untyped_storage().data_ptr() for p in params})
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            out = layer(inp)
        param_bytes = sum(_nbytes(p) for p in params)
        layers.append(
            LayerProfile(
                name=names[i],
                kind=kinds[i],
                forward_s=fwd_s,
                backward_s=bwd_s,
                activation_bytes=_nbytes(out),
                gradient_bytes=_nbytes(x) if x.is_floating_point() else 0,
                saved_bytes=counter.total,
                param_bytes=param_bytes,
                optimizer_bytes=param_bytes * state_factor,
                num_params=sum(p.numel() for p in params),
                update_s=update_s,
                backward_input_s=bwd_input_s,
                wgrad_s=wgrad_s,
                wgrad_bytes=wgrad_bytes,
            )
        )
        with torch.no_grad():
            x = out.detach()
        if progress is not None:
            progress(i + 1, n, names[i])
    return Profile(
        model=spec.name,
        microbatch=microbatch,
        device=str(dev),
        dtype=str(x.dtype).removeprefix("torch."),
        optimizer=optimizer,
        threads=torch.get_num_threads(),
        repeats=repeats,
        input_bytes=input_bytes,
        wgrad_microbatches=wgrad_microbatches,
        meta=_environment(spec, dev, warmup),
        layers=tuple(layers),
    )


def _environment(spec: ModelSpec, dev: torch.device, warmup: int) -> dict[str, Any]:
    env: dict[str, Any] = {
        "config": dict(spec.config),
        "warmup": warmup,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
    return env
