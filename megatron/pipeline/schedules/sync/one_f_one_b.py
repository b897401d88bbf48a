"""1F1B with a flush: Megatron-LM's default non-interleaved pipeline schedule."""
from __future__ import annotations

from collections.abc import Iterator

from megatron.pipeline.ir import Op
from megatron.pipeline.schedules.base import SynchronousSchedule, one_f_one_b


class OneFOneBFlush(SynchronousSchedule):
    """Warm-up forwards, steady one-forward-one-backward, cool-down, then a flush and step.

    Peak in-flight activations on stage ``s`` are ``min(m, N - s)`` micro-batches; the
    bubble is ``(N - 1) / (m + N - 1)`` of the iteration with equal stage times.
    """

    name = "1f1b"

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        return one_f_one_b(stage, self.config.num_stages, microbatches)
