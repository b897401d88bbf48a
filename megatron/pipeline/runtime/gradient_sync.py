"""A stage's gradients made whole before its step: averaged over its data-parallel replicas.

Why a part of its own: the reduction neither moves tensors between stages (the transport) nor
computes a stage (the worker); it is the data-parallel wrapping of a stage, as DDP wraps a
module next to ``torch.distributed.pipelining``'s stage and schedule. A worker is given its
:class:`GradientSync` at construction and runs every gradient op inside :meth:`GradientSync.grad_op`
(the overlapped buckets launch from inside the backward); the op core calls
:meth:`GradientSync.reduce` before every step (and before post-validation's PSTEP, or the tied
embedding's exchange that precedes it).

What the reduction is, by the options:

* ``--use-distributed-optimizer``: the optimizer reduce-scatters itself, over the group this
  hands it at construction (:mod:`~megatron.pipeline.runtime.distributed_optimizer`);
* ``--overlap-grad-reduce``: bucketed all-reduces launched during the window's last backward
  (:mod:`~megatron.pipeline.runtime.grad_buckets`), waited for at the step;
* otherwise one all-reduce of every gradient, flattened, at the step;

and then, with tensor parallelism, the sequence-parallel parameters' gradients are summed over
the TP group. The emulator (one process, one replica, no TP group) has nothing to reduce: its
workers get no :class:`GradientSync`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron.pipeline.ir import Op
from megatron.pipeline.runtime.grad_buckets import OverlappedGradReduce
from megatron.pipeline.runtime.parallel import DataParallelGroup
from megatron.pipeline.runtime.stage_setup import StageSetup
from megatron.pipeline.runtime.tensor_parallel import reduce_sequence_parallel_grads


class GradientSync:
    """The data-parallel (and sequence-parallel) gradient reduction of one stage."""

    def __init__(self, setup: StageSetup, replicas: DataParallelGroup, bucket_size: int | None = None):
        """``bucket_size``: ``--overlap-grad-reduce``'s bucket size in elements; None: one
        all-reduce of every gradient at the step. Hands the optimizer the replicas' group (the
        distributed optimizer reduce-scatters and gathers over it; others ignore it)."""
        self._optimizer = setup.optimizer
        self._replicas = replicas
        self._tp_group = setup.tp_group
        setup.optimizer.attach(replicas.group, replicas.timeout)
        #: The overlapped buckets (tests and benchmarks read their launches); None: reduced at the step.
        self.buckets = None if bucket_size is None or replicas.size == 1 else \
            _overlapped(setup, replicas, bucket_size)

    @property
    def overlaps(self) -> bool:
        """Whether gradient ops must run inside :meth:`grad_op` (buckets launch during them)."""
        return self.buckets is not None

    def grad_op(self, op: Op, window: int, completes: bool) -> contextlib.AbstractContextManager[None]:
        """Around an op that accumulates gradients of ``op.chunk``; ``window``: micro-batches per
        update; ``completes``: the op finishes its micro-batch's gradients (BW, or W)."""
        if self.buckets is None:
            return contextlib.nullcontext()
        return self.buckets.grad_op(op.microbatch // window, window, op.chunk, completes)

    @property
    def keeps_one_range(self) -> bool:
        """Whether :meth:`reduce` leaves only this replica's range of the gradients averaged (the
        distributed optimizer's reduce-scatter): a sum over stages (the tied embeddings') must
        then come before it, on the whole gradients, as Megatron-LM's ``finalize_model_grads``
        sums its embedding group before the reduce-scatter. Every other reduction averages every
        gradient, and the sum, being linear, may come after it (it does: the buckets are
        in flight by then).

        The two ends then reduce-scatter equal values over their own replicas; at D = 2 each
        element's average is ``(a + b) / 2`` on both, the same bits. At D > 2 a backend's
        summation order may depend on where the element sits in the flat gradients (which
        differs between the two stages): the copies may then differ in the last bit."""
        return self._replicas.size > 1 and self.buckets is None and self._optimizer.sharded

    def reduce(self) -> None:
        """Average the gradients over the replicas, then sum the sequence-parallel ones over the
        TP group (after the average: the buckets write ``p.grad`` back when they finish)."""
        self._average_over_replicas()
        reduce_sequence_parallel_grads(self._optimizer.parameters(), self._tp_group)

    def _average_over_replicas(self) -> None:
        if self._replicas.size == 1:
            return
        if self.buckets is not None:
            self.buckets.finish()
            return
        if self._optimizer.reduce_gradients():  # --use-distributed-optimizer: a reduce-scatter
            return
        _all_reduce_mean(self._optimizer.parameters(), self._replicas)


def _overlapped(setup: StageSetup, replicas: DataParallelGroup, bucket_size: int) -> OverlappedGradReduce:
    """The stage's buckets, per model chunk (a bucket is final when its chunk's window is; the
    tied parameter a V's stage 0 shares between its chunks, when both chunks' windows are)."""
    trained = {id(p) for p in setup.optimizer.parameters()}
    chunk_params = [[p for p in chunk.parameters() if id(p) in trained] for chunk in setup.chunks]
    if {id(p) for params in chunk_params for p in params} != trained:
        raise RuntimeError(f"stage {setup.stage}: --overlap-grad-reduce needs every trained parameter "
                           "in a model chunk")
    return OverlappedGradReduce(chunk_params, bucket_size, replicas.group, replicas.size, replicas.timeout)


def _all_reduce_mean(params: Sequence[torch.nn.Parameter], replicas: DataParallelGroup) -> None:
    """Every gradient averaged over the replicas in one flat all-reduce (missing ones as zeros)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=replicas.group)
    flat /= replicas.size
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
