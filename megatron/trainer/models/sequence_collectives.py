"""All-gather and reduce-scatter along the sequence (first) dimension, on the input's device.

megatron-core 0.16.1's sequence-parallel mappings (``_gather_along_first_dim``,
``_reduce_scatter_along_first_dim`` in ``tensor_parallel/mappings.py``) allocate their output on
``torch.cuda.current_device()``, so on CPU they fail before any communication. The collectives
themselves are fine on gloo: torch's gloo backend implements ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (checked on torch 2.13). These two functions are the same operations
with the output on the input's device; :func:`use_on_cpu` makes megatron's mappings (the
embedding's scatter, the row-parallel reduce-scatter, their backwards) call them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def gather_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[s/T, ...]`` shards of the T ranks of ``group`` -> ``[s, ...]``, rank order."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    out = torch.empty((x.size(0) * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter_first_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[s, ...]`` partial sums on each rank -> this rank's ``[s/T, ...]`` slice of their sum."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.size(0) % size:
        raise ValueError(f"first dimension {x.size(0)} does not split over {size} tensor-parallel ranks")
    out = torch.empty((x.size(0) // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _gather(input_: torch.Tensor, group: dist.ProcessGroup, output_split_sizes=None,
            use_global_buffer: bool = False) -> torch.Tensor:
    if output_split_sizes is not None:
        raise NotImplementedError("uneven sequence-parallel splits are not used here")
    return gather_first_dim(input_, group)


def _reduce_scatter(input_: torch.Tensor, group: dist.ProcessGroup, input_split_sizes=None,
                    use_global_buffer: bool = False) -> torch.Tensor:
    if input_split_sizes is not None:
        raise NotImplementedError("uneven sequence-parallel splits are not used here")
    return reduce_scatter_first_dim(input_, group)


def use_on_cpu() -> None:
    """Point megatron's sequence-parallel mappings at the device-following collectives (called
    by CPU ranks that build a ``--sequence-parallel`` stage; on CUDA megatron's own are used)."""
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _gather
    mappings._reduce_scatter_along_first_dim = _reduce_scatter
