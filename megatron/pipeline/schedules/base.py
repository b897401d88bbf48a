"""Schedule base classes and the shared micro-batch orders.

A schedule turns a :class:`ScheduleConfig` into one op stream per stage. Synchronous
schedules repeat an iteration body followed by a pipeline-wide optimizer step; asynchronous
schedules are unbounded streams with stage-local steps, drained only where asked.
"""
from __future__ import annotations

import abc
import copy
import dataclasses
import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

from megatron.pipeline.ir import BW, F, OPT, Op, OpKind, PipelineLayout
from megatron.pipeline.schedules.zero_bubble.post_validation import POST_VALIDATION, ValidationOutcomes, post_validated_stream
from megatron.pipeline.schedules.config import ScheduleConfig, ScheduleConfigError
from megatron.pipeline.schedules.options import Flag, FlagGroup
from megatron.pipeline.weight_policy import WeightPolicySpec


class Schedule(abc.ABC):
    """A generator of per-stage op streams."""

    name: ClassVar[str]
    asynchronous: ClassVar[bool] = False
    #: the command-line flags this schedule takes (:mod:`.options`); groups shared by several
    #: schedules are declared once and listed by each
    flag_groups: ClassVar[tuple[FlagGroup, ...]] = ()
    #: whether a stage may hold several model chunks (``--num-layers-per-virtual-pipeline-stage``)
    takes_model_chunks: ClassVar[bool] = False

    def __init__(self, config: ScheduleConfig):
        self.check_config(config)
        self.config = config
        # Where the whole run starts (0, or the iteration a checkpoint was taken at); kept by
        # :meth:`segment`, so state decided once per run (profiled costs) is not redone.
        self.run_start = config.first_iteration
        #: where the whole run ends (None: unbounded), kept by :meth:`segment` likewise
        self.run_end = None if config.num_iterations is None else config.first_iteration + config.num_iterations

    def segment(self, first_iteration: int, num_iterations: int) -> Schedule:
        """This schedule over iterations ``[first_iteration, first_iteration + num_iterations)``.

        The trainer runs training in segments that end where it evaluates, saves a
        checkpoint or exits; every segment's streams end drained (asynchronous schedules
        fill and drain once per segment). The copy shares what the schedule decided for the
        run (profiled costs, greedy plans) but not per-stream bookkeeping.
        """
        if first_iteration < self.run_start or num_iterations < 1:
            raise ScheduleConfigError(
                f"{self.name}: segment [{first_iteration}, {first_iteration + num_iterations}) outside the run")
        clone = copy.copy(self)
        clone.config = dataclasses.replace(self.config, first_iteration=first_iteration,
                                           num_iterations=num_iterations)
        clone.__dict__.pop("_validation_outcomes", None)
        return clone

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        """Raise :class:`ScheduleConfigError` (one line) if this schedule cannot run ``config``."""
        if config.num_stages < 1:
            raise ScheduleConfigError(f"{cls.name}: need at least one pipeline stage")
        if config.num_microbatches < 1:
            raise ScheduleConfigError(f"{cls.name}: need at least one micro-batch per iteration")
        if config.num_chunks != 1 and not cls.takes_model_chunks:
            raise ScheduleConfigError(f"{cls.name}: supports one model chunk per stage only")
        if config.num_iterations is None and not cls.asynchronous:
            raise ScheduleConfigError(f"{cls.name}: a synchronous schedule needs a finite iteration count")
        if config.options.get(POST_VALIDATION) and cls.asynchronous:
            raise ScheduleConfigError(
                f"{cls.name}: optimizer post-validation replaces a synchronous step; this schedule "
                f"steps stage-locally and has none")

    @classmethod
    def options_from_flags(cls, values: Mapping[str, Any], config: ScheduleConfig) -> dict[str, Any]:
        """``config.options`` from the values of this schedule's flags (by ``dest``); ``config``
        is the run's config without options. Raises :class:`ScheduleConfigError` (one line)."""
        options: dict[str, Any] = {}
        for group in cls.flag_groups:
            options.update(group.to_options(values, config))
        return options

    @classmethod
    def shards_optimizer_state(cls, config: ScheduleConfig, shardable: bool) -> bool:
        """Whether each stage replica's optimizer keeps only its share of the state (ZeRO-1 over
        the replicas this schedule places); ``shardable``: the optimizer's state is element-wise,
        so it can be split. Raises :class:`ScheduleConfigError` when the config asks for
        sharding that the optimizer cannot do."""
        return False

    @classmethod
    def layout_of(cls, config: ScheduleConfig) -> PipelineLayout:
        """Where this schedule puts model chunks for ``config`` (the trainer builds stages from
        it); one chain of virtual stages unless a schedule places several pipelines (AMDP)."""
        return config.layout

    @property
    def layout(self) -> PipelineLayout:
        return self.layout_of(self.config)

    # -- what a schedule asks of each stage's worker (asynchronous variants) ------------
    @classmethod
    def weight_copies(cls, config: ScheduleConfig, stage: int) -> int:
        """Weight-sized buffers ``stage`` holds at peak, its live weights included (2BW's
        stash, PipeMare's delta add one); the timing simulator reports weight memory with it."""
        return 1

    #: True when every backward reads the weight version its forward read (weight stashing)
    stashes_weights: ClassVar[bool] = False

    #: True when the stage's weight policy holds state a checkpoint saves (2BW's stash,
    #: PipeMare's delta); it only resumes into the same partition and schedule
    weight_policy_has_state: ClassVar[bool] = False

    #: Set (to the reason) when a checkpoint can only resume into the layout it was saved from;
    #: no registered schedule needs it now (AMDP's sharded optimizer state is gathered at save)
    reshard_refusal: ClassVar[str | None] = None

    @classmethod
    def stage_weight_policy(cls, config: ScheduleConfig, stage: int) -> WeightPolicySpec | None:
        """Which weights ``stage``'s passes read, as a spec (:mod:`megatron.pipeline.weight_policy`;
        the runtime builds the policy from it). None: forwards and backwards read the live weights."""
        return None

    @classmethod
    def stage_lr_schedule(cls, config: ScheduleConfig, stage: int, base: Any) -> Any:
        """The learning-rate policy of ``stage`` given the run's ``base`` schedule."""
        return base

    # -- what the executors do for a schedule beyond running its streams -----------------
    def profiles_ops(self) -> bool:
        """Whether the executors time this schedule's ops now (``runtime.profiling``): a
        schedule that decides its order from measured costs says so until it has decided."""
        return False

    def fixed_costs(self) -> tuple[Any, ...] | None:
        """The per-stage costs this schedule's order was decided from, given up front, so the
        start can log its simulated bubble (None: no such order, or one still to be profiled)."""
        return None

    def overlapped_backward(self, op: Op) -> bool:
        """Whether ``op`` is the backward of an overlapped F&B slot (DualPipeV's), which the
        timing simulator may shorten by an overlap factor; no other schedule has such slots."""
        return False

    def start_lines(self) -> list[str] | None:
        """Lines the start logs about how the order was chosen (``auto``); None: the start
        logs the simulated bubble of :meth:`fixed_costs` instead, if any."""
        return None

    # -- post-validation (synchronous schedules override) --------------------------------
    @property
    def post_validated(self) -> bool:
        """Whether the streams carry post-validation's VALIDATE ops."""
        return False

    @property
    def validation_outcomes(self) -> ValidationOutcomes | None:
        """Post-validation's outcomes, shared with the executors; None: nothing is validated."""
        return None

    # -- checkpoints -------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any] | None:
        """What this schedule decided during the run and a resumed run must keep (a profiled
        order's costs), as plain data; None: nothing."""
        return None

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`checkpoint_state` saved. Default: a schedule that decides
        nothing at run time ignores it."""

    @abc.abstractmethod
    def stage_ops(self, stage: int) -> Iterator[Op]:
        """The op stream of one stage."""

    def streams(self) -> list[Iterator[Op]]:
        return [self.stage_ops(s) for s in range(self.config.num_stages)]


def _post_validation_options(values: Mapping[str, Any], config: ScheduleConfig) -> dict[str, Any]:
    if values["optimizer_post_validation_exact"] and not values["enable_optimizer_post_validation"]:
        raise ScheduleConfigError("--optimizer-post-validation-exact needs --enable-optimizer-post-validation")
    return {POST_VALIDATION: True} if values["enable_optimizer_post_validation"] else {}


#: Zero Bubble's optimizer post-validation (§4), for every schedule with a synchronous step.
POST_VALIDATION_FLAGS = FlagGroup("optimizer post-validation", (
    Flag("--enable-optimizer-post-validation", action="store_true",
         help="replace the pipeline-wide optimizer step by Zero Bubble's post-validation (optimistic "
              "step, validated during the next warm-up, rolled back when clipping or a non-finite "
              "gradient requires it)"),
    Flag("--optimizer-post-validation-exact", action="store_true",
         help="roll back from a backup of weights and Adam moments (bitwise) instead of the in-place "
              "arithmetic inverse (within a few ulp); costs one more copy of the state; the default "
              "with --bf16/--fp16 (see --optimizer-post-validation-in-place)"),
), _post_validation_options, requirement="a synchronous")


class SynchronousSchedule(Schedule):
    """Iteration body over ``m`` micro-batches, then a pipeline-wide optimizer step.

    With ``options["post_validation"]`` the step is instead PSTEP at the end of the
    iteration and VALIDATE before the next iteration's first backward (Zero Bubble's
    optimizer post-validation, :mod:`megatron.pipeline.schedules.zero_bubble.post_validation`). Such streams read
    :attr:`validation_outcomes` after each VALIDATE; executors record into the same object.
    """

    flag_groups = (POST_VALIDATION_FLAGS,)

    @abc.abstractmethod
    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        """The ops of one iteration on one stage (no optimizer step)."""

    @property
    def post_validated(self) -> bool:
        return bool(self.config.options.get(POST_VALIDATION, False))

    @property
    def synchronous_iterations(self) -> int:
        """Leading iterations that keep the synchronous step under post-validation.

        A profiled Zero Bubble schedule (``options["profile_iters"] = K``) gathers its costs
        at the synchronous step ending the run's K-th iteration and can only generate later
        iterations after it, so the run's first K iterations stay synchronous. Counted as a
        global iteration index (the run may start at a checkpoint).
        """
        return self.run_start + int(self.config.options.get("profile_iters") or 0)

    @property  # type: ignore[override]
    def validation_outcomes(self) -> ValidationOutcomes:
        """What each VALIDATE decided (one object per schedule instance)."""
        outcomes = self.__dict__.get("_validation_outcomes")
        if outcomes is None:
            outcomes = self.__dict__["_validation_outcomes"] = ValidationOutcomes()
        return outcomes

    @validation_outcomes.setter
    def validation_outcomes(self, outcomes: ValidationOutcomes) -> None:
        self.__dict__["_validation_outcomes"] = outcomes

    def stage_ops(self, stage: int) -> Iterator[Op]:
        m = self.config.num_microbatches
        assert self.config.num_iterations is not None
        if self.post_validated:
            return post_validated_stream(
                self.iteration_ops, stage, self.layout, m, self.config.iterations, self.validation_outcomes,
                synchronous_iterations=self.synchronous_iterations)
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

    asynchronous = True

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
