"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory"): zero bubble on the V
placement at 1F1B's activation memory, ordered by the greedy V planner (:mod:`.v_greedy`).

Costs come from ``--zb-costs`` (the zero-bubble flags, :mod:`.zb_flags`; placeholder costs
``T_F = T_B = T_W = 1`` without it); ``--zb-memory-limit X`` is in chunk activations (``M_B``
of one chunk), default ``2p``: ``p`` whole-stage activations, 1F1B's peak. Profiling
(``--zb-profile-iters K > 0``) is refused: its warm-up runs ZB-H1, another layout.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError
from megatron.pipeline.schedules.v_shape import PlannedVSchedule
from megatron.pipeline.schedules.zb_flags import PROFILE_OPTION, ZERO_BUBBLE_FLAGS


class ZBV(PlannedVSchedule):
    name = "zb-v"
    flag_groups = (*PlannedVSchedule.flag_groups, ZERO_BUBBLE_FLAGS)

    @classmethod
    def options_from_flags(cls, values: Mapping[str, Any], config: ScheduleConfig) -> dict[str, Any]:
        if values.get("zb_profile_iters"):
            raise ScheduleConfigError(
                f"{cls.name}: --zb-profile-iters is not supported (profiling runs ZB-H1 on another layout); "
                f"pass --zb-costs T_F,T_B,T_W,T_COMM")
        options = super().options_from_flags({**values, "zb_profile_iters": 0}, config)
        options.pop(PROFILE_OPTION, None)
        return options

    @classmethod
    def default_memory_limit(cls, num_stages: int) -> float:
        return 2.0 * num_stages
