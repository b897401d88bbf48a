"""ZB-H2: Zero Bubble's handcrafted zero-bubble schedule (Qi et al., §2.3).

More warm-up forwards fill the bubble before the first B, and W passes are delayed twice as
long as in ZB-H1, turning the trapezoid into a parallelogram. Stage ``s`` (0-indexed):

1. warm-up: ``min(2(N - s) - 1, m)`` forwards;
2. for k = 0..m-1: ``B_k``; if ``k >= 2s``, ``W_{k-2s}``; then the next forward, if any;
3. the remaining W passes.

Memory ``(2(N - s) - 1) M_B + 2s M_W`` on stage ``s`` (peak ``(2N - 1) M_B`` on stage 0); the
bubble is ``(N - 1)(T_F + T_B - 2 T_W)``, zero with equal pass times, once ``m >= 2N - 1``.
The paper removes the optimizer synchronisation to keep the parallelogram across iterations
(post-validation, ``PostValidationOptions.post_validation`` / ``--enable-optimizer-post-validation``);
without it each iteration ends with the synchronous step, and the per-stage span of the
simulator measures one iteration the way the paper does.
"""
from __future__ import annotations

from collections.abc import Iterator

from megatron.pipeline.ir import Op
from megatron.pipeline.schedules.base import SynchronousSchedule
from megatron.pipeline.schedules.zero_bubble.zb_h1 import split_backward_order


class ZBH2(SynchronousSchedule):
    name = "zb-h2"

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        n = self.config.num_stages
        return split_backward_order(stage, microbatches, warmup=2 * (n - stage) - 1, w_delay=2 * stage)
