"""V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory"): about half of 1F1B's
activation memory on the V placement, ``(p + 2) // 2`` whole-stage activations, bubble about
``p / 2m`` with ``T_F = T_B = T_W``.

Its building block (:mod:`.v_blocks`, in unit slots, period 6) spaces the chunk-0 forwards two
slots apart down the V (stage ``i`` at ``2i``), turns straight into chunk 1 (``3p - i - 2``),
starts the backward after a gap (``3p + g + 2i - 1``) and returns through chunk 0
(``6p + g - i - 2``); ``g = 3`` for even ``p`` keeps the four passes in distinct slots mod 6.
"""
from __future__ import annotations

from megatron.pipeline.schedules.v_shape.blocks import Block
from megatron.pipeline.schedules.v_shape.layout import BlockVSchedule


class VHalf(BlockVSchedule):
    name = "v-half"

    @classmethod
    def block(cls, p: int) -> Block:
        g = 3 if p % 2 == 0 else 0
        return [(2 * i, 3 * p - i - 2, 3 * p + g + 2 * i - 1, 6 * p + g - i - 2) for i in range(p)]
