"""Forward-only evaluation streams: every stage runs EVAL for each micro-batch and chunk.

Stage ``s`` runs ``(micro-batch j, chunk c)`` in lexicographic order. That order is a
subsequence of one global topological order of the work, sorted by ``(j, c * N + s)``
(virtual stage ``c * N + s`` only needs virtual stage ``c * N + s - 1`` of the same
micro-batch, which sorts before it), so with non-blocking sends no stage can wait on work
that waits on it: deadlock-free for any depth and number of chunks. The schedule check replays it.

Evaluation runs between training segments, on a drained pipeline (asynchronous schedules
drain at segment ends), so it never mixes with training ops or weight updates.

With replicated pipelines (AMDP, :class:`~megatron.pipeline.ir.MultiPipelineLayout`) a
micro-batch runs only through its own pipeline's chunk; the same global order (micro-batch,
then logical stage) covers it.
"""
from __future__ import annotations

from collections.abc import Iterator

from megatron.pipeline.ir import EVAL, Op, PipelineLayout


def evaluation_ops(stage: int, layout: PipelineLayout, num_microbatches: int) -> Iterator[Op]:
    """One stage's forward-only stream over micro-batches ``0 .. num_microbatches - 1``."""
    for mb in range(num_microbatches):
        for chunk in layout.microbatch_chunks(mb):
            yield EVAL(stage, mb, chunk)


def evaluation_streams(layout: PipelineLayout, num_microbatches: int) -> list[Iterator[Op]]:
    return [evaluation_ops(s, layout, num_microbatches) for s in range(layout.num_stages)]
