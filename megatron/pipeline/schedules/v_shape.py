"""What the V-shape schedules share (ZB-V, V-Half, V-Min, DualPipeV): the V placement and
their common checks.

Every stage holds two model chunks, virtual stages ``s`` and ``2p - 1 - s``
(:class:`~megatron.pipeline.ir.VShapeLayout`); the layout, not the schedule, says where
messages go, so a V schedule only orders each stage's F, B, W (or BW) ops.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from megatron.pipeline.ir import Op, PipelineLayout, VShapeLayout
from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError, SynchronousSchedule
from megatron.pipeline.schedules.v_greedy import InfeasibleVMemory, VGreedyPlanner
from megatron.pipeline.simulator import stage_costs


class VShapeSchedule(SynchronousSchedule):
    """A synchronous schedule over the V placement (two chunks per stage, always)."""

    #: fewest micro-batches per iteration, as a multiple of the stage count
    min_microbatches_per_stage: ClassVar[int] = 1

    @classmethod
    def layout_of(cls, config: ScheduleConfig) -> PipelineLayout:
        return VShapeLayout(config.num_stages)

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        super().check_config(config)
        p, m = config.num_stages, config.num_microbatches
        if p < 2:
            raise ScheduleConfigError(f"{cls.name}: a V needs at least 2 pipeline stages, got {p}")
        least = cls.min_microbatches_per_stage * p
        if m < least:
            raise ScheduleConfigError(
                f"{cls.name}: needs at least {least} micro-batches per iteration "
                f"({cls.min_microbatches_per_stage} x {p} stages), got {m}")


class PlannedVSchedule(VShapeSchedule):
    """A V schedule whose order the greedy planner (:mod:`.v_greedy`) decides once, from
    per-stage costs and an activation-memory limit in chunk units of ``M_B``; every iteration
    runs that order, split B/W, then the synchronous step."""

    def __init__(self, config: ScheduleConfig):
        super().__init__(config)
        try:
            self.costs = stage_costs(config.options.get("costs"), config.num_stages)
        except (TypeError, ValueError) as e:
            raise ScheduleConfigError(f"{self.name}: bad costs option: {e}") from None
        limit = config.options.get("memory_limit")
        self.memory_limit = float(self.default_memory_limit(config.num_stages) if limit is None else limit)
        try:
            self.plan = VGreedyPlanner(self.costs, config.num_microbatches, self.memory_limit).plan()
        except InfeasibleVMemory as e:
            raise ScheduleConfigError(f"{self.name}: {e}") from None

    @classmethod
    def default_memory_limit(cls, num_stages: int) -> float:
        """The limit in chunk activations (``M_B`` of one chunk); two make a whole stage's."""
        raise NotImplementedError

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        for kind, index, chunk in self.plan[stage]:
            yield Op(kind, stage, microbatches[index], chunk)

    def fixed_costs(self) -> tuple[Any, ...]:
        return self.costs
