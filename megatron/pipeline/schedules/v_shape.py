"""What the V-shape schedules share (ZB-V, V-Half, V-Min, DualPipeV): the V placement and
their common checks.

Every stage holds two model chunks, virtual stages ``s`` and ``2p - 1 - s``
(:class:`~megatron.pipeline.ir.VShapeLayout`); the layout, not the schedule, says where
messages go, so a V schedule only orders each stage's F, B, W (or BW) ops.
"""
from __future__ import annotations

from typing import ClassVar

from megatron.pipeline.ir import PipelineLayout, VShapeLayout
from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError, SynchronousSchedule


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
