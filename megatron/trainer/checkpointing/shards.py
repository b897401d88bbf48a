"""Tensor-parallel shards in a checkpoint: what region of a global tensor a saved shard holds,
and how a rank of another tensor-parallel size assembles its own region from the shards.

Why regions and not whole tensors: each TP rank writes only its shard (no gather on save, so a
checkpoint costs no collective and no rank ever holds a full weight). A shard of a parameter
split along ``dim`` with ``stride`` s over T ranks is s blocks of ``global / (s T)`` rows along
``dim``; rank r holds blocks ``r, r + T, ..., r + (s - 1) T`` back to back (megatron's layout;
SwiGLU's fc1 has s = 2, ``[gate_r; up_r]``). A :class:`Piece` names one such block: where it
starts in the global tensor, where in the local shard, and how long it is. Loading intersects
the pieces this rank needs with the pieces each saved shard holds and copies the overlaps, so a
rank reads only the files whose shards overlap its region (TP unchanged: exactly one) and no
full tensor is built.

A region may also reach past the saved global length: the padded vocabulary depends on the TP
size (``--make-vocab-size-divisible-by`` x TP). Rows the checkpoint lacks keep what the
destination tensor held (this run's initialisation, a fresh optimizer's zeros); saved rows past
this run's length are dropped. :func:`check_global_shapes` allows that only for vocabulary rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from megatron.trainer.models.tensor_parallel import ShardLayout


class Piece(NamedTuple):
    """One contiguous block of a shard along the sharded dimension."""

    global_start: int
    local_start: int
    length: int


class ShardError(ValueError):
    """A saved tensor that cannot supply this rank's region; one line."""


def shard_pieces(length: int, layout: ShardLayout | None, rank: int, size: int) -> list[Piece]:
    """The blocks rank ``rank`` of ``size`` holds of a global dimension of ``length``
    (the inverse view of :func:`megatron.trainer.models.tensor_parallel.take_shard`)."""
    if layout is None or size == 1:
        return [Piece(0, 0, length)]
    count = layout.stride * size
    if length % count:
        raise ShardError(f"dimension {length} does not split into {count} tensor-parallel blocks")
    block = length // count
    return [Piece((k * size + rank) * block, k * block, block) for k in range(layout.stride)]


def shard_entry(local_shape: tuple[int, ...], layout: ShardLayout | None, rank: int, size: int) -> dict[str, Any]:
    """Index entry of one saved tensor (``metadata.json``): its own ``shape``, the
    ``global_shape`` and the ``offset`` of its first block; a TP shard adds
    ``tensor_parallel`` (``dim``, ``stride``, ``rank``, ``size``): its k-th block of
    ``shape[dim] / stride`` rows starts at ``offset[dim] + k * global_shape[dim] / stride``."""
    shape = list(local_shape)
    if layout is None or size == 1:
        return {"shape": shape, "global_shape": shape, "offset": [0] * len(shape)}
    global_shape = list(shape)
    global_shape[layout.dim] *= size
    offset = [0] * len(shape)
    offset[layout.dim] = shard_pieces(global_shape[layout.dim], layout, rank, size)[0].global_start
    return {"shape": shape, "global_shape": global_shape, "offset": offset,
            "tensor_parallel": {"dim": layout.dim, "stride": layout.stride, "rank": rank, "size": size}}


def entry_layout(entry: dict[str, Any]) -> tuple[ShardLayout, int, int] | None:
    """(layout, rank, size) of a saved TP shard; None for a whole tensor."""
    tp = entry.get("tensor_parallel")
    if tp is None:
        return None
    return ShardLayout(int(tp["dim"]), int(tp["stride"])), int(tp["rank"]), int(tp["size"])


