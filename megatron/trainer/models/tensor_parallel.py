"""Tensor-parallel stages: which slice of each full weight a TP rank holds, and how to build them.

megatron-core's TP layers (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, the vocab-parallel cross-entropy of ``compute_language_model_loss``)
shard a weight along one dimension and mark the parameter with ``tensor_model_parallel``,
``partition_dim`` and ``partition_stride``. Those marks are all we need to map between the
full (TP = 1) weight and a rank's shard:

* column-parallel (QKV, fc1, the output layer): rows, ``partition_dim`` 0. megatron's fused
  QKV rows are ordered query group by query group (each group's queries, then its key and
  value), so a contiguous block of rows is whole groups and the TP = 1 layout is sliced as is;
* SwiGLU's fc1 stores ``[gate; up]`` at TP = 1 and ``[gate_r; up_r]`` on rank r: megatron
  marks it with stride 2, which :func:`take_shard` honours (every T-th block of size
  ``rows / (2T)``, as megatron's own CPU initialisation does);
* row-parallel (proj, fc2): columns, ``partition_dim`` 1; their bias is replicated;
* the vocab-parallel embedding: rows, i.e. a vocabulary range (padded vocab divisible by T).

Everything unmarked (norms, row-parallel biases, position embeddings, BERT's pooler and heads)
is replicated. Without sequence parallelism its gradients are identical on every TP rank (the
column-parallel linears all-reduce their input gradient), so no TP reduction is needed.

Initialising a shard means drawing the *full* weight from (seed, global name) and keeping this
rank's slice (:meth:`~megatron.trainer.models.stage.PipelineStage.init_parameters`), so TP = 1
and TP = T start from identical weights.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.config.tensor_parallel_args import check_tensor_parallel_args


class ShardLayout(NamedTuple):
    """How a TP-sharded parameter splits its full weight: along ``dim``, in ``stride``
    interleaved blocks per rank."""

    dim: int
    stride: int


def shard_layout(param: torch.Tensor) -> ShardLayout | None:
    """The layout megatron recorded on a parameter; None for a replicated one."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return ShardLayout(int(param.partition_dim), int(getattr(param, "partition_stride", 1)))


def mark_tensor_parallel(model: torch.nn.Module, gated_linear_unit: bool) -> None:
    """Record the shard layout on every TP weight of ``model``.

    megatron sets these marks only while initialising its own weights, which our stages skip
    (``perform_initialization=False``); only column-parallel biases get them regardless. The
    layout follows from the module type; SwiGLU's fc1 is the one stride-2 weight.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or getattr(weight, "tensor_model_parallel", False):
            continue
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)):
            stride = 2 if gated_linear_unit and name.endswith("linear_fc1") else 1
            set_tensor_model_parallel_attributes(weight, True, 0, stride)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)


def full_shape(shape: torch.Size, layout: ShardLayout | None, tp_size: int) -> torch.Size:
    """The unsharded shape of a parameter whose local shard has ``shape``."""
    if layout is None:
        return shape
    dims = list(shape)
    dims[layout.dim] *= tp_size
    return torch.Size(dims)


def _blocks(length: int, layout: ShardLayout, tp_size: int) -> int:
    """Size of one interleaved block along the sharded dimension of the full weight."""
    count = layout.stride * tp_size
    if length % count:
        raise ValueError(f"dimension {length} does not split into {count} tensor-parallel blocks")
    return length // count


def take_shard(full: torch.Tensor, layout: ShardLayout | None, rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the full weight (blocks ``rank, rank + T, ...`` along the dim)."""
    if layout is None or tp_size == 1:
        return full
    block = _blocks(full.size(layout.dim), layout, tp_size)
    pieces = torch.split(full, block, dim=layout.dim)
    return torch.cat(pieces[rank::tp_size], dim=layout.dim)


def gather_full(
    local: torch.Tensor, layout: ShardLayout | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The full tensor from every TP rank's shard (collective over ``group``); inverse of
    :func:`take_shard`. Replicated tensors are returned as they are."""
    tp_size = 1 if group is None else dist.get_world_size(group)
    if layout is None or tp_size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    per_rank = [torch.split(s, local.size(layout.dim) // layout.stride, dim=layout.dim) for s in shards]
    ordered = [per_rank[r][k] for k in range(layout.stride) for r in range(tp_size)]
    return torch.cat(ordered, dim=layout.dim)


def stage_tp_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The TP group a megatron-core language model was built with (None: no group, TP = 1)."""
    group = getattr(model, "tp_group", None)
    if group is None or not dist.is_initialized():
        return None
    return group


def tp_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank within ``group`` and the group's size ((0, 1) without a group)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gathered_parameters(stage: Any, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full parameters (or their gradients) of a stage keyed by global name, gathered over its
    TP group: the TP-independent view checkpoints and TP = 1 comparisons need."""
    group = stage_tp_group(stage.model)
    result = {}
    for name, param in stage.global_named_parameters():
        tensor = param.grad if grads else param.detach()
        if tensor is None:
            continue
        result[name] = gather_full(tensor, shard_layout(param), group)
    return result


def tensor_parallel_coordinates(rank: int, tp: int, dp: int, pp: int) -> tuple[int, int, int]:
    """``(tp_rank, dp_rank, pp_rank)`` of a global rank in Megatron's order: TP fastest, then
    DP, then PP. P2P pairs are the ranks of adjacent stages with equal (tp_rank, dp_rank)."""
    if not 0 <= rank < tp * dp * pp:
        raise ValueError(f"rank {rank} outside a TP {tp} x DP {dp} x PP {pp} world")
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def initialize_tensor_parallel(tp_size: int) -> None:
    """Set megatron's parallel state to TP groups of ``tp_size`` consecutive ranks.

    megatron sees pipeline size 1 (our runtime pipelines), so its groups are exactly the TP
    groups of Megatron's TP-fastest order; its "data-parallel" group then spans DP x PP and is
    not for gradient reduction (the runtime keeps its own DP groups).
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tp_size:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=1
    )


def build_tensor_parallel_stage(
    task: Any, config: RunPlan, stage: int, device: torch.device
) -> list[torch.nn.Module]:
    """The runtime's entry point: stage ``stage``'s model chunks sharded over this rank's TP
    group (set up by :func:`initialize_tensor_parallel` after ``init_process_group``).

    The task's own ``build_stage`` does the building: megatron's TP layers read the TP group
    from the parallel state, and initialisation slices the full weights by global name.
    """
    from megatron.core import parallel_state

    tp_size = int(config.parallel.tensor_model_parallel_size)
    check_tensor_parallel_args(config.model, tp_size, config.vocab.size)
    if tp_size > 1 and parallel_state.get_tensor_model_parallel_world_size() != tp_size:
        raise RuntimeError(f"megatron's TP group has size "
                           f"{parallel_state.get_tensor_model_parallel_world_size()}, expected {tp_size}: "
                           "call initialize_tensor_parallel first")
    return task.build_stage(config, stage, device)
