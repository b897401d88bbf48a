"""What both tensor executors share: op dispatch to a worker and report cadence."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.pipeline.comm import Message, op_sends
from megatron.pipeline.ir import Op, OpKind
from megatron.pipeline.runtime.transport import ReportSink  # noqa: F401 - re-exported for the executors
from megatron.pipeline.runtime.worker import StageWorker


@dataclass(frozen=True)
class ReportCadence:
    """Report after update k when ``(k + 1) % interval == 0`` or k is the final update."""

    interval: int
    final_update: int | None = None

    def due(self, update: int) -> bool:
        return (update + 1) % self.interval == 0 or update == self.final_update


def run_compute_op(
    worker: StageWorker, op: Op, inputs: dict[Message, torch.Tensor]
) -> dict[Message, torch.Tensor]:
    """Run F, B, W, BW or EVAL on ``worker`` with received tensors; return the tensors to send.

    B sends the input gradient exactly like BW; W receives and sends nothing. With a tracer on
    the worker's hooks (``--trace-dir``, :mod:`megatron.pipeline.runtime.tracing`) the op's span
    is recorded; with a profiler (a profiled Zero Bubble schedule profiling) F / B / W are timed.
    """
    hooks = worker.hooks
    if not hooks.on:
        return _dispatch(worker, op, inputs)
    tracer, profiler = hooks.tracer, hooks.profiler
    start = tracer.now() if tracer is not None else 0
    if profiler is None:
        outputs = _dispatch(worker, op, inputs)
    else:
        with profiler.timed(op, worker.meter), worker.meter.measuring():  # M_W / M_B needs bytes
            outputs = _dispatch(worker, op, inputs)
    if tracer is not None:
        tracer.record(op, start)
    return outputs


def _dispatch(
    worker: StageWorker, op: Op, inputs: dict[Message, torch.Tensor]
) -> dict[Message, torch.Tensor]:
    # ``inputs`` holds exactly op_recvs(op): both executors build it from there, and a compute op
    # receives one message at most (so it is not derived a second time per op here).
    assert len(inputs) <= 1, f"{op} got {len(inputs)} inputs"
    received_tensor = next(iter(inputs.values())) if inputs else None
    if op.kind is OpKind.F:
        out = worker.forward(op, received_tensor)
    elif op.kind is OpKind.BW:
        out = worker.backward(op, received_tensor)
    elif op.kind is OpKind.B:
        out = worker.backward_input(op, received_tensor)
    elif op.kind is OpKind.EVAL:
        out = worker.eval_forward(op, received_tensor)
    elif op.kind is OpKind.W:
        worker.weight_grad(op)
        out = None
    else:
        raise NotImplementedError(f"stage {op.stage}: op kind {op.kind.value} is not supported yet ({op})")
    sends = op_sends(op, worker.layout)
    return {sends[0]: out} if sends else {}

