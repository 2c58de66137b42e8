"""ArrayPipe's binder: one public structure per layer, per-job parameter states.

A stage of a job-array holds, for each of its layers, one module (the *public
structure*) and, for every job, that layer's parameters and optimizer state. A block of
job ``j`` runs the structure with job ``j``'s tensors through
``torch.func.functional_call``, so switching from one job's block to another's
rebuilds nothing and copies nothing while the states are resident. Job 0's tensors
are the structure's own parameters, so a one-job array costs nothing extra.

Each job's layer ``i`` is built from the job's own seed, exactly as training that job
alone would build it, and gets its own optimizer (one per job and layer), so its state
can travel with the layer later (migration) and be saved under global keys.

Layers with persistent buffers (batch-norm statistics, say) are refused: a block would
run on job 0's buffers and update them for every job, so the jobs would no longer train
as alone. Non-persistent buffers (a causal mask) are constants and are shared. Layers
that draw random numbers while training (dropout) are refused too: the jobs' blocks
interleave on one random stream, so each would draw other numbers than alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from adaptipe.errors import PlanError
from adaptipe.runtime.jobs import JobSpec
from adaptipe.runtime.slots import draws_random

__all__ = ["Binder", "JobLayerState", "refuse_unbindable"]


def refuse_unbindable(index: int, module: nn.Module) -> None:
    """Raise `PlanError` when layer ``index`` has persistent buffers or draws random
    numbers in training (see the module doc)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    buffers = [name for name in module.state_dict(keep_vars=True) if name not in params]
    if buffers:
        raise PlanError(
            f"layer {index} ({type(module).__name__}) has buffers ({', '.join(buffers)}): "
            "job-arrays hold per-job parameters and optimizer state only, so a [sweep] "
            "cannot train this model"
        )
    random = draws_random(module)
    if random:
        raise PlanError(
            f"layer {index} ({type(module).__name__}) draws random numbers in training "
            f"({', '.join(random)}): the jobs of an array share one random stream, so none "
            "would train as alone; set its dropout to 0 to train it in a [sweep]"
        )


@dataclass(slots=True)
class JobLayerState:
    """One job's state of one layer."""

    params: dict[str, nn.Parameter]
    optimizer: torch.optim.Optimizer | None


class Binder:
    """Per-job states of a stage's layers, bound to one public structure per layer.

    Args:
        layers: the global indices of this stage's layers, in model order.
        jobs: the job-array.
        build_layer: ``build_layer(index, seed)`` builds a layer as training alone would.
        make_optimizer: ``make_optimizer(job, params)`` builds that job's optimizer.
    """

    def __init__(
        self,
        *,
        layers: Sequence[int],
        jobs: Sequence[JobSpec],
        build_layer: Callable[[int, int], nn.Module],
        make_optimizer: Callable[[JobSpec, list[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        self.layers: list[int] = []
        self.jobs = list(jobs)
        self.structures: dict[int, nn.Module] = {}
        self.states: list[dict[int, JobLayerState]] = [{} for _ in self.jobs]
        self._build_layer = build_layer
        self._make_optimizer = make_optimizer
        self.add_layers(layers)

    def add_layers(self, layers: Sequence[int]) -> None:
        """Build ``layers`` for every job, as training it alone would (fresh state), and
        keep the layer list in model order."""
        built: list[tuple[int, list[nn.Module]]] = []
        for index in layers:  # build and check everything before changing anything
            if index in self.structures:
                raise ValueError(f"layer {index} is already bound on this stage")
            modules = [self._build_layer(index, job.seed) for job in self.jobs]
            for module in modules:
                refuse_unbindable(index, module)
            built.append((index, modules))
        for index, modules in built:
            for job, per_layer, module in zip(self.jobs, self.states, modules, strict=True):
                params = dict(module.named_parameters())
                opt = self._make_optimizer(job, list(params.values())) if params else None
                per_layer[index] = JobLayerState(params=params, optimizer=opt)
            self.structures[index] = modules[0]  # job 0's module is the structure
        self.layers = sorted([*self.layers, *layers])

    def remove_layers(self, layers: Sequence[int]) -> None:
        """Drop ``layers`` and every job's state of them from this stage."""
        missing = [i for i in layers if i not in self.structures]
        if missing:
            raise ValueError(f"layers {missing} are not bound on this stage ({self.layers})")
        for index in layers:
            del self.structures[index]
            for per_layer in self.states:
                del per_layer[index]
        self.layers = [i for i in self.layers if i not in set(layers)]

    @property
    def num_jobs(self) -> int:
        return len(self.jobs)

    def params(self, job: int, layers: Sequence[int]) -> list[dict[str, Tensor]]:
        """Job ``job``'s tensors for ``layers``, in order (no copies)."""
        state = self.states[job]
        return [dict(state[i].params) for i in layers]

    def run(self, job: int, layers: Sequence[int], x: Tensor) -> Tensor:
        """Forward ``x`` through ``layers`` with job ``job``'s parameters."""
        for index in layers:
            params: dict[str, Tensor] = dict(self.states[job][index].params)
            x = torch.func.functional_call(self.structures[index], params, (x,))
        return x

    def step(self, job: int) -> None:
        """Apply job ``job``'s accumulated gradients on this stage and free them."""
        for state in self.states[job].values():
            if state.optimizer is not None:
                state.optimizer.step()
                state.optimizer.zero_grad(set_to_none=True)

    def state(self, job: int, index: int) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """A module holding job ``job``'s parameters of layer ``index`` (for checkpoints)."""
        holder = _ParamHolder(self.states[job][index].params)
        return holder, self.states[job][index].optimizer

    def job_params(self, job: int) -> list[tuple[int, list[nn.Parameter]]]:
        """Job ``job``'s parameters per layer, in layer order (each in registration order)."""
        return [(index, list(self.states[job][index].params.values())) for index in self.layers]


class _ParamHolder(nn.Module):
    """Presents a dict of parameters under their original names (``state_dict`` keys)."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        super().__init__()
        for name, p in params.items():
            owner: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, p)
