"""Synthetic-cost benchmark model; sleeps stand in for compute on purpose.

NOT a model. Each pipeline stage is one tiny linear on a small ``[s, b, h]`` tensor whose
forward sleeps ``--synthetic-forward-ms`` (T_F) and whose backward sleeps
``--synthetic-backward-ms`` (T_B, input gradient) plus ``--synthetic-wgrad-ms`` (T_W, weight
gradient). The last stage's loss is the mean square of its output.

Where the sleeps land (Zero Bubble's B/W split): the linear is *deferrable* through the
runtime's own mechanism (:mod:`megatron.pipeline.runtime.wgrad`), like the split linears of the GPT
stage. A fused backward (op BW) sleeps T_B + T_W; a split backward's op B sleeps T_B and queues
``(x, dy)``, and op W computes the weight gradient and sleeps T_W. So a B/W-split schedule is
timed through the same worker, deferral store and activation accounting as a real model, not
through a benchmark-only shortcut. With T_W = 0 (the default) every backward sleeps T_B as
before and W only does the tiny matmul.

Why: a machine with a couple of CPU cores cannot time real compute of 4 or 8 pipeline stages
(the processes would fight over the cores). ``time.sleep`` gives the core away, so N sleeping
processes on 2 cores behave like N devices with known per-op costs, and the measured iteration
time of a schedule, run through the real distributed runtime, can be compared with its
analytic time. The difference is the schedule's and the runtime's overhead.

How a sleep is timed (a property of this benchmark model, not of the runtime): a stage's
forward sleeps until T_F after the forward began (an absolute deadline, so the tiny linear
before the sleep is part of T_F, as a device's op includes all its compute), and every sleep
runs with the calling thread's Linux timer slack set to 1 ns (``prctl(PR_SET_TIMERSLACK)``;
elsewhere, or if the call fails, the default slack stays). With the default slack of 50 µs a
20 ms ``time.sleep`` oversleeps 0.1-0.5 ms on the machines this was measured on, which the
benchmark would otherwise count as runtime overhead of every op. What remains after waking
(the runtime's own work on a CPU whose caches the sleep let go cold) is the runtime's cost.

Used by ``benchmarks/harness/synthetic_stage_run.py``, ``benchmarks/schedule_efficiency.py``,
``benchmarks/zero_bubble_synthetic.py`` and ``benchmarks/async_schedules_synthetic.py``.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from megatron.pipeline.runtime.wgrad import accumulate_grad, active_deferral
from megatron.trainer.config.job_config import TaskOptions
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.tasks.task import Batch, PretrainTask, split_seed


_PR_SET_TIMERSLACK = 29  # <linux/prctl.h>
_slack = threading.local()  # timer slack is per thread: set once in each thread that sleeps


def _tight_timer_slack() -> None:
    """Set this thread's timer slack to 1 ns on Linux (once per thread); elsewhere a no-op."""
    if getattr(_slack, "done", False):
        return
    _slack.done = True
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
        except (OSError, AttributeError):  # no libc symbol: keep the default slack
            pass


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline`` (returns at once if it has)."""
    _tight_timer_slack()
    remaining = deadline - time.perf_counter()
    while remaining > 0:
        time.sleep(remaining)
        remaining = deadline - time.perf_counter()


class SleepCost(torch.autograd.Function):
    """Identity that sleeps until ``forward_s`` after ``start`` in forward, ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float, start: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        if forward_s > 0:
            sleep_until(start + forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.backward_s > 0:
            sleep_until(time.perf_counter() + ctx.backward_s)
        return grad, None, None, None


class SleepingWeightGrad:
    """The weight gradient of one :class:`SyntheticLinear` for one backward, plus its T_W sleep.

    Recorded in the active deferral store at op B and run at op W (a
    :class:`megatron.pipeline.runtime.wgrad.WeightGradWork`), or run inside the fused backward.
    Holds ``x`` and ``dy`` until it runs, which is what the activation meter then counts as
    M_W, exactly as for a real split linear.
    """

    __slots__ = ("weight", "bias", "x", "dy", "sleep_s", "done")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                 dy: torch.Tensor, sleep_s: float):
        self.weight, self.bias = weight, bias
        self.x: torch.Tensor | None = x
        self.dy: torch.Tensor | None = dy
        self.sleep_s = sleep_s
        self.done = False

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return () if self.done else (self.x, self.dy)  # type: ignore[return-value]

    def compute(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``dW = dyᵀ x``, ``db = Σ dy`` over all leading dims; sleeps T_W (the W cost)."""
        assert self.x is not None and self.dy is not None
        dy2 = self.dy.reshape(-1, self.dy.shape[-1])
        grad_weight = dy2.t().matmul(self.x.reshape(-1, self.x.shape[-1]))
        grad_bias = dy2.sum(dim=0) if self.bias is not None else None
        if self.sleep_s > 0:
            sleep_until(time.perf_counter() + self.sleep_s)
        return grad_weight, grad_bias

    def run(self) -> None:
        """Op W: compute, accumulate into ``.grad`` and free ``x`` / ``dy``; idempotent."""
        if self.done:
            return
        grad_weight, grad_bias = self.compute()
        accumulate_grad(self.weight, grad_weight)
        if self.bias is not None and grad_bias is not None:
            accumulate_grad(self.bias, grad_bias)
        self.done = True
        self.x = self.dy = None


class _SyntheticLinearFunction(torch.autograd.Function):
    """``y = x Wᵀ + b`` whose backward defers ``dW``/``db`` (and the T_W sleep) under op B."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                wgrad_s: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.weight_param, ctx.bias_param, ctx.wgrad_s = weight, bias, wgrad_s
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        work = SleepingWeightGrad(ctx.weight_param, ctx.bias_param, x, grad_output, ctx.wgrad_s)
        store = active_deferral()
        if store is not None:  # op B: W runs it later
            store.add(work)
            return grad_input, None, None, None
        grad_weight, grad_bias = work.compute()  # fused BW: T_W sleeps here, after T_B
        return grad_input, grad_weight, grad_bias, None


class SyntheticLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` (same parameters and names) whose weight gradient sleeps T_W and
    can be deferred to op W (see the module docstring)."""

    def __init__(self, features: int, wgrad_ms: float, device: torch.device):
        super().__init__(features, features, device=device)
        self.wgrad_s = wgrad_ms / 1000.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _SyntheticLinearFunction.apply(x, self.weight, self.bias, self.wgrad_s)


class SyntheticCostStage(torch.nn.Module):
    """One (virtual) stage of the synthetic-cost benchmark: ``SleepCost(SyntheticLinear(x))``.

    The sleep sits after the linear so that its input requires grad on every stage
    (including stage 0, whose input is data): the backward sleep then always runs. In a fused
    backward autograd runs SleepCost's backward (T_B) and then the linear's (T_W).
    """

    def __init__(self, stage: int, hidden_size: int, forward_ms: float, backward_ms: float,
                 is_first: bool, seed: int, device: torch.device, wgrad_ms: float = 0.0):
        super().__init__()
        self.stage = stage
        self.is_first = is_first
        self.forward_s = forward_ms / 1000.0
        self.backward_s = backward_ms / 1000.0
        gen = torch.Generator().manual_seed(seed + 7919 * stage)
        self.linear = SyntheticLinear(hidden_size, wgrad_ms, device=device)
        with torch.no_grad():
            self.linear.weight.copy_(torch.eye(hidden_size) + 0.01 * torch.randn(hidden_size, hidden_size, generator=gen))
            self.linear.bias.zero_()

    def forward(self, input_tensor: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        start = time.perf_counter()  # T_F counts from here: the linear is part of the op's cost
        x = batch["synthetic_input"] if self.is_first else input_tensor
        assert x is not None, f"synthetic stage {self.stage} got no input"
        return SleepCost.apply(self.linear(x), self.forward_s, self.backward_s, start)


@dataclass(frozen=True)
class SyntheticCostOptions(TaskOptions):
    """The synthetic-cost benchmark's sleep times (``config.task``)."""

    model_family: ClassVar[str] = "synthetic"
    synthetic_forward_ms: float
    synthetic_backward_ms: float
    synthetic_wgrad_ms: float


class SyntheticCostTask(PretrainTask):
    """``PretrainTask`` of the synthetic-cost benchmark (see the module docstring)."""

    name = "synthetic-cost benchmark"
    # No megatron-core modules here: lets the trainer skip importing and initialising megatron-core
    # (seconds of CPU per rank, which 8 ranks on 2 cores would pay at every benchmark launch).
    uses_megatron_core = False
    # part_builder: None (the inherited default): a stage is one sleeping layer, nothing to profile

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("synthetic-cost benchmark (sleeps stand in for compute)")
        g.add_argument("--synthetic-forward-ms", type=float, default=20.0,
                       help="wall time each stage's forward of one micro-batch sleeps")
        g.add_argument("--synthetic-backward-ms", type=float, default=40.0,
                       help="wall time each stage's backward of one micro-batch sleeps (T_B: the input "
                            "gradient, op B of a B/W split)")
        g.add_argument("--synthetic-wgrad-ms", type=float, default=0.0,
                       help="wall time each stage's weight gradient of one micro-batch sleeps (T_W: op W "
                            "of a B/W split; a fused backward sleeps T_B + T_W)")
        parser.set_defaults(task_options=SyntheticCostOptions)

    def build_stage(self, config: RunPlan, stage: int, device: torch.device) -> list[torch.nn.Module]:
        """One module per model chunk, placed by the schedule's layout (``layout.model_stage``):
        virtual stage ``c * PP + stage`` for interleaving, logical stage of pipeline ``c`` for
        AMDP (whose replicas of a logical stage then share names and initial weights).

        A stage's cost per micro-batch stays T_F, T_B, T_W: each chunk sleeps the costs divided
        by the number of this stage's chunks one micro-batch passes through (V with V
        interleaved chunks; 1 with AMDP, where a micro-batch runs on one pipeline only)."""
        wgrad_ms = config.task.synthetic_wgrad_ms
        if config.task.synthetic_forward_ms < 0 or config.task.synthetic_backward_ms < 0 or wgrad_ms < 0:
            raise ValueError("--synthetic-forward-ms, --synthetic-backward-ms and --synthetic-wgrad-ms must be >= 0")
        layout = config.run.layout
        share = len(layout.microbatch_chunks(0))
        return [
            SyntheticCostStage(j, config.model.hidden_size, config.task.synthetic_forward_ms / share,
                               config.task.synthetic_backward_ms / share, is_first=j == 0,
                               seed=config.training.seed, device=device, wgrad_ms=wgrad_ms / share)
            for j in (layout.model_stage(stage, c) for c in range(layout.num_chunks))
        ]

    def named_parameters(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for chunk in chunks:
            assert isinstance(chunk, SyntheticCostStage)
            for name, p in chunk.named_parameters():
                yield f"synthetic_stage{chunk.stage}.{name}", p  # model stage index: global names

    def batch_fn(self, config: RunPlan, dp_rank: int, device: torch.device,
                 split: str = "train") -> Callable[[int], Batch]:
        shape = (config.model.seq_length, config.training.micro_batch_size, config.model.hidden_size)
        seed, dp = split_seed(config.training.seed, split), config.parallel.data_parallel_size

        def get(microbatch: int) -> Batch:
            gen = torch.Generator().manual_seed(seed + microbatch * dp + dp_rank)
            return {"synthetic_input": torch.randn(shape, generator=gen).to(device)}

        return get

    def loss_fn(self, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        return output.float().pow(2).mean(), output.shape[0] * output.shape[1]

    def activation_spec(self, config: RunPlan) -> tuple[tuple[int, ...], torch.dtype]:
        return (config.model.seq_length, config.training.micro_batch_size, config.model.hidden_size), torch.float32
