"""Tied embeddings under optimizer post-validation: where the two ends' gradient sum goes.

A synchronous step sums the tied embedding's two gradients (the embedding's on its stage, the
output layer's copy on the last model part's stage) in a collective over both stages, then
steps. Post-validation has no such step: each stage steps optimistically at its own PSTEP, and
the PSTEPs form a chain (stage 0 first, the last stage last, each waiting for the partial state
of the one before). A collective between the first and the last stage *at* their PSTEPs
deadlocks or serialises the chain: stage 0's PSTEP would wait for the last stage's, which
waits for the partial state stage 0 has not sent yet.

The sum is made of point-to-point ops placed right before each end's PSTEP instead, ordered
along the gradients' own dependencies (the output layer's gradient is final at the end of the
last stage's iteration, which never waits for stage 0's step):

* the output layer's stage: ``TGRAD #k`` (send the copy's gradient to the embedding's stage),
  then ``TSUM #k`` (receive the sum), then ``PSTEP #k``;
* the embedding's stage: ``TSUM #k`` (receive the copy's gradient, add it to the embedding's,
  send the sum back), then ``PSTEP #k``.

Stage 0 thus waits at most for the last stage's end of iteration (which, in every schedule
that flushes, comes before stage 0's: its backwards feed stage 0's), and the last stage's TSUM
waits for stage 0's, which precedes the partial-state chain it waits for anyway. Both ends
step the same bits (``emb + copy``, the sum the synchronous step's two-rank all-reduce gives),
so the PSTEP chain, VALIDATE's rollbacks and redos act on both alike. Messages follow from the
ops (:func:`megatron.pipeline.comm.op_recvs`, their own lane between the two stages), so the
replay engine, the schedule check and both executors run the same exchange.

Which streams get the ops is the model's business (whether it ties, :func:`with_tied_exchange`
is applied to the streams of the stages holding an end), not the schedule's: every synchronous
schedule's post-validated streams take them the same way, at their PSTEPs.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from megatron.pipeline.comm import tied_ends
from megatron.pipeline.ir import TGRAD, TSUM, Op, OpKind, PipelineLayout


def exchanges_tied_gradients(stage: int, layout: PipelineLayout) -> bool:
    """Whether ``stage`` holds one end of a tied embedding whose other end is on another stage."""
    embedding, output = tied_ends(layout)
    return embedding != output and stage in (embedding, output)


def with_tied_exchange(stream: Iterable[Op], stage: int, layout: PipelineLayout) -> Iterator[Op]:
    """``stream`` (one stage's ops) with the tied gradients' exchange before each PSTEP (module
    docstring); unchanged on a stage holding no end, or both."""
    if not exchanges_tied_gradients(stage, layout):
        yield from stream
        return
    _, output = tied_ends(layout)
    for op in stream:
        if op.kind is OpKind.PSTEP:
            if stage == output:
                yield TGRAD(stage, op.update)
            yield TSUM(stage, op.update)
        yield op


__all__ = ["exchanges_tied_gradients", "with_tied_exchange"]
