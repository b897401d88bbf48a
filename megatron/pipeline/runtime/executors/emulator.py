"""The emulator: every stage of any schedule in one process, with real tensors.

It replays the same per-stage op streams as the distributed runtime, through the same
:class:`~megatron.pipeline.runtime.executors.core.OpCore` over an in-process transport, with
the same :class:`~megatron.pipeline.runtime.worker.StageWorker` per stage and each stage's own
dropout RNG, so losses and parameters are bitwise those of a distributed run (fp32, CPU, one
thread). It runs depths no machine here has (N=16, 32) on tiny models. What is its own is how
streams advance: :class:`~megatron.pipeline.replay.ReplayEngine` interleaves all stages.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron.pipeline.comm import Message
from megatron.pipeline.ir import Op, OpKind, PipelineLayout
from megatron.pipeline.schedules.zero_bubble.post_validation import ValidationOutcomes
from megatron.pipeline.replay import ReplayEngine
from megatron.pipeline.runtime.executors.common import ReportCadence, ReportSink
from megatron.pipeline.runtime.executors.core import OpCore, SyncHook, UpdateHook
from megatron.pipeline.runtime.transport.in_process import InProcessTransport
from megatron.pipeline.runtime.worker import StageWorker


class Emulator:
    def __init__(
        self,
        workers: list[StageWorker],
        layout: PipelineLayout,
        cadence: ReportCadence,
        sink: ReportSink,
        sync_hook: SyncHook | None = None,
        outcomes: ValidationOutcomes | None = None,
        transport: InProcessTransport | None = None,
        after_update: UpdateHook | None = None,
    ):
        self.workers = workers
        self.layout = layout
        self.core = OpCore(transport or InProcessTransport(layout), workers, cadence, sink, sync_hook, outcomes,
                           after_update)

    def _execute(self, op: Op, inputs: dict[Message, torch.Tensor]) -> dict[Message, torch.Tensor]:
        if op.kind is OpKind.OPT:  # stage-local step
            self.core.step([op])
            return {}
        # Copy what crosses a stage boundary: a distributed receiver gets its own buffer.
        outputs: dict[Message, torch.Tensor] = {}
        self.core.execute(op, inputs, lambda msg, tensor: outputs.__setitem__(msg, tensor.clone()))
        return outputs

    def _execute_sync(self, ops: list[Op]) -> None:
        self.core.step(ops)

    def run(self, streams: list[Iterable[Op]]) -> None:
        ReplayEngine(streams, self.layout, self._execute, self._execute_sync).run()
