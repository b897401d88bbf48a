"""ZB-H1: Zero Bubble's memory-efficient handcrafted schedule (Qi et al., §2.2).

1F1B with the backward split into B (input gradient) and W (weight gradient); stage ``s``
(0-indexed) delays its W passes by ``s`` backwards, so the tail bubbles of 1F1B fill with W.
Per-stage order, over the iteration's micro-batches ``0..m-1``:

1. warm-up: ``min(N - s, m)`` forwards;
2. for k = 0..m-1: ``B_k``; if ``k >= s``, ``W_{k-s}``; then the next forward, if any;
3. the remaining W passes in micro-batch order.

The slot order B -> W -> F gives exactly the paper's memory ``(N - s) M_B + s M_W`` on stage
``s``, at most 1F1B's peak ``N M_B``; the bubble shrinks to ``(N - 1)(T_F + T_B - T_W)``.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from megatron.pipeline.ir import B, F, Op, W
from megatron.pipeline.schedules.base import SynchronousSchedule


def split_backward_order(
    stage: int, microbatches: Sequence[int], warmup: int, w_delay: int
) -> Iterator[Op]:
    """Warm-up forwards, then per slot ``B, [W delayed by w_delay backwards], F``, then W's."""
    m = len(microbatches)
    warmup = min(warmup, m)
    for j in range(warmup):
        yield F(stage, microbatches[j])
    next_f, next_w = warmup, 0
    for k in range(m):
        yield B(stage, microbatches[k])
        if k >= w_delay:
            yield W(stage, microbatches[next_w])
            next_w += 1
        if next_f < m:
            yield F(stage, microbatches[next_f])
            next_f += 1
    for j in range(next_w, m):
        yield W(stage, microbatches[j])


class ZBH1(SynchronousSchedule):
    name = "zb-h1"

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        n = self.config.num_stages
        return split_backward_order(stage, microbatches, warmup=n - stage, w_delay=stage)
