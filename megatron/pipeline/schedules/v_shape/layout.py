"""What the V-shape schedules share (ZB-V, V-Half, V-Min, DualPipeV): the V placement and
their common checks.

Every stage holds two model chunks, virtual stages ``s`` and ``2p - 1 - s``
(:class:`~megatron.pipeline.ir.VShapeLayout`); the layout, not the schedule, says where
messages go, so a V schedule only orders each stage's F, B, W (or BW) ops.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import ClassVar

from megatron.pipeline.ir import Op, VShapeLayout
from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError, SynchronousSchedule, synchronous_policy
from megatron.pipeline.schedules.config import options_as
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.schedules.zero_bubble.flags import ZeroBubbleOptions
from megatron.pipeline.schedules.v_shape.blocks import Block, block_plan
from megatron.pipeline.schedules.v_shape.greedy import InfeasibleVMemory, PlannedOp, best_v_plan
from megatron.pipeline.costs.op_costs import stage_costs, stage_mean


def _is_sequence(costs: object) -> bool:
    return isinstance(costs, (list, tuple))


def v_shape_policy(config: ScheduleConfig) -> SchedulePolicy:
    """A synchronous schedule's policy on the V placement (two chunks per stage)."""
    return dataclasses.replace(synchronous_policy(config), layout=VShapeLayout(config.num_stages))


class VShapeSchedule(SynchronousSchedule):
    """A synchronous schedule over the V placement (two chunks per stage, always)."""

    traits = dataclasses.replace(SynchronousSchedule.traits, policy_for=v_shape_policy)

    #: fewest micro-batches per iteration, as a multiple of the stage count
    min_microbatches_per_stage: ClassVar[int] = 1
    #: every stage's order of one iteration, decided once: (kind, micro-batch index, chunk)
    plan: list[list[PlannedOp]]

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        """The planned order over this iteration's micro-batches (then the synchronous step)."""
        for kind, index, chunk in self.plan[stage]:
            yield Op(kind, stage, microbatches[index], chunk)

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
    """A V schedule whose order the greedy planner (:mod:`.v_greedy`, best of its variants)
    decides once, from per-stage costs (or ``2p`` per V chunk, virtual-stage order: an uneven
    layer split's chunks; the stages then report their mean) and an activation-memory limit in
    chunk units of ``M_B``; every iteration runs that order, split B/W, then the synchronous step."""

    traits = dataclasses.replace(VShapeSchedule.traits, options=ZeroBubbleOptions)

    def __init__(self, config: ScheduleConfig):
        super().__init__(config)
        options = options_as(config.options, ZeroBubbleOptions)
        p, chunk_costs = config.num_stages, None
        try:
            if _is_sequence(options.costs) and len(options.costs) == 2 * p:  # per V chunk
                chunk_costs = stage_costs(options.costs, 2 * p)
                layout = VShapeLayout(p)
                self.costs = tuple(stage_mean([chunk_costs[layout.virtual(s, c)] for c in (0, 1)]) for s in range(p))
            else:
                self.costs = stage_costs(options.costs, p)
        except (TypeError, ValueError) as e:
            raise ScheduleConfigError(f"{self.name}: bad costs option: {e}") from None
        limit = options.memory_limit
        self.memory_limit = float(self.default_memory_limit(config.num_stages) if limit is None else limit)
        try:
            self.plan = best_v_plan(self.costs, config.num_microbatches, self.memory_limit, chunk_costs)
        except InfeasibleVMemory as e:
            raise ScheduleConfigError(f"{self.name}: {e}") from None

    @classmethod
    def default_memory_limit(cls, num_stages: int) -> float:
        """The limit in chunk activations (``M_B`` of one chunk); two make a whole stage's."""
        raise NotImplementedError

    @functools.cached_property
    def policy(self) -> SchedulePolicy:
        """The V policy, with the costs this order was decided from (the start logs its bubble)."""
        return dataclasses.replace(super().policy, fixed_costs=self.costs)


class BlockVSchedule(VShapeSchedule):
    """A V schedule built from a building block (:mod:`.v_blocks`): the block's repeats,
    squeezed and reordered in unit slots once, then every iteration runs that order, split
    B/W, then the synchronous step. The order does not depend on costs (the paper builds it
    with ``T_F = T_B = T_W``), so it needs no profiling and serves as zb-v's profiling warm-up."""

    def __init__(self, config: ScheduleConfig):
        super().__init__(config)
        self.plan = block_plan(self.block(config.num_stages), config.num_microbatches)

    @classmethod
    def block(cls, p: int) -> Block:
        """Per stage, the block's slots of (F chunk 0, F chunk 1, B chunk 1, B chunk 0)."""
        raise NotImplementedError

    @classmethod
    def peak_activations(cls, p: int) -> int:
        """The paper's peak, in whole-stage activations (two chunk activations each)."""
        raise NotImplementedError