"""What every schedule is generated from (:class:`ScheduleConfig`) and how it refuses one.

Its own module so that the flag declarations (:mod:`.options`) and the schedule classes
(:mod:`.base`) both build on it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from megatron.pipeline.ir import PipelineLayout


class ScheduleConfigError(ValueError):
    """A configuration a schedule cannot run; the message is one line meant for the user."""


@dataclass(frozen=True)
class ScheduleOptions:
    """The options every schedule has, and the root of every schedule's options type.

    ``costs``: the per-stage op costs the run is expected to have (:class:`OpCosts`, one per
    stage, one for all, or a profile mapping; None: the placeholder ``OpCosts()``); a
    cost-driven order (Zero Bubble's greedy) is decided from them and the timing simulator
    times any schedule's ops with them.

    Each schedule names one frozen dataclass deriving from this (``Schedule.traits.options``);
    a schedule that takes several flag groups derives from the options of each (Zero Bubble's
    from post-validation's), so code that needs one group's options reads them as that type
    (:func:`options_as`) and every field is a typed attribute, never a string key.
    """

    costs: Any = None


OptionsT = TypeVar("OptionsT", bound=ScheduleOptions)


def options_as(options: ScheduleOptions, kind: type[OptionsT]) -> OptionsT:
    """``options`` read as ``kind``: themselves when they are one; widened to ``kind`` with its
    other fields at their defaults when ``kind`` extends their type (a config that sets only
    post-validation, or nothing, for a Zero Bubble schedule). Raises :class:`ScheduleConfigError`
    for options of another schedule, which would otherwise be silently ignored."""
    if isinstance(options, kind):
        return options
    if issubclass(kind, type(options)):
        return kind(**vars(options))
    raise ScheduleConfigError(f"schedule options {type(options).__name__} do not apply here "
                              f"({kind.__name__} expected)")


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
    ``options`` are the schedule's own (:class:`ScheduleOptions`, the type its class names).
    ``data_parallel_size`` is the number of replicas of every stage, so a schedule that is
    its own data parallelism (AMDP) can refuse more in :meth:`Schedule.check_config`.
    """

    num_stages: int
    num_microbatches: int
    num_iterations: int | None = 1
    num_chunks: int = 1
    drain_every: int | None = None
    options: ScheduleOptions = field(default_factory=ScheduleOptions)
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
