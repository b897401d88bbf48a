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

from megatron.pipeline.executors.common import ReportCadence
from megatron.pipeline.executors.emulator import Emulator
from megatron.pipeline.schedules import ScheduleConfig, build_schedule, schedule_class
from megatron.pipeline.worker import StageSetup, StageWorker

DIM = 3


class TanhLinear(torch.nn.Module):
    """``tanh(x @ W^T)``; logs (micro-batch, weight value) at forward save and backward read."""

    middle_batch_keys = ("mb",)  # middle stages need the micro-batch index for the logs

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.saved: dict[int, torch.Tensor] = {}
        self.read: dict[int, torch.Tensor] = {}
        self.microbatch = -1

    def forward(self, x: torch.Tensor | None, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The first stage's input asks for a gradient too, so autograd saves W there as well.
        inp = batch["x"].clone().requires_grad_(True) if x is None else x
        mb = int(batch["mb"])

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() == self.weight.data_ptr():
                self.saved[mb] = t.detach().clone().T
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() == self.weight.data_ptr():
                self.read[mb] = t.detach().clone().T
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return torch.tanh(inp @ self.weight.T)


class PlainSGD:
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
    modules: list[TanhLinear] = field(default_factory=list)
    optimizers: list[PlainSGD] = field(default_factory=list)


def run(name: str, num_stages: int, a: int, iterations: int, options: dict | None = None,
        lr: Callable[[], ScaledLR] = ScaledLR) -> TinyRun:
    """Train the tiny pipeline with schedule ``name`` in the emulator."""
    config = ScheduleConfig(num_stages, a, iterations, options=options or {})
    cls = schedule_class(name)
    out = TinyRun(workers=[])
    for s, w in enumerate(initial_weights(num_stages)):
        module = TanhLinear(w)
        opt = PlainSGD([module.weight])
        setup = StageSetup(
            stage=s, layout=config.layout, chunks=[module], optimizer=opt,
            lr_schedule=cls.stage_lr_schedule(config, s, lr()), microbatches_per_update=a,
            batch_fn=batch, loss_fn=loss_fn, activation_shape=(2, DIM), activation_dtype=torch.float64,
            device=torch.device("cpu"), weight_policy=cls.stage_weight_policy(config, s, opt))
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
