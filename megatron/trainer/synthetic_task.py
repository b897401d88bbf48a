"""Synthetic-cost benchmark model; sleeps stand in for compute on purpose.

NOT a model. Each pipeline stage is one tiny ``Linear`` on a small ``[s, b, h]`` tensor whose
forward sleeps ``--synthetic-forward-ms`` and whose backward sleeps ``--synthetic-backward-ms``
(a custom autograd function). The last stage's loss is the mean square of its output.

Why: a machine with a couple of CPU cores cannot time real compute of 4 or 8 pipeline stages
(the processes would fight over the cores). ``time.sleep`` gives the core away, so N sleeping
processes on 2 cores behave like N devices with known per-op costs, and the measured iteration
time of a schedule, run through the real distributed runtime, can be compared with its
analytic time. The difference is the schedule's and the runtime's overhead.

Used by ``benchmarks/synthetic_stage_run.py`` and ``benchmarks/schedule_efficiency.py``.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron.trainer.task import Batch


class SleepCost(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        if forward_s > 0:
            time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.backward_s > 0:
            time.sleep(ctx.backward_s)
        return grad, None, None


class SyntheticCostStage(torch.nn.Module):
    """One (virtual) stage of the synthetic-cost benchmark: ``SleepCost(Linear(x))``.

    The sleep sits after the ``Linear`` so that its input requires grad on every stage
    (including stage 0, whose input is data): the backward sleep then always runs.
    """

    def __init__(self, stage: int, hidden_size: int, forward_ms: float, backward_ms: float,
                 is_first: bool, seed: int, device: torch.device):
        super().__init__()
        self.stage = stage
        self.is_first = is_first
        self.forward_s = forward_ms / 1000.0
        self.backward_s = backward_ms / 1000.0
        gen = torch.Generator().manual_seed(seed + 7919 * stage)
        self.linear = torch.nn.Linear(hidden_size, hidden_size, device=device)
        with torch.no_grad():
            self.linear.weight.copy_(torch.eye(hidden_size) + 0.01 * torch.randn(hidden_size, hidden_size, generator=gen))
            self.linear.bias.zero_()

    def forward(self, input_tensor: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        x = batch["synthetic_input"] if self.is_first else input_tensor
        assert x is not None, f"synthetic stage {self.stage} got no input"
        return SleepCost.apply(self.linear(x), self.forward_s, self.backward_s)


class SyntheticCostTask:
    """``PretrainTask`` of the synthetic-cost benchmark (see the module docstring)."""

    name = "synthetic-cost benchmark"
    # No megatron-core modules here: lets the trainer skip importing and initialising megatron-core
    # (seconds of CPU per rank, which 8 ranks on 2 cores would pay at every benchmark launch).
    uses_megatron_core = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("synthetic-cost benchmark (sleeps stand in for compute)")
        g.add_argument("--synthetic-forward-ms", type=float, default=20.0,
                       help="wall time each stage's forward of one micro-batch sleeps")
        g.add_argument("--synthetic-backward-ms", type=float, default=40.0,
                       help="wall time each stage's backward of one micro-batch sleeps")

    def build_stage(self, args: argparse.Namespace, stage: int, device: torch.device) -> list[torch.nn.Module]:
        """One module per model chunk (virtual stage ``c * PP + stage``); with V chunks per stage
        each chunk sleeps 1/V of the per-stage costs, so a stage's cost per micro-batch stays t_f, t_b."""
        if args.synthetic_forward_ms < 0 or args.synthetic_backward_ms < 0:
            raise ValueError("--synthetic-forward-ms and --synthetic-backward-ms must be >= 0")
        pp, chunks = args.pipeline_model_parallel_size, getattr(args, "num_model_chunks", 1)
        return [
            SyntheticCostStage(c * pp + stage, args.hidden_size, args.synthetic_forward_ms / chunks,
                               args.synthetic_backward_ms / chunks, is_first=c * pp + stage == 0,
                               seed=args.seed, device=device)
            for c in range(chunks)
        ]

    def named_parameters(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for chunk in chunks:
            assert isinstance(chunk, SyntheticCostStage)
            for name, p in chunk.named_parameters():
                yield f"synthetic_stage{chunk.stage}.{name}", p  # virtual stage index: global names

    def batch_fn(self, args: argparse.Namespace, dp_rank: int, device: torch.device) -> Callable[[int], Batch]:
        shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
        seed, dp = args.seed, args.data_parallel_size

        def get(microbatch: int) -> Batch:
            gen = torch.Generator().manual_seed(seed + microbatch * dp + dp_rank)
            return {"synthetic_input": torch.randn(shape, generator=gen).to(device)}

        return get

    def loss_fn(self, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        return output.float().pow(2).mean(), output.shape[0] * output.shape[1]

    def activation_spec(self, args: argparse.Namespace) -> tuple[tuple[int, ...], torch.dtype]:
        return (args.seq_length, args.micro_batch_size, args.hidden_size), torch.float32
