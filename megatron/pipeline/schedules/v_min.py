"""V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory"): about a third of 1F1B's
activation memory on the V placement, ``(p + 4) // 3`` whole-stage activations.

The order is the greedy V planner's (:mod:`.v_greedy`) under that limit, with equal costs and
``M_W = M_B / 2``; not yet the paper's building block with squeeze and reorder, so its bubble
differs from the paper's ``~ 2p / 3m`` (docs/schedules.md lists both).
"""
from __future__ import annotations

from megatron.pipeline.schedules.v_shape import PlannedVSchedule


class VMin(PlannedVSchedule):
    name = "v-min"

    @classmethod
    def default_memory_limit(cls, num_stages: int) -> float:
        return 2.0 * ((num_stages + 4) // 3)
