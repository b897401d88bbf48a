"""Interleaved 1F1B with a flush: Megatron-LM's schedule for virtual pipeline stages.

Each stage holds ``V`` model chunks; chunk ``c`` of stage ``s`` is virtual stage
``c * N + s``, so a micro-batch visits every stage ``V`` times. The bubble shrinks by ``V``
(each pass through a stage is ``1/V`` of its work), at the price of ``V`` times more
point-to-point messages and a deeper warm-up.

Order (megatron-core 0.16, ``forward_backward_pipelining_with_interleaving``):

- Micro-batches are cut into groups of ``G`` consecutive ones (``G`` =
  ``--microbatch-group-size-per-virtual-pipeline-stage``, default ``N``; a last, shorter
  group holds ``m mod G`` if that is not zero). Within a group a stage forwards every
  micro-batch through chunk 0, then all through chunk 1, ..., chunk ``V - 1``. That gives the sequence of *forward slots*
  ``(micro-batch, chunk)``, ``m * V`` of them.
- The k-th backward slot is the k-th forward slot with the chunk mirrored (``V - 1 - c``):
  backwards run groups in the same micro-batch order, last chunk first.
- Stage ``s`` runs ``w = 2 (N - s - 1) + (V - 1) G`` warm-up forwards (capped at ``m V``),
  then alternates the next forward slot with the next backward slot, then the remaining
  backwards (cool-down), then the pipeline-wide optimizer step.

Peak in-flight micro-batch-chunks on stage ``s``: ``min(w + 1, m V)``.

Megatron's requirement, kept here: ``N <= G <= m`` and ``m mod G`` is 0 or at least ``N``;
with the default ``G = N`` that means ``m`` is a multiple of ``N``. Otherwise the
dependencies between chunks stall the pipeline (Megatron refuses; so do we).

One restriction of our own: with ``N = 2`` the two stages exchange activations *and*
gradients in both directions over one stage pair, and with ``G > 2`` the order in which one
stage sends them differs from the order in which the other consumes them. Messages between
two stages are FIFO (NCCL ignores tags), so such a schedule would hand a gradient to a
forward -- the schedule check rejects it, and ``check_config`` refuses ``G != N`` for ``N = 2``.
(``G = N`` is FIFO-consistent for every ``N``: the schedule check replays it in the tests.)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from megatron.pipeline.ir import BW, F, Op
from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError, SynchronousSchedule
from megatron.pipeline.schedules.config import options_as
from megatron.pipeline.schedules.options import Flag, FlagGroup, OptionFields
from megatron.pipeline.schedules.zero_bubble.post_validation_flags import PostValidationOptions


@dataclass(frozen=True)
class InterleavedOptions(PostValidationOptions):
    """Interleaving's options: ``microbatch_group_size`` is ``G``, the consecutive micro-batches
    per chunk (None: the stage count, Megatron-LM's default)."""

    microbatch_group_size: int | None = None


def _group_options(values: Mapping[str, Any], config: ScheduleConfig) -> OptionFields:
    return {"microbatch_group_size": values["microbatch_group_size_per_virtual_pipeline_stage"]}


#: Megatron-LM's flag for ``G`` (module docstring).
INTERLEAVING_FLAGS = FlagGroup("interleaving (virtual pipeline stages)", (
    Flag("--microbatch-group-size-per-virtual-pipeline-stage", type=int, metavar="G",
         help="consecutive micro-batches per chunk (default: PP)"),
), _group_options)


def forward_slots(num_microbatches: int, num_chunks: int, group: int) -> list[tuple[int, int]]:
    """Megatron's schedule table: the (micro-batch offset, chunk) of every forward, in order."""
    slots: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group):
        stop = min(start + group, num_microbatches)  # the last group may be shorter
        for chunk in range(num_chunks):
            slots.extend((mb, chunk) for mb in range(start, stop))
    return slots


def warmup_forwards(stage: int, num_stages: int, num_microbatches: int, num_chunks: int, group: int) -> int:
    """Forwards stage ``stage`` runs before its first backward (Megatron's formula, capped)."""
    warmup = 2 * (num_stages - stage - 1) + (num_chunks - 1) * group
    return min(warmup, num_microbatches * num_chunks)


class Interleaved1F1B(SynchronousSchedule):
    """Megatron-LM's interleaved 1F1B (virtual pipeline stages), flushed every iteration."""

    name = "interleaved-1f1b"
    traits = dataclasses.replace(SynchronousSchedule.traits, takes_model_chunks=True, options=InterleavedOptions,
                                 flag_groups=(*SynchronousSchedule.traits.flag_groups, INTERLEAVING_FLAGS))

    @classmethod
    def group_size(cls, config: ScheduleConfig) -> int:
        group = options_as(config.options, InterleavedOptions).microbatch_group_size
        return config.num_stages if group is None else int(group)

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        # The base check rejects chunks; run it on the one-chunk equivalent.
        super().check_config(ScheduleConfig(config.num_stages, config.num_microbatches, config.num_iterations,
                                            options=config.options))
        n, m, v, g = config.num_stages, config.num_microbatches, config.num_chunks, cls.group_size(config)
        if n < 2:
            raise ScheduleConfigError(f"{cls.name}: needs at least 2 pipeline stages, got {n}")
        if v < 2:
            raise ScheduleConfigError(
                f"{cls.name}: needs at least 2 model chunks per stage, got {v} (at most half of a "
                f"stage's layers per --num-layers-per-virtual-pipeline-stage); with one chunk use 1f1b")
        if not n <= g <= m:
            raise ScheduleConfigError(
                f"{cls.name}: micro-batch group size {g} must lie in [pipeline stages {n}, "
                f"micro-batches per iteration {m}] (the default group size is the stage count, "
                f"so m must be a multiple of {n})")
        if n == 2 and g != n:
            raise ScheduleConfigError(
                f"{cls.name}: with 2 stages the micro-batch group size must be 2, got {g} (Megatron-LM's "
                f"rule: on one FIFO per stage pair a larger group reorders activations and gradients)")
        if 0 < m % g < n:
            raise ScheduleConfigError(
                f"{cls.name}: {m} micro-batches per iteration leave a last group of {m % g} < {n} "
                f"stages (group size {g}); use a multiple of {g} micro-batches")

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        n, v = self.config.num_stages, self.config.num_chunks
        m, first = len(microbatches), microbatches.start
        slots = forward_slots(m, v, self.group_size(self.config))
        total = len(slots)
        warmup = warmup_forwards(stage, n, m, v, self.group_size(self.config))

        def forward(k: int) -> Op:
            mb, chunk = slots[k]
            return F(stage, first + mb, chunk)

        def backward(k: int) -> Op:
            mb, chunk = slots[k]
            return BW(stage, first + mb, v - 1 - chunk)

        for k in range(warmup):
            yield forward(k)
        for k in range(total - warmup):  # steady state: one forward, one backward
            yield forward(warmup + k)
            yield backward(k)
        for k in range(total - warmup, total):  # cool-down
            yield backward(k)
