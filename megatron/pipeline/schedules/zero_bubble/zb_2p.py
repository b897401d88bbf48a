"""ZB-2p: Zero Bubble's automatically searched schedule with twice 1F1B's activation memory.

Same heuristic and options as ZB-1p (:mod:`.zb_1p`); the default limit is ``2 N M_B``, the
least memory with which the paper finds close to zero bubble.
"""
from __future__ import annotations

from megatron.pipeline.schedules.zero_bubble.zb_1p import ZeroBubbleAuto


class ZB2P(ZeroBubbleAuto):
    name = "zb-2p"
    memory_factor = 2.0
