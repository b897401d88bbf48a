"""What the trainer (or a benchmark, or a test) hands a :class:`~megatron.pipeline.runtime.worker.StageWorker`:
the stage's model chunks, optimizer, learning-rate policy, data and loss, and its options."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron.pipeline.ir import PipelineLayout
from megatron.pipeline.runtime.loss_scaling import StageLossScaler
from megatron.pipeline.runtime.stage_optimizer import LRPolicy, StageOptimizer
from megatron.pipeline.runtime.weight_versions import WeightPolicy

Batch = dict[str, torch.Tensor]


@dataclass
class StageSetup:
    """Everything a stage needs to compute; built by the trainer (or a benchmark)."""

    stage: int
    layout: PipelineLayout
    chunks: list[torch.nn.Module]  # chunk c is virtual stage c * num_stages + stage
    optimizer: StageOptimizer
    lr_schedule: LRPolicy
    microbatches_per_update: int  # losses are scaled by 1/a so a window sums to a mean
    batch_fn: Callable[[int], Batch]  # global micro-batch index -> this replica's batch
    loss_fn: Callable[[torch.Tensor, Batch], tuple[torch.Tensor, int]]
    activation_shape: tuple[int, ...]
    activation_dtype: torch.dtype
    device: torch.device
    clip_grad: float = 0.0
    seed: int = 1234
    # Testing hook: poison this stage's gradients before these local updates (0-based), to
    # exercise the non-finite skip path end to end.
    inject_nonfinite_updates: frozenset[int] = frozenset()
    # Testing hook: the loss of these global micro-batches becomes NaN (last stage only), so
    # every stage's gradients turn non-finite.
    inject_nonfinite_losses: frozenset[int] = frozenset()
    # Which weights forwards and backwards read (weight stashing, discrepancy correction);
    # None: the live weights (megatron.pipeline.runtime.weight_versions).
    weight_policy: WeightPolicy | None = None
    # fp16: this stage's loss scaler (megatron.pipeline.runtime.loss_scaling); None: no loss scaling.
    loss_scaler: StageLossScaler | None = None
    # --log-params-norm: reports carry the sum of squares of this stage's parameters.
    report_params_norm: bool = False
    # A part of the loss logged on its own (BERT's sentence-order loss); None: nothing extra.
    aux_loss_fn: Callable[[Any, Batch], torch.Tensor | None] | None = None
    # The stage's tensor-parallel group (megatron's); None at TP = 1. Its ranks run the same
    # ops, and the stage's norms are reduced over it (megatron.pipeline.runtime.tensor_parallel).
    tp_group: Any = None
    # Count activation bytes with saved-tensor hooks (--log-activation-memory); off, the meter
    # only counts in-flight micro-batches and costs no hook (megatron.pipeline.runtime.memory).
    measure_activations: bool = False


__all__ = ["Batch", "LRPolicy", "StageOptimizer", "StageSetup"]
