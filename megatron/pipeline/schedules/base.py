"""Schedule base classes and the shared micro-batch orders.

A schedule is an order, a check and a policy: it turns a :class:`ScheduleConfig` into one op
stream per stage over its layout (:meth:`Schedule.streams`), refuses a config it cannot run
(:meth:`Schedule.check_config`), and says everything else the runtime, optimizer,
checkpointing and banner need in one frozen record (:class:`~.policy.SchedulePolicy`). What a
class declares once (asynchronous, chunks, flags, options type, policy for a config) is its
:class:`~.traits.ScheduleTraits`. Synchronous schedules repeat an iteration body followed by a
pipeline-wide optimizer step; asynchronous schedules are unbounded streams with stage-local
steps, drained only where asked.
"""
from __future__ import annotations

import abc
import copy
import dataclasses
import functools
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import ClassVar

from megatron.pipeline.ir import BW, F, OPT, Op, OpKind
from megatron.pipeline.schedules.config import ScheduleConfig, ScheduleConfigError, options_as
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.schedules.traits import ScheduleTraits
from megatron.pipeline.schedules.zero_bubble.post_validation import PostValidation, post_validated_stream
from megatron.pipeline.schedules.zero_bubble.post_validation_flags import POST_VALIDATION_FLAGS, PostValidationOptions


class Schedule(abc.ABC):
    """A generator of per-stage op streams (module docstring): at most eight members, so that
    what a schedule adds is an order, a check or a field of its policy, never another hook."""

    name: ClassVar[str]
    traits: ClassVar[ScheduleTraits] = ScheduleTraits()

    def __init__(self, config: ScheduleConfig):
        self.check_config(config)
        self.config = config
        # Where the whole run starts (0, or the iteration a checkpoint was taken at); kept by
        # :meth:`segment`, so state decided once per run (profiled costs) is not redone.
        self.run_start = config.first_iteration
        #: where the whole run ends (None: unbounded), kept by :meth:`segment` likewise
        self.run_end = None if config.num_iterations is None else config.first_iteration + config.num_iterations
        #: where this schedule puts model chunks (the streams' message routes)
        self.layout = self.traits.layout_of(config)

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        """Raise :class:`ScheduleConfigError` (one line) if this schedule cannot run ``config``."""
        if config.num_stages < 1:
            raise ScheduleConfigError(f"{cls.name}: need at least one pipeline stage")
        if config.num_microbatches < 1:
            raise ScheduleConfigError(f"{cls.name}: need at least one micro-batch per iteration")
        if config.num_chunks != 1 and not cls.traits.takes_model_chunks:
            raise ScheduleConfigError(f"{cls.name}: supports one model chunk per stage only")
        if config.num_iterations is None and not cls.traits.asynchronous:
            raise ScheduleConfigError(f"{cls.name}: a synchronous schedule needs a finite iteration count")
        options = config.options
        if isinstance(options, PostValidationOptions) and options.post_validation and cls.traits.asynchronous:
            raise ScheduleConfigError(
                f"{cls.name}: optimizer post-validation replaces a synchronous step; this schedule "
                f"steps stage-locally and has none")
        try:
            options_as(options, cls.traits.options)
        except ScheduleConfigError as exc:
            raise ScheduleConfigError(f"{cls.name}: {exc}") from None

    def segment(self, first_iteration: int, num_iterations: int) -> Schedule:
        """This schedule over iterations ``[first_iteration, first_iteration + num_iterations)``.

        The trainer runs training in segments that end where it evaluates, saves a
        checkpoint or exits; every segment's streams end drained (asynchronous schedules
        fill and drain once per segment). The copy shares what the schedule decided for the
        run (profiled costs, greedy plans) but not per-stream bookkeeping: it builds its own
        policy (post-validation's outcomes, callables bound to it).
        """
        if first_iteration < self.run_start or num_iterations < 1:
            raise ScheduleConfigError(
                f"{self.name}: segment [{first_iteration}, {first_iteration + num_iterations}) outside the run")
        clone = copy.copy(self)
        clone.config = dataclasses.replace(self.config, first_iteration=first_iteration,
                                           num_iterations=num_iterations)
        clone.__dict__.pop("policy", None)
        return clone

    @abc.abstractmethod
    def stage_ops(self, stage: int) -> Iterator[Op]:
        """The op stream of one stage."""

    def streams(self) -> list[Iterator[Op]]:
        """Every stage's stream (a schedule may share one plan across them: AMDP)."""
        return [self.stage_ops(s) for s in range(self.config.num_stages)]

    @functools.cached_property
    def policy(self) -> SchedulePolicy:
        """This schedule's policy (:class:`~.policy.SchedulePolicy`), built once per instance: the
        class's for its config (``traits.policy_for``); a schedule that decides at run time
        overrides this to add what it decides, bound to itself."""
        return self.traits.policy_for(self.config)


def synchronous_policy(config: ScheduleConfig) -> SchedulePolicy:
    """A synchronous schedule's policy: the plain one, post-validated when its options ask."""
    plain = SchedulePolicy.plain(config.layout)
    if options_as(config.options, PostValidationOptions).post_validation:
        return dataclasses.replace(plain, post_validation=PostValidation())
    return plain


