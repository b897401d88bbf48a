"""The distributed runtime: one process per stage, op streams over torch.distributed P2P.

Ops run through the shared :class:`~megatron.pipeline.runtime.executors.core.OpCore`; what is
this executor's own is how its stream advances: receives are posted a few ops ahead (in op
order, so per-peer FIFO matching is preserved) to overlap communication with compute; sends
are non-blocking, and each sent tensor is released as soon as its send completes
(:class:`~megatron.pipeline.runtime.transport.distributed.P2PChannel`); activations are freed by
the worker as soon as their backward ran. The logging rank collects a step's statistics after
its next compute op, not at the step (the next iteration's first forward goes first). Every wait has a timeout, and any failure is raised as
:class:`PipelineRuntimeError` naming stage and op.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from megatron.pipeline.comm import op_recvs
from megatron.pipeline.ir import Op, OpKind
from megatron.pipeline.schedules.zero_bubble.post_validation import ValidationOutcomes
from megatron.pipeline.runtime.executors.common import ReportCadence, ReportSink
from megatron.pipeline.runtime.executors.core import OpCore, SyncHook, UpdateHook
from megatron.pipeline.runtime.executors.errors import PipelineRuntimeError
from megatron.pipeline.runtime.transport.distributed import DistributedTransport
from megatron.pipeline.runtime.worker import StageWorker


def _is_barrier(op: Op) -> bool:
    """Ops the prefetch window must not look past: what a stream yields after a pipeline-wide
    step may depend on that step's outcome (profiled costs, post-validation), so later ops
    are pulled from the generator only once the barrier has run."""
    return (op.kind is OpKind.OPT and op.sync) or op.kind is OpKind.VALIDATE


class DistributedExecutor:
    """Runs this rank's stage stream; the other stages run in their own processes."""

    def __init__(
        self,
        worker: StageWorker,
        transport: DistributedTransport,
        cadence: ReportCadence,
        sink: ReportSink,
        prefetch_ops: int = 4,
        sync_hook: SyncHook | None = None,
        outcomes: ValidationOutcomes | None = None,
        after_update: UpdateHook | None = None,
    ):
        self.worker = worker
        self.transport = transport
        self.prefetch_ops = prefetch_ops
        self.core = OpCore(transport, {worker.stage: worker}, cadence, sink, sync_hook, outcomes, after_update)
        self.channel = transport.channel(worker)

    def run(self, stream: Iterable[Op]) -> None:
        ops: Iterator[Op] = iter(stream)
        window: deque[Op] = deque()
        layout = self.worker.layout
        current: Op | None = None
        try:
            while True:
                while len(window) < self.prefetch_ops and not (window and _is_barrier(window[-1])):
                    op = next(ops, None)
                    if op is None:
                        break
                    window.append(op)
                    for msg in op_recvs(op, layout):
                        self.channel.post(msg)
                if not window:
                    break
                current = window.popleft()
                if current.kind is OpKind.OPT:
                    self.core.step([current])
                    continue
                inputs = {m: self.channel.wait(m) for m in op_recvs(current, layout)}
                self.core.execute(current, inputs, self.channel.send)
                # The last step's statistics: after this op, whose sends are on their way.
                self.transport.collect_reports()
            current = None
            self.transport.collect_reports()
            self.channel.flush()
        except PipelineRuntimeError as exc:
            raise PipelineRuntimeError(self._where(current) + str(exc)) from exc
        except Exception as exc:
            raise PipelineRuntimeError(self._where(current) + f"{type(exc).__name__}: {exc}") from exc

    def _where(self, op: Op | None) -> str:
        what = f"at {op}" if op is not None else "while draining sends"
        return f"stage {self.transport.groups.stage} (rank {self.transport.rank}) {what}: "
