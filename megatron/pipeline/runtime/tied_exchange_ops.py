"""What post-validation's tied-embedding ops do on a stage worker: TGRAD and TSUM.

The schedule half (where the ops go, why that order cannot deadlock) is
:mod:`megatron.pipeline.schedules.zero_bubble.tied_exchange`; the messages follow from the ops
(:mod:`megatron.pipeline.comm`). This half moves the gradients: the output layer's stage sends
its copy's gradient (TGRAD), the embedding's stage adds it to its own, in model order, and sends
the sum back (TSUM), which the output layer's stage takes (TSUM). The arithmetic is the
synchronous step's (:func:`~megatron.pipeline.runtime.tied_embeddings.sum_tied_gradients`:
``embedding + copy``), so both ends, in the emulator and in the distributed runtime, hold the
bits a synchronous step would have summed.
"""
from __future__ import annotations

import torch

from megatron.pipeline.comm import Message, op_recvs, op_sends
from megatron.pipeline.ir import Op, OpKind
from megatron.pipeline.runtime.tied_embeddings import local_tied_gradient, set_tied_gradient, tied_parameters
from megatron.pipeline.runtime.worker import StageWorker


def run_tied_exchange_op(worker: StageWorker, op: Op, inputs: dict[Message, torch.Tensor]) -> dict[Message, torch.Tensor]:
    """Run TGRAD or TSUM on ``worker`` with its received tensors; return the tensors to send
    (fresh ones: the worker never writes to them again, so a send need not copy them)."""
    layout = worker.layout
    ends = tied_parameters(worker.setup.chunks)
    if len(ends) != 1:
        raise RuntimeError(f"stage {worker.stage}: {op} needs exactly one tied end on the stage, "
                           f"found {len(ends)}")
    # One end may roll back a step the other's stage never took (its prefix of the partial
    # state already asked for clipping): an end's rollback must give back the very bits.
    worker.setup.optimizer.roll_back_exactly(ends)
    received = [inputs[m] for m in op_recvs(op, layout)]
    sends = op_sends(op, layout)
    if op.kind is OpKind.TGRAD:  # the output layer's copy: its gradient to the embedding's stage
        (msg,) = sends
        return {msg: local_tied_gradient(ends)}
    if op.kind is not OpKind.TSUM:
        raise ValueError(f"stage {worker.stage}: {op} is not a tied-embedding op")
    (other,) = received
    if not sends:  # the output layer's stage: take the sum
        set_tied_gradient(ends, other)
        return {}
    total = local_tied_gradient(ends)  # the embedding's: embedding + copy, the synchronous order
    total += other
    set_tied_gradient(ends, total)
    (msg,) = sends
    return {msg: total}


__all__ = ["run_tied_exchange_op"]
