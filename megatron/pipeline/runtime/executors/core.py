"""The op-execution core both executors share: what an op does to the stages, written once.

An executor decides *when* an op runs (the emulator replays every stage's stream; the runtime
prefetches its stage's receives) and hands the op here with its received tensors. Everything
that needs another stage goes through the :class:`~megatron.pipeline.runtime.transport.Transport`
(the synchronous step's gathers: norms over the sync group; AMDP's replica sums and shard
gathers, :class:`~megatron.pipeline.runtime.replicas.ReplicaReduction`; the tied embeddings'
sum; the reports), except the data-parallel reduction, which is each worker's
:class:`~megatron.pipeline.runtime.gradient_sync.GradientSync` (called here before a step). So
the optimizer step, post-validation's ops, compute ops and the report cadence exist once, for
every transport.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron.pipeline.comm import Message
from megatron.pipeline.ir import POST_VALIDATION_KINDS, TIED_EXCHANGE_KINDS, Op, OpKind, PipelineLayout
from megatron.pipeline.schedules.zero_bubble.post_validation import ValidationOutcomes
from megatron.pipeline.runtime.post_validation_ops import run_post_validation_op
from megatron.pipeline.runtime.tied_exchange_ops import run_tied_exchange_op
from megatron.pipeline.runtime.executors.common import ReportCadence, run_compute_op
from megatron.pipeline.runtime.replicas import ReplicaReduction, has_replicas
from megatron.pipeline.runtime.tied_embeddings import sum_tied_gradients, tied_parameters
from megatron.pipeline.runtime.transport import ReportSink, Transport
from megatron.pipeline.runtime.worker import StageWorker, Workers

SyncHook = Callable[[list[Op]], None]
"""Called after every synchronous step with the local stages' ops of it, before any later op of
those streams is pulled (profiled Zero Bubble schedules decide their order there)."""


UpdateHook = Callable[[int], None]
"""Called with the update's number after every OPT of a local stage (after its report is
submitted): the trainer's per-update process work, such as ``--manual-gc``'s collections."""

Send = Callable[[Message, torch.Tensor], None]


class StageNorms:
    """A synchronous step's collectives for one chain: every stage's own squared norm,
    gathered over the sync group in stage order (summed with ``math.fsum`` by the worker)."""

    def norms(self, transport: Transport, workers: Workers, ops: Sequence[Op]) -> list[float]:
        device = workers[ops[0].stage].setup.device
        return transport.sync_gather([workers[op.stage].grad_sq_norm(op) for op in ops], device)

    def finish(self, transport: Transport, workers: Workers, ops: Sequence[Op]) -> None:
        pass


def step_reduction(layout: PipelineLayout) -> StageNorms | ReplicaReduction:
    """What a synchronous step of ``layout`` exchanges: AMDP's replicas sum gradients first."""
    return ReplicaReduction() if has_replicas(layout) else StageNorms()


class OpCore:
    """Runs ops on the local stages' workers over ``transport``."""

    def __init__(self, transport: Transport, workers: Workers, cadence: ReportCadence, sink: ReportSink,
                 sync_hook: SyncHook | None = None, outcomes: ValidationOutcomes | None = None,
                 after_update: UpdateHook | None = None):
        self.transport = transport
        self.workers = workers
        self.cadence = cadence
        self.sink = sink
        self.sync_hook = sync_hook
        self.outcomes = outcomes  # post-validated streams read what VALIDATE records here
        self.after_update = after_update
        self.reduction = step_reduction(transport.layout)
        self._reduced: dict[int, int] = {}  # stage -> the post-validated update its gradients are averaged for

    def execute(self, op: Op, inputs: dict[Message, torch.Tensor], send: Send) -> None:
        """Run a non-OPT op with its received tensors; hand each tensor to send to ``send``."""
        worker = self.workers[op.stage]
        if op.kind not in POST_VALIDATION_KINDS:
            outputs = run_compute_op(worker, op, inputs)
        elif op.kind in TIED_EXCHANGE_KINDS:
            if not _keeps_one_range(worker):  # the sum after the replicas' average, as at a step
                self._reduce_once(worker, op)
            outputs = run_tied_exchange_op(worker, op, inputs)
        else:
            if op.kind is OpKind.PSTEP:  # steps on this replica's share: average over replicas first
                self._reduce_once(worker, op)
            outputs = run_post_validation_op(worker, op, inputs, self.outcomes)
        for msg, tensor in outputs.items():
            send(msg, tensor)
        if op.kind is OpKind.VALIDATE:  # reports of post-validated updates are taken here
            self._maybe_report(worker, op)
            if self.after_update is not None:
                self.after_update(op.update)

    def step(self, ops: Sequence[Op]) -> None:
        """An OPT: one stage-local step, or the local stages' ops of one synchronous step."""
        # Every tied end of the local stages, and of the other holders, gets their sum (Megatron's
        # embedding group): on the whole gradients, so before a reduction that keeps one range.
        tied_first = ops[0].sync and any(_keeps_one_range(self.workers[op.stage]) for op in ops)
        if tied_first:
            self._sum_tied(ops)
        for op in ops:
            _reduce_gradients(self.workers[op.stage])
        if ops[0].sync:
            if not tied_first:
                self._sum_tied(ops)
            norms = self.reduction.norms(self.transport, self.workers, ops)
        else:
            (op,) = ops
            norms = [self.workers[op.stage].grad_sq_norm(op)]
        for op in ops:
            self.workers[op.stage].apply_update(op, norms)
        if ops[0].sync:
            self.reduction.finish(self.transport, self.workers, ops)
        for op in ops:
            self._maybe_report(self.workers[op.stage], op)
        if ops[0].sync and self.sync_hook is not None:
            self.sync_hook(list(ops))
        if self.after_update is not None:
            self.after_update(ops[0].update)

    def _reduce_once(self, worker: StageWorker, op: Op) -> None:
        """Average the stage's gradients of update ``op.update`` over its replicas, unless an
        earlier op of that update did (a tied exchange before the PSTEP)."""
        if self._reduced.get(worker.stage) != op.update:
            _reduce_gradients(worker)
            self._reduced[worker.stage] = op.update

    def _sum_tied(self, ops: Sequence[Op]) -> None:
        sum_tied_gradients([p for op in ops for p in tied_parameters(self.workers[op.stage].setup.chunks)],
                           self.transport.tied_all_reduce())

    def _maybe_report(self, worker: StageWorker, op: Op) -> None:
        if self.cadence.due(op.update):
            self.sink.submit(worker.take_report(op.update), replica=self.transport.dp_rank)


def _keeps_one_range(worker: StageWorker) -> bool:
    return worker.grad_sync is not None and worker.grad_sync.keeps_one_range


def _reduce_gradients(worker: StageWorker) -> None:
    """Average the stage's gradients over its data-parallel replicas (before any norm)."""
    if worker.grad_sync is not None:
        worker.grad_sync.reduce()
