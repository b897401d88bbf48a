"""Flat-range sharding of a list of parameters, shared by the two ZeRO-1 users.

AMDP shards a logical stage's optimizer state over the stage's replicas
(:mod:`~megatron.pipeline.runtime.replicas`), ``--use-distributed-optimizer`` shards a stage's
over its data-parallel replicas (:mod:`~megatron.pipeline.runtime.distributed_optimizer`). Both
see the parameters as one flat vector (parameter order), cut it into near-equal contiguous
ranges, give each owner the intersection of its range with every parameter
(``StageAdamW(shards=...)``), and afterwards put the owners' ranges back together. AdamW is
element-wise with per-step scalars every owner computes alike, so a sharded step gives each
element the bits the unsharded step gives it; only the arithmetic here decides who owns what.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def shard_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """The flat range ``[start, stop)`` of part ``index`` of ``parts`` near-equal parts."""
    return numel * index // parts, numel * (index + 1) // parts


def owned_ranges(params: Sequence[torch.Tensor], lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """``(i, start, stop)``: the part ``[start, stop)`` of parameter ``i``'s flat elements that
    lies inside the flat range ``[lo, hi)`` of all ``params`` (an empty part is ``(0, 0)``)."""
    offset = 0
    for i, p in enumerate(params):
        start, stop = max(lo, offset), min(hi, offset + p.numel())
        yield (i, start - offset, stop - offset) if stop > start else (i, 0, 0)
        offset += p.numel()


def flat_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    """One dtype that holds every parameter's values exactly (their common one, else the
    promotion: bf16 and fp16 values are exact in fp32), for one flat buffer of mixed params."""
    dtype = params[0].dtype
    for p in params[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


def flat_values(params: Sequence[torch.Tensor], lo: int = 0, hi: int | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """The flat range ``[lo, hi)`` (default: everything) of the parameters' values, one copy."""
    hi = sum(p.numel() for p in params) if hi is None else hi
    dtype = dtype or flat_dtype(params)
    parts = [p.detach().reshape(-1)[start:stop].to(dtype) for i, start, stop in owned_ranges(params, lo, hi)
             if stop > start for p in (params[i],)]
    if not parts:
        return torch.empty(0, dtype=dtype, device=params[0].device)
    return torch.cat(parts)


def assign_flat(tensors: Sequence[torch.Tensor], flat: torch.Tensor, lo: int = 0) -> None:
    """Write ``flat`` into the flat range of ``tensors`` (parameters or their gradients) that
    starts at ``lo``, through ``.data``: no autograd version counter moves (see the optimizer)."""
    pos = 0
    for i, start, stop in owned_ranges(tensors, lo, lo + flat.numel()):
        if stop > start:
            tensors[i].data.view(-1)[start:stop].copy_(flat[pos:pos + stop - start])
            pos += stop - start


def part_length(numel: int, parts: int) -> int:
    """The longest part's length: every part is padded to it where a collective (gloo's and
    NCCL's all-gather, reduce-scatter) wants equal sizes."""
    return -(-numel // parts)


def padded_part(values: torch.Tensor, numel: int, parts: int, index: int) -> torch.Tensor:
    """Part ``index`` of ``values`` (all ``numel`` elements, or just that part's own elements),
    zero-padded to :func:`part_length`."""
    lo, hi = shard_range(numel, parts, index)
    out = values.new_zeros(part_length(numel, parts))
    out[:hi - lo] = values[lo:hi] if values.numel() == numel else values
    return out


def unpadded(parts: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """The flat vector of ``numel`` elements from its padded parts, in part order."""
    return torch.cat([part[:hi - lo] for index, part in enumerate(parts)
                      for lo, hi in (shard_range(numel, len(parts), index),)])


# -- optimizer state in checkpoints: the owners' parts gathered whole, a whole state cut again --

#: The per-parameter tensors of AdamW's state (a "master" only for bf16/fp16 parameters).
STATE_KINDS = ("exp_avg", "exp_avg_sq", "master")


def owned_state(entries: dict[str, dict[str, torch.Tensor]], names: Sequence[str],
                params: Sequence[torch.Tensor], lo: int, hi: int, kind: str) -> torch.Tensor:
    """The flat range ``[lo, hi)`` of one ``kind`` of optimizer state over ``params`` (named
    ``names``), from a sharded optimizer's ``state_dict()["params"]``, whose entries hold each
    parameter's owned part flat; zeros where a parameter has none of that kind (an fp32
    parameter is its own master). The part an owner contributes to a gather of the whole."""
    device = params[0].device
    pieces = [entries[names[i]][kind].reshape(-1).float() if kind in entries.get(names[i], {})
              else torch.zeros(stop - start, device=device)
              for i, start, stop in owned_ranges(params, lo, hi) if stop > start]
    return torch.cat(pieces) if pieces else torch.zeros(0, device=device)


def add_whole_state(whole: dict[str, dict[str, torch.Tensor]], kind: str, flat: torch.Tensor,
                    names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
    """Cut the gathered flat vector of one ``kind`` over all ``params`` into per-parameter
    tensors in parameter shape, into ``whole`` (name -> kind -> tensor): the form the unsharded
    optimizer saves, so a checkpoint of it loads into any layout. Masters only of bf16/fp16
    parameters, as there."""
    offset = 0
    for name, p in zip(names, params):
        if kind != "master" or p.dtype in (torch.bfloat16, torch.float16):
            whole.setdefault(name, {})[kind] = flat[offset:offset + p.numel()].view(p.shape).clone()
        offset += p.numel()


def owned_entries(entries: dict[str, dict[str, torch.Tensor]], names: Sequence[str],
                  params: Sequence[torch.Tensor], lo: int, hi: int) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse of a gather: a whole state's entries (parameter shape) cut to the flat range
    ``[lo, hi)`` of ``params`` an owner keeps, bit for bit. A tensor that is not whole (a
    checkpoint saved sharded, before the shards were gathered at save) is that owner's part
    already and stays as it is."""
    owned = {}
    for i, start, stop in owned_ranges(params, lo, hi):
        name = names[i]
        if stop > start and name in entries:
            owned[name] = {k: t.reshape(-1)[start:stop].clone() if t.numel() == params[i].numel() else t
                           for k, t in entries[name].items()}
    return owned
