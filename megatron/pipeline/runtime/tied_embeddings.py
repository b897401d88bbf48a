"""Tied input embedding and output layer across pipeline stages (Megatron's embedding group).

With one chunk holding both ends (PP = 1) the output layer reads the embedding's own weight:
one parameter, whose gradient autograd sums. With the ends on different chunks, the chunk of
the output layer holds a copy (:data:`TIED_COPY`), initialised from the embedding's global name
(so the two start equal), and before each synchronous step the two gradients are summed and
both copies receive the sum (under post-validation, before each end's optimistic step:
:mod:`megatron.pipeline.runtime.tied_exchange_ops`). The same sum, the same optimizer state and the same step keep the
copies bitwise equal; ``a + b == b + a`` in IEEE arithmetic, so a two-rank all-reduce gives both
ends the same bits and the emulator's local sum the same bits again.

Which ranks take part is read from the parameters each worker holds (:data:`TIED`), not from
stage indices. A stage holding both ends in different chunks (the V layout's stage 0: virtual
stages 0 and 2p-1) needs no copy: :func:`share_local_ends` makes its output layer read the
embedding's own parameter, one parameter as at PP = 1, whose gradient autograd (or a deferred
W) accumulates from both chunks; the stage then lists it once (:func:`unique`) and has nothing
to sum or to send. The copy is left out of gradient and parameter norms and of parameter
counts, as Megatron leaves out its ``shared`` parameters: the model has one such weight.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

TIED = "tied_embedding"  # attribute: this parameter is one end of the tied embedding
TIED_COPY = "tied_embedding_copy"  # attribute: the output layer's copy (not counted twice)


def mark_tied(embedding: torch.nn.Parameter | None, output_copy: torch.nn.Parameter | None) -> None:
    """Mark the ends a chunk holds (None: the chunk does not hold that end)."""
    if embedding is not None:
        setattr(embedding, TIED, True)
    if output_copy is not None:
        setattr(output_copy, TIED, True)
        setattr(output_copy, TIED_COPY, True)


def is_tied_copy(param: torch.Tensor) -> bool:
    return bool(getattr(param, TIED_COPY, False))


def unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """``params`` in order, each parameter once (a shared end appears in two chunks)."""
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


def counted(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """``params`` without the tied copies, each once: what norms and parameter counts see."""
    return [p for p in unique(params) if not is_tied_copy(p)]


def tied_parameters(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The tied ends held by ``chunks``, in chunk order (the embedding's chunk comes first),
    each once."""
    return unique(p for chunk in chunks for p in chunk.parameters() if getattr(p, TIED, False))


def share_local_ends(output_layer: torch.nn.Module, embedding: torch.nn.Parameter) -> None:
    """Let ``output_layer`` (a chunk's, holding a tied copy) read ``embedding`` (another chunk's
    on the same stage) instead: the copy is dropped and the two chunks share one parameter."""
    if not getattr(output_layer.weight, TIED_COPY, False) or not getattr(embedding, TIED, False):
        raise ValueError("share_local_ends: expects the output layer's tied copy and the tied embedding")
    if output_layer.weight.shape != embedding.shape:
        raise ValueError(f"share_local_ends: copy {tuple(output_layer.weight.shape)} != "
                         f"embedding {tuple(embedding.shape)}")
    output_layer.weight = embedding


def local_tied_gradient(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """The sum of the gradients of the ends in ``params`` (this process's, in model order: the
    embedding's first), a fresh tensor (a missing gradient counts as zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    return total


def set_tied_gradient(params: Sequence[torch.nn.Parameter], total: torch.Tensor) -> None:
    """Give every end in ``params`` the gradient ``total`` (written into existing gradients:
    they may be views of a flat buffer)."""
    for p in params:
        if p.grad is None:
            p.grad = total.clone()
        else:
            p.grad.copy_(total)


def sum_tied_gradients(params: Sequence[torch.nn.Parameter],
                       all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
    """Give every end in ``params`` (this process's, in model order) the sum of all ends'
    gradients; ``all_reduce`` sums this process's partial sum with the other holders'."""
    if not params or (len(params) == 1 and all_reduce is None):
        return
    total = local_tied_gradient(params)
    if all_reduce is not None:
        all_reduce(total)
    set_tied_gradient(params, total)
