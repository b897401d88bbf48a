"""Sums of squares over a tensor-parallel stage: the norm of the whole, unsharded stage.

A stage at TP = T is T ranks, each holding a shard of the column/row/vocab-parallel weights
(megatron marks them ``tensor_model_parallel``) and a full copy of everything else (norms,
row-parallel biases, position embeddings), whose gradients are identical on every TP rank
without sequence parallelism. The stage's squared norm (gradient clipping, the non-finite
check, ``--log-params-norm``) is therefore the sharded part summed over the TP group plus the
replicated part counted once. Every TP rank gets the same value, so they clip alike and skip
alike (an overflow on one rank's shard is an inf/nan in the sum everyone sees). The distributed
optimizer, whose replicas hold only their range of the averaged gradients, sums the two parts
over its DP group first and then uses :func:`count_replicated_once`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def is_sharded(param: torch.Tensor) -> bool:
    """Whether megatron split this parameter over the TP group."""
    return bool(getattr(param, "tensor_model_parallel", False))


def split_sq_sums(pairs: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """``[sharded, replicated]``: the local sums of squares of the tensors (a parameter's gradient
    or value, or a flat range of it, paired with the parameter that says how it is sharded), in
    float64 (fp16 squares overflow; the sum must not depend on the shard count). No collective."""
    sums: torch.Tensor | None = None
    for param, tensor in pairs:
        if sums is None:
            sums = torch.zeros(2, dtype=torch.float64, device=param.device)
        if tensor is not None:
            sums[0 if is_sharded(param) else 1] += tensor.detach().double().square().sum()
    return torch.zeros(2, dtype=torch.float64) if sums is None else sums


def tp_sq_sum(pairs: Iterable[tuple[torch.Tensor, torch.Tensor | None]], group: dist.ProcessGroup) -> float:
    """Sum of squares of the tensors (see :func:`split_sq_sums`) over the whole stage; a
    collective over ``group``."""
    sums = split_sq_sums(pairs)
    sharded = sums[0:1].clone()
    dist.all_reduce(sharded, group=group)
    return float(sharded) + float(sums[1])


def count_replicated_once(sums: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-reduce ``[sharded, replicated]`` sums over the TP group, the replicated part from TP
    rank 0 only: every TP rank holds the same replicated values, so this counts them once and
    gives every rank the same bits (the sum does not depend on which rank's rounding it took).
    A non-finite replicated sum is kept on every rank, so an overflow anywhere stays visible."""
    sums = sums.clone()
    if dist.get_rank(group=group) != 0 and bool(torch.isfinite(sums[1])):
        sums[1] = 0.0
    dist.all_reduce(sums, group=group)
    return sums


def reduce_sequence_parallel_grads(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum over the TP group the gradients of parameters megatron marks ``sequence_parallel``
    (norms, row-parallel biases under ``--sequence-parallel``): each TP rank saw only its own
    sequence shard, so its gradient is a partial sum. Once per update, after the data-parallel
    average and before the norm (Megatron-LM does it in ``finalize_model_grads``); afterwards they are
    replicated like any unsharded parameter, which :func:`tp_sq_sum` counts once. One flat
    all-reduce; nothing to do without such parameters or without a TP group."""
    if group is None:
        return
    marked = [p for p in params if getattr(p, "sequence_parallel", False)]
    if not marked:
        return
    for p in marked:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in marked])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in marked:
        p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
        offset += p.grad.numel()
