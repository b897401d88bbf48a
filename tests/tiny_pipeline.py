"""A float64 pipeline of tanh-linear stages with plain SGD, driven by the real emulator and
stage workers, for tests that compare weight trajectories with formulas computed apart.

Every stage records the values its weight has when the forward saves it and when the
backward reads it back (``saved_tensors_hooks``), so what a pass *read* is observed directly,
not inferred from version labels.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron.pipeline.runtime.executors.common import ReportCadence
from megatron.pipeline.runtime.executors.emulator import Emulator
from megatron.pipeline.runtime.stage_optimizer import StageOptimizer
from megatron.pipeline.schedules import ScheduleConfig, build_schedule, schedule_class
from megatron.pipeline.runtime.weight_versions import build_weight_policy
from megatron.pipeline.runtime.worker import StageSetup, StageWorker
from megatron.pipeline.schedules import ScheduleOptions

DIM = 3


class TanhChain(torch.nn.Module):
    """``x -> tanh(x @ W_l^T)`` for each of the stage's layers ``l``; logs, per micro-batch, every
    layer's weight value when the forward saves it (``saved_layers``) and when the backward reads
    it back (``read_layers``)."""

    middle_batch_keys = ("mb",)  # middle stages need the micro-batch index for the logs

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in weights])
        self.saved_layers: dict[int, list[torch.Tensor | None]] = {}
        self.read_layers: dict[int, list[torch.Tensor | None]] = {}

    def _logger(self, log: dict[int, list[torch.Tensor | None]], mb: int):  # noqa: ANN202 - a hook
        slots = log.setdefault(mb, [None] * len(self.weights))
        ptrs = {w.data_ptr(): i for i, w in enumerate(self.weights)}

        def hook(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() in ptrs:  # autograd saves W^T, a view of W's storage
                slots[ptrs[t.data_ptr()]] = t.detach().clone().T
            return t
        return hook

    def forward(self, x: torch.Tensor | None, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The first stage's input asks for a gradient too, so autograd saves W there as well.
        h = batch["x"].clone().requires_grad_(True) if x is None else x
        mb = int(batch["mb"])
        with torch.autograd.graph.saved_tensors_hooks(self._logger(self.saved_layers, mb),
                                                      self._logger(self.read_layers, mb)):
            for w in self.weights:
                h = torch.tanh(h @ w.T)
        return h


class TanhLinear(TanhChain):
    """A one-layer :class:`TanhChain`: ``weight``, ``saved`` and ``read`` are its only layer's."""

    def __init__(self, weight: torch.Tensor):
        super().__init__([weight])

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.weights[0]

    @property
    def saved(self) -> dict[int, torch.Tensor]:
        return {mb: ws[0] for mb, ws in self.saved_layers.items()}

    @property
    def read(self) -> dict[int, torch.Tensor]:
        return {mb: ws[0] for mb, ws in self.read_layers.items()}


class PlainSGD(StageOptimizer):
    """``w <- w - lr * scale * g`` through ``p.data`` (the StageOptimizer protocol); logs every
    post-update weight so tests can rebuild the trajectory."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self._params = params
        self.step_count = 0
        self.history: list[list[torch.Tensor]] = [[p.detach().clone() for p in params]]

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def grad_sq_norm(self) -> torch.Tensor:
        return sum((p.grad.double().square().sum() for p in self._params if p.grad is not None),
                   torch.zeros((), dtype=torch.float64))

    @staticmethod
    def clip_coef(total_norm: float, max_norm: float) -> float:
        return min(1.0, max_norm / (total_norm + 1e-6))

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.step_count += 1
        for p in self._params:
            p.data.add_(p.grad, alpha=-lr * grad_scale)
        self.history.append([p.detach().clone() for p in self._params])

    def rollback(self, lr: float, grad_scale: float = 1.0) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()


@dataclass(frozen=True)
class ScaledLR:
    """A varying base rate, so an off-by-one in the step index shows."""

    base: float = 0.3

    def lr(self, step: int) -> float:
        return self.base / (1.0 + 0.25 * step)


def initial_weights(num_stages: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(DIM, DIM, generator=g, dtype=torch.float64) for _ in range(num_stages)]


def batch(mb: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``mb``: a pure function of its index, like the trainer's batches."""
    g = torch.Generator().manual_seed(1000 + mb)
    x = torch.randn(2, DIM, generator=g, dtype=torch.float64)
    return {"x": x, "y": torch.sin(x.sum(dim=1, keepdim=True)).expand(2, DIM), "mb": torch.tensor(mb)}


def loss_fn(out: torch.Tensor, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    return (out - b["y"]).square().sum(), 1


@dataclass
class TinyRun:
    workers: list[StageWorker]
    modules: list[TanhChain] = field(default_factory=list)
    optimizers: list[PlainSGD] = field(default_factory=list)


def split_weights(layers: list[int], seed: int = 0) -> list[list[torch.Tensor]]:
    """The initial weights of a model of ``sum(layers)`` layers, stage ``s`` holding ``layers[s]``."""
    flat, out = initial_weights(sum(layers), seed), []
    for count in layers:
        out.append(flat[:count])
        flat = flat[count:]
    return out


def run(name: str, num_stages: int, a: int, iterations: int, options: ScheduleOptions | None = None,
        lr: Callable[[], ScaledLR] = ScaledLR, layers: list[int] | None = None) -> TinyRun:
    """Train the tiny pipeline with schedule ``name`` in the emulator; ``layers[s]`` layers on
    stage ``s`` (default one each, as :class:`TanhLinear`)."""
    config = ScheduleConfig(num_stages, a, iterations, options=options or ScheduleOptions())
    cls = schedule_class(name)
    policy = cls.traits.policy_for(config)
    out = TinyRun(workers=[])
    stage_weights = split_weights(layers) if layers else [[w] for w in initial_weights(num_stages)]
    assert len(stage_weights) == num_stages
    for s, ws in enumerate(stage_weights):
        module = TanhLinear(ws[0]) if layers is None else TanhChain(ws)
        opt = PlainSGD(list(module.weights))
        setup = StageSetup(
            stage=s, layout=config.layout, chunks=[module], optimizer=opt,
            lr_schedule=policy.lr_schedule(s, lr()), microbatches_per_update=a,
            batch_fn=batch, loss_fn=loss_fn, activation_shape=(2, DIM), activation_dtype=torch.float64,
            device=torch.device("cpu"), weight_policy=build_weight_policy(policy.weight_policies[s], opt))
        out.workers.append(StageWorker(setup, isolate_rng=True))
        out.modules.append(module)
        out.optimizers.append(opt)

    class _NoSink:
        def submit(self, report, replica):  # noqa: ANN001 - reports are not needed here
            pass

    schedule = build_schedule(name, config)
    Emulator(out.workers, config.layout, ReportCadence(10**9), _NoSink()).run(schedule.streams())
    return out


def forward_model(weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for w in weights:
        x = torch.tanh(x @ w.T)
    return x


def window_gradient(weights: list[torch.Tensor], window: int, a: int) -> list[torch.Tensor]:
    """Gradient of the window's mean loss at ``weights``, accumulated per micro-batch in order."""
    leaves = [w.clone().requires_grad_(True) for w in weights]
    for mb in range(window * a, (window + 1) * a):
        b = batch(mb)
        loss, _ = loss_fn(forward_model(leaves, b["x"]), b)
        (loss / a).backward()
    return [w.grad for w in leaves]
