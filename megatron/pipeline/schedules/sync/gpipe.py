"""GPipe: all forwards, then all backwards, then a synchronous step."""
from __future__ import annotations

from collections.abc import Iterator

from megatron.pipeline.ir import BW, F, Op
from megatron.pipeline.schedules.base import SynchronousSchedule


class GPipe(SynchronousSchedule):
    """Same bubble as 1F1B but every stage holds activations of all ``m`` micro-batches."""

    name = "gpipe"

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        for mb in microbatches:
            yield F(stage, mb)
        for mb in microbatches:
            yield BW(stage, mb)