def check_global_shapes(name: str, saved: list[int], ours: list[int], vocab: tuple[int, int]) -> int | None:
    """The dimension along which the saved and this run's global shapes differ (None: equal).
    Only the padded vocabulary may differ (``vocab`` = (saved, ours) padded sizes)."""
    if len(saved) != len(ours):
        raise ShardError(f"{name} has shape {tuple(saved)} in the checkpoint, the model has {tuple(ours)}")
    differ = [d for d in range(len(ours)) if saved[d] != ours[d]]
    if not differ:
        return None
    if len(differ) == 1 and (saved[differ[0]], ours[differ[0]]) == vocab:
        return differ[0]
    raise ShardError(f"{name} has shape {tuple(saved)} in the checkpoint, the model has {tuple(ours)}")


@dataclass(frozen=True)
class Region:
    """How one rank fills one parameter (or one of its optimizer tensors) from saved shards."""

    dim: int | None                               # None: copy a whole tensor as it is
    target: list[Piece]                           # this rank's blocks along ``dim``
    sources: tuple[tuple[str, list[Piece]], ...]  # (rank file, its blocks), only those that overlap

    @property
    def files(self) -> list[str]:
        return [f for f, _ in self.sources]

    def assemble(self, into: torch.Tensor, saved: dict[str, torch.Tensor]) -> torch.Tensor:
        """``into`` (cloned; what this run holds now) with every overlap copied in from
        ``saved`` (rank file -> that file's tensor for this name)."""
        if self.dim is None:
            (file, _), = self.sources
            if saved[file].shape != into.shape:
                raise ShardError(f"shape {tuple(saved[file].shape)} saved, {tuple(into.shape)} here")
            return saved[file].to(into.dtype).clone()
        out = into.detach().clone()
        for file, held in self.sources:
            for mine in self.target:
                for theirs in held:
                    start = max(mine.global_start, theirs.global_start)
                    stop = min(mine.global_start + mine.length, theirs.global_start + theirs.length)
                    if start < stop:
                        out.narrow(self.dim, mine.local_start + start - mine.global_start, stop - start).copy_(
                            saved[file].narrow(self.dim, theirs.local_start + start - theirs.global_start,
                                               stop - start))
        return out


def plan_region(name: str, holders: list[tuple[str, dict[str, Any]]], layout: ShardLayout | None,
                rank: int, size: int, local_shape: tuple[int, ...], vocab: tuple[int, int]) -> Region:
    """Where rank ``rank`` of ``size`` (its parameter sharded as ``layout``) finds its region of
    ``name`` among ``holders`` (rank file, index entry), which hold either one whole tensor
    each (the first is taken: tensor-parallel rank 0's copy of a replicated parameter) or one
    TP shard each."""
    ours = list(local_shape)
    if layout is not None and size > 1:
        ours[layout.dim] *= size
    saved_global = list(holders[0][1]["global_shape"])
    differ = check_global_shapes(name, saved_global, ours, vocab)
    sharded = [(f, e, entry_layout(e)) for f, e in holders if entry_layout(e) is not None]
    dims = {lay[0].dim for _, _, lay in sharded} | ({layout.dim} if layout is not None and size > 1 else set())
    dims |= set() if differ is None else {differ}
    if len(dims) > 1:
        raise ShardError(f"{name} is split along dimensions {sorted(dims)} between the checkpoint and this run")
    if not dims:  # whole tensor to whole tensor: a plain copy
        return Region(None, [Piece(0, 0, 0)], ((holders[0][0], [Piece(0, 0, 0)]),))
    dim = dims.pop()
    target = shard_pieces(ours[dim], layout if size > 1 else None, rank, size)
    if sharded:
        if len(sharded) != sharded[0][2][2]:
            raise ShardError(f"{name}: the checkpoint lists {len(sharded)} of its "
                             f"{sharded[0][2][2]} tensor-parallel shards")
        candidates = [(f, shard_pieces(saved_global[dim], lay[0], lay[1], lay[2])) for f, _, lay in sharded]
    else:
        candidates = [(holders[0][0], [Piece(0, 0, saved_global[dim])])]
    sources = tuple((f, held) for f, held in candidates if _overlaps(target, held))
    return Region(dim, target, sources)


def _overlaps(a: list[Piece], b: list[Piece]) -> bool:
    return any(max(x.global_start, y.global_start) < min(x.global_start + x.length, y.global_start + y.length)
               for x in a for y in b)
