"""V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory"): about a third of 1F1B's
activation memory on the V placement, ``(p + 4) // 3`` whole-stage activations, bubble about
``2p / 3m`` with ``T_F = T_B = T_W``.

Its building block (:mod:`.v_blocks`, in unit slots, period 6) is the tightest V: forwards one
slot apart down and back up (stage ``i`` at ``i`` and ``2p - 1 - i``), the backward right
after (``2p + g + i``, then ``4p + g - 1 - i``); ``g = 2`` when ``3 | p`` keeps the four
passes in distinct slots mod 6.
"""
from __future__ import annotations

from megatron.pipeline.schedules.v_shape.blocks import Block
from megatron.pipeline.schedules.v_shape.layout import BlockVSchedule


class VMin(BlockVSchedule):
    name = "v-min"

    @classmethod
    def block(cls, p: int) -> Block:
        g = 2 if p % 3 == 0 else 0
        return [(i, 2 * p - 1 - i, 2 * p + g + i, 4 * p + g - 1 - i) for i in range(p)]
