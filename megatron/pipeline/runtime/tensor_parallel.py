"""Sums of squares over a tensor-parallel stage: the norm of the whole, unsharded stage.

A stage at TP = T is T ranks, each holding a shard of the column/row/vocab-parallel weights
(megatron marks them ``tensor_model_parallel``) and a full copy of everything else (norms,
row-parallel biases, position embeddings), whose gradients are identical on every TP rank
without sequence parallelism. The stage's squared norm (gradient clipping, the non-finite
check, ``--log-params-norm``) is therefore the sharded part summed over the TP group plus the
replicated part counted once. Every TP rank gets the same value, so they clip alike and skip
alike (an overflow on one rank's shard is an inf/nan in the sum everyone sees).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def is_sharded(param: torch.Tensor) -> bool:
    """Whether megatron split this parameter over the TP group."""
    return bool(getattr(param, "tensor_model_parallel", False))


def tp_sq_sum(pairs: Iterable[tuple[torch.Tensor, torch.Tensor | None]], group: dist.ProcessGroup) -> float:
    """Sum of squares of the tensors (a parameter's gradient or value, paired with the
    parameter that says how it is sharded) over the whole stage; a collective over ``group``.
    Accumulated in float64 (fp16 squares overflow; the sum must not depend on the shard count)."""
    sums: torch.Tensor | None = None
    for param, tensor in pairs:
        if sums is None:
            sums = torch.zeros(2, dtype=torch.float64, device=param.device)
        if tensor is not None:
            sums[0 if is_sharded(param) else 1] += tensor.detach().double().square().sum()
    if sums is None:
        sums = torch.zeros(2, dtype=torch.float64)
    sharded = sums[0:1].clone()
    dist.all_reduce(sharded, group=group)
    return float(sharded) + float(sums[1])
