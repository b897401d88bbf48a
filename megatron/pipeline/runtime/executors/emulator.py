"""The emulator: every stage of any schedule in one process, with real tensors.

It replays the same per-stage op streams as the distributed runtime, with the same
:class:`~megatron.pipeline.runtime.worker.StageWorker` per stage and each stage's own dropout RNG,
so losses and parameters are bitwise those of a distributed run (fp32, CPU, one thread).
It runs depths no machine here has (N=16, 32) on tiny models.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from megatron.pipeline.comm import Message
from megatron.pipeline.runtime.executors.common import ReportCadence, ReportSink, run_compute_op
from megatron.pipeline.ir import POST_VALIDATION_KINDS, Op, OpKind, PipelineLayout
from megatron.pipeline.post_validation import ValidationOutcomes
from megatron.pipeline.runtime.post_validation_ops import run_post_validation_op
from megatron.pipeline.replay import ReplayEngine
from megatron.pipeline.runtime.replicas import gather_shards_in_process, has_replicas, reduce_in_process
from megatron.pipeline.runtime.worker import StageWorker


class Emulator:
    def __init__(
        self,
        workers: list[StageWorker],
        layout: PipelineLayout,
        cadence: ReportCadence,
        sink: ReportSink,
        sync_hook: Callable[[list[Op]], None] | None = None,
        outcomes: ValidationOutcomes | None = None,
    ):
        self.workers = workers
        self.layout = layout
        self.cadence = cadence
        self.sink = sink
        # Called after every synchronous step with all stages' ops, before any stream is
        # advanced past it (profiled Zero Bubble schedules decide their order there).
        self.sync_hook = sync_hook
        self.outcomes = outcomes  # post-validated streams read what VALIDATE records here

    def _execute(self, op: Op, inputs: dict[Message, torch.Tensor]) -> dict[Message, torch.Tensor]:
        worker = self.workers[op.stage]
        if op.kind is OpKind.OPT:  # stage-local step
            worker.apply_update(op, [worker.grad_sq_norm(op)])
            self._maybe_report(worker, op)
            return {}
        if op.kind in POST_VALIDATION_KINDS:
            outputs = run_post_validation_op(worker, op, inputs, self.outcomes)
            if op.kind is OpKind.VALIDATE:
                self._maybe_report(worker, op)
            return {m: t.clone() for m, t in outputs.items()}
        # Copy what crosses a stage boundary: a distributed receiver gets its own buffer.
        outputs = run_compute_op(worker, op, inputs)
        return {m: t.clone() for m, t in outputs.items()}

    def _execute_sync(self, ops: list[Op]) -> None:
        if has_replicas(self.layout):  # AMDP: replicas of a logical stage sum their gradients
            norms = reduce_in_process(self.workers, ops)
        else:
            norms = [self.workers[op.stage].grad_sq_norm(op) for op in ops]
        for op in ops:
            self.workers[op.stage].apply_update(op, norms)
        if has_replicas(self.layout):  # sharded optimizer state: each replica stepped its range
            gather_shards_in_process(self.workers, ops)
        for op in ops:
            self._maybe_report(self.workers[op.stage], op)

    def _maybe_report(self, worker: StageWorker, op: Op) -> None:
        if self.cadence.due(op.update):
            self.sink.submit(worker.take_report(op.update), replica=0)

    def _execute_sync_and_hook(self, ops: list[Op]) -> None:
        self._execute_sync(ops)
        if self.sync_hook is not None:
            self.sync_hook(ops)

    def run(self, streams: list[Iterable[Op]]) -> None:
        ReplayEngine(streams, self.layout, self._execute, self._execute_sync_and_hook).run()
