"""V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory"): about half of 1F1B's
activation memory on the V placement, ``(p + 2) // 2`` whole-stage activations.

The order is the greedy V planner's (:mod:`.v_greedy`) under that limit, with equal costs
``T_F = T_B = T_W`` and ``M_W = M_B / 2`` (the paper's setting); not yet the paper's building
block with squeeze and reorder, so its bubble differs from the paper's ``~ p / 2m``
(docs/schedules.md lists both).
"""
from __future__ import annotations

from megatron.pipeline.schedules.v_shape import PlannedVSchedule


class VHalf(PlannedVSchedule):
    name = "v-half"

    @classmethod
    def default_memory_limit(cls, num_stages: int) -> float:
        return 2.0 * ((num_stages + 2) // 2)