class SynchronousSchedule(Schedule):
    """Iteration body over ``m`` micro-batches, then a pipeline-wide optimizer step.

    With ``PostValidationOptions.post_validation`` the step is instead PSTEP at the end of the
    iteration and VALIDATE before the next iteration's first backward (Zero Bubble's
    optimizer post-validation, :mod:`megatron.pipeline.schedules.zero_bubble.post_validation`). Such streams read
    the outcomes of ``policy.post_validation`` after each VALIDATE; executors record into the same object.
    """

    traits = ScheduleTraits(flag_groups=(POST_VALIDATION_FLAGS,), options=PostValidationOptions,
                            policy_for=synchronous_policy)

    @abc.abstractmethod
    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        """The ops of one iteration on one stage (no optimizer step)."""

    @property
    def synchronous_iterations(self) -> int:
        """Leading iterations that keep the synchronous step under post-validation.

        None here; a profiled Zero Bubble schedule (``ZeroBubbleOptions.profile_iters = K``,
        :class:`~.zero_bubble.profiled.ProfiledSchedule`) gathers its costs at the synchronous
        step ending the run's K-th iteration and can only generate later iterations after it,
        so the run's first K iterations stay synchronous. Counted as a global iteration index
        (the run may start at a checkpoint).
        """
        return self.run_start

    def stage_ops(self, stage: int) -> Iterator[Op]:
        assert self.config.num_iterations is not None
        validation = self.policy.post_validation
        if validation is not None:
            return post_validated_stream(
                self.iteration_ops, stage, self.layout, self.config.num_microbatches, self.config.iterations,
                validation.outcomes, synchronous_iterations=self.synchronous_iterations)
        return self._synchronous_ops(stage)

    def _synchronous_ops(self, stage: int) -> Iterator[Op]:
        m = self.config.num_microbatches
        for it in self.config.iterations:
            yield from self.iteration_ops(stage, range(it * m, (it + 1) * m))
            yield OPT(stage, it, sync=True)


def one_f_one_b(stage: int, num_stages: int, microbatches: Iterable[int]) -> Iterator[Op]:
    """Megatron's non-interleaved 1F1B order over any (possibly unbounded) micro-batch sequence.

    ``num_stages - stage - 1`` warm-up forwards, then one forward and one backward in turn,
    then the cool-down backwards. Lazy, so asynchronous schedules can run it forever.
    """
    warmup = num_stages - stage - 1
    unresolved: deque[int] = deque()
    for mb in microbatches:
        yield F(stage, mb)
        unresolved.append(mb)
        if len(unresolved) > warmup:
            yield BW(stage, unresolved.popleft())
    while unresolved:
        yield BW(stage, unresolved.popleft())


def microbatch_range(start: int, count: int | None) -> Iterable[int]:
    """``range(start, start + count)``, or an endless count when ``count`` is None."""
    return itertools.count(start) if count is None else range(start, start + count)


class AsynchronousSchedule(Schedule):
    """An unbounded (or long) stream with stage-local optimizer steps and no flush.

    Each stage steps after every ``a = num_microbatches`` of its own backwards. The stream
    is cut into segments of ``drain_every`` updates (the whole run when None); each segment
    is one pipeline fill / steady state / drain, so a drain happens only at the end of
    training or where the trainer asks (evaluation, checkpoint).

    Drain rule: drain points fall on update boundaries, so when a segment ends every stage
    has applied all of the segment's updates and no partial gradient accumulation is
    pending; nothing is dropped and nothing is carried over.
    """

    traits = ScheduleTraits(asynchronous=True)

    @abc.abstractmethod
    def segment_ops(self, stage: int, microbatches: Iterable[int]) -> Iterator[Op]:
        """Compute ops (no optimizer steps) of one drained segment on one stage."""

    def stage_ops(self, stage: int) -> Iterator[Op]:
        a = self.config.num_microbatches
        for first_update, updates in self._segments():
            mbs = microbatch_range(first_update * a, None if updates is None else updates * a)
            for op in self.segment_ops(stage, mbs):
                yield op
                if op.kind in (OpKind.BW, OpKind.W) and self._closes_window(op):
                    yield OPT(stage, op.microbatch // a, sync=False)

    def _closes_window(self, op: Op) -> bool:
        """True when ``op`` is the last gradient contribution of an accumulation window."""
        if op.kind is OpKind.W or (op.kind is OpKind.BW and not self.deferred_weight_grads):
            return (op.microbatch + 1) % self.config.num_microbatches == 0
        return False

    #: schedules that split B/W step after the W, not the B
    deferred_weight_grads: ClassVar[bool] = False

    def _segments(self) -> Iterator[tuple[int, int | None]]:
        first, every = self.config.first_iteration, self.config.drain_every
        count = self.config.num_iterations
        if count is None and every is None:
            yield first, None
            return
        total = None if count is None else first + count
        start = first
        while total is None or start < total:
            length = every if every is not None else total - start  # type: ignore[operator]
            if total is not None:
                length = min(length, total - start)
            yield start, length
            start += length
