"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory"): zero bubble on the V
placement at 1F1B's activation memory, ordered by the greedy V planner (:mod:`.v_greedy`).

Costs come from ``--zb-costs`` (the zero-bubble flags, :mod:`.zb_flags`; placeholder costs
``T_F = T_B = T_W = 1`` without it) or from profiling: ``--zb-profile-iters K`` runs V-Half's
building block (same V layout, B/W split, no costs needed) for the first K iterations while
the executors time every F, B and W per chunk (:mod:`.profiled`), then this order from those
costs. Unlike zb-1p / zb-2p, zb-v does not profile by default (K = 0 unless given): its order
for equal placeholder costs is already zero-bubble. ``--zb-memory-limit X`` is in chunk
activations (``M_B`` of one chunk), default ``2p``: ``p`` whole-stage activations, 1F1B's peak.
"""
from __future__ import annotations

import dataclasses

from megatron.pipeline.schedules.v_shape.layout import PlannedVSchedule
from megatron.pipeline.schedules.zero_bubble.flags import ZERO_BUBBLE_FLAGS


class ZBV(PlannedVSchedule):
    name = "zb-v"
    traits = dataclasses.replace(PlannedVSchedule.traits, flag_defaults=(("zb_profile_iters", 0),),
                                 flag_groups=(*PlannedVSchedule.traits.flag_groups, ZERO_BUBBLE_FLAGS))

    @classmethod
    def default_memory_limit(cls, num_stages: int) -> float:
        return 2.0 * num_stages
