"""ZB-1p: Zero Bubble's automatically searched schedule at 1F1B's activation memory.

The order comes from the greedy heuristic (:mod:`.zb_greedy`) fed with per-stage costs and an
activation-memory limit, by default ``N * M_B`` (the peak of 1F1B). Options
(:class:`~.flags.ZeroBubbleOptions`):

* ``costs``: :class:`~megatron.pipeline.simulator.OpCosts`, one per stage, or a profile
  mapping; default ``OpCosts()`` (``t_f = t_b = t_w = 1``, ``t_comm = 0``, ``m_w = 1/2``), the
  reference's placeholder until the runtime passes profiled times;
* ``memory_limit``: the limit in units of ``M_B`` (overrides the default).

Its flags (``--zb-*``, shared with ZB-2p) are declared in :mod:`.zb_flags`.

Every iteration runs the same order (costs do not change within a run), then the synchronous
optimizer step.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import ClassVar

from megatron.pipeline.ir import Op
from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError, SynchronousSchedule
from megatron.pipeline.schedules.config import options_as
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.schedules.zero_bubble.flags import ZERO_BUBBLE_FLAGS, ZeroBubbleOptions
from megatron.pipeline.schedules.zero_bubble.greedy import GreedyResult, InfeasibleMemory, best_greedy_order
from megatron.pipeline.costs.op_costs import stage_costs


class ZeroBubbleAuto(SynchronousSchedule):
    """Greedy Zero Bubble schedule with a memory limit of ``memory_factor * N * M_B``."""

    memory_factor: ClassVar[float]
    traits = dataclasses.replace(SynchronousSchedule.traits, options=ZeroBubbleOptions,
                                 flag_groups=(*SynchronousSchedule.traits.flag_groups, ZERO_BUBBLE_FLAGS))

    def __init__(self, config: ScheduleConfig):
        super().__init__(config)
        n = config.num_stages
        options = options_as(config.options, ZeroBubbleOptions)
        try:
            self.costs = stage_costs(options.costs, n)
        except (TypeError, ValueError) as e:
            raise ScheduleConfigError(f"{self.name}: bad costs option: {e}") from None
        limit = options.memory_limit
        self.memory_limit = float(self.memory_factor * n if limit is None else limit)
        try:
            self.plan: GreedyResult = best_greedy_order(self.costs, config.num_microbatches, self.memory_limit)
        except InfeasibleMemory as e:
            raise ScheduleConfigError(f"{self.name}: {e}") from None

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        for kind, idx in self.plan.order[stage]:
            yield Op(kind, stage, microbatches[idx])

    @functools.cached_property
    def policy(self) -> SchedulePolicy:
        """The synchronous policy, with the costs this order was decided from (the start logs its bubble)."""
        return dataclasses.replace(super().policy, fixed_costs=self.costs)


class ZB1P(ZeroBubbleAuto):
    name = "zb-1p"
    memory_factor = 1.0
