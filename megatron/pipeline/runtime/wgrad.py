"""Deferred weight gradients: the W half of a split backward (Zero Bubble's B / W).

Op ``B`` runs autograd with weight-gradient deferral switched on (:func:`defer_weight_grads`).
Layers that support deferral (the split linears in
:mod:`megatron.trainer.models.split_linear`) then compute only their input gradient and
record a :class:`WeightGradWork` in the active :class:`DeferredWeightGrads`: what W needs
(the layer input ``x`` and output gradient ``dy``) and where the result accumulates. The
stage worker keeps one record per (micro-batch, chunk) and runs it at op ``W``.

Every other module (LayerNorm, embeddings, a plain ``torch.nn.Linear``, any stage model
without split linears) ignores the switch and computes its weight gradients in B as usual,
so B + W is always correct; W simply has less (or nothing) to do.

The switch is process-wide rather than thread-local on purpose: on CUDA, autograd runs
backward functions on its own device threads, not on the thread that called ``backward``.
A stage runs one op at a time, so there is never more than one switch in effect.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch


class WeightGradWork(Protocol):
    """One deferred weight-gradient computation (typically one linear layer, one micro-batch)."""

    def run(self) -> None:
        """Compute the weight gradients and accumulate them into ``.grad``; idempotent."""

    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors it keeps alive until it runs (for memory accounting)."""


class DeferredWeightGrads:
    """The weight-gradient work a split backward left for W, in the order it was recorded."""

    def __init__(self) -> None:
        self._work: list[WeightGradWork] = []

    def add(self, work: WeightGradWork) -> None:
        self._work.append(work)

    def __len__(self) -> int:
        return len(self._work)

    def tensors(self) -> list[torch.Tensor]:
        """Everything still held for W (work already run holds nothing)."""
        return [t for work in self._work for t in work.tensors()]

    def run(self) -> None:
        """Run all pending work (in recording order) and drop it."""
        work, self._work = self._work, []
        for item in work:
            item.run()


_active: DeferredWeightGrads | None = None


@contextlib.contextmanager
def defer_weight_grads(store: DeferredWeightGrads | None = None) -> Iterator[DeferredWeightGrads]:
    """Within the block, deferrable layers queue their weight gradients in ``store``.

    Wrap the ``backward`` call of a split backward (B) in it; run the yielded store later
    (op W) to obtain the same gradients as a fused backward.
    """
    global _active
    store = DeferredWeightGrads() if store is None else store
    previous, _active = _active, store
    try:
        yield store
    finally:
        _active = previous


def active_deferral() -> DeferredWeightGrads | None:
    """The store deferrable layers should record into now, or None (compute in backward)."""
    return _active


@torch.no_grad()
def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add a deferred gradient to ``param.grad`` the way autograd's ``AccumulateGrad`` does
    outside grad mode (assign if None, else add in place), so B then W leaves ``.grad`` as a
    fused backward would. Shared by every deferrable layer (megatron split linears, the
    synthetic-cost benchmark's linear)."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
