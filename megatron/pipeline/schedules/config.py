"""What every schedule is generated from (:class:`ScheduleConfig`) and how it refuses one.

Its own module so that the flag declarations (:mod:`.options`) and the schedule classes
(:mod:`.base`) both build on it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron.pipeline.ir import PipelineLayout


class ScheduleConfigError(ValueError):
    """A configuration a schedule cannot run; the message is one line meant for the user."""


@dataclass(frozen=True)
class ScheduleConfig:
    """What every schedule is generated from.

    ``num_microbatches`` is the number of micro-batches per optimizer update of a stage
    (``m`` for synchronous schedules, the accumulation factor ``a`` for PACI).
    ``num_iterations=None`` asks an asynchronous schedule for an unbounded stream.
    ``drain_every`` (asynchronous only) drains the pipeline after every that many updates,
    e.g. before evaluation or a checkpoint.
    ``first_iteration`` is where the stream starts: micro-batch and update indices are the
    run's global ones, so a run resumed from a checkpoint at iteration k, or the segment
    between two evaluations, continues the numbering (and with it the data order).
    ``data_parallel_size`` is the number of replicas of every stage, so a schedule that is
    its own data parallelism (AMDP) can refuse more in :meth:`Schedule.check_config`.
    """

    num_stages: int
    num_microbatches: int
    num_iterations: int | None = 1
    num_chunks: int = 1
    drain_every: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    first_iteration: int = 0
    data_parallel_size: int = 1

    @property
    def iterations(self) -> range:
        """The (global) iterations this config covers; needs a finite ``num_iterations``."""
        assert self.num_iterations is not None, "an unbounded stream has no iteration range"
        return range(self.first_iteration, self.first_iteration + self.num_iterations)

    @property
    def layout(self) -> PipelineLayout:
        return PipelineLayout(self.num_stages, self.num_chunks)
