"""The preflight replay: a run's first iterations through the schedule check, before any rank starts.

Why: a schedule that deadlocks or mismatches a message is otherwise found on a live run, after
``--pipeline-timeout-seconds`` (300 s by default) with every rank blocked and no op named. The
schedule check (:mod:`megatron.pipeline.schedule_check`) finds the same fault from the op streams alone,
without tensors, and names the stage and the op. Tests check the registered schedules on small
configs; this replays the schedule the run actually built (its stages, micro-batches, chunks and
options, a schedule registered by the user included) and refuses it in seconds.

What is replayed, bounded so that large ``N`` and ``m`` stay cheap (the ops grow with
``N (N + m)``, not with ``--train-iters``):

* two training segments chained per stage, the way the trainer runs them
  (:meth:`~megatron.pipeline.schedules.base.Schedule.segment`, each ending drained): the
  second starts after a segment boundary, which for an asynchronous schedule is a drain and a
  refill of an unbounded stream (:mod:`megatron.trainer.loop.segments`);
* the first segment: two iterations of a synchronous schedule (an iteration boundary, and
  post-validation's step validated by the next iteration, under every outcome pattern of
  :data:`~megatron.pipeline.schedule_check.RERUN_POLICIES`); a profiled Zero Bubble schedule's
  profiling iterations and one of its target order, decided from the placeholder costs (the
  run decides from measured ones); ``ceil(S / a) + 1`` updates of an asynchronous schedule
  (``S`` virtual stages, ``a`` micro-batches per update), enough for the fill to reach the
  steady state;
* the second segment: one iteration (a segment shorter than the fill, for an asynchronous one);
* both capped by the run's iterations.
"""
from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from megatron.pipeline.ir import Op, PipelineLayout
from megatron.pipeline.replay import ScheduleError
from megatron.pipeline.schedules.base import Schedule
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.schedules.zero_bubble.profiled import PLACEHOLDER_COSTS, ProfiledSchedule
from megatron.pipeline.schedule_check import check_schedule


@dataclass(frozen=True)
class PreflightReplay:
    """What was replayed: iterations ``[first, end)`` in segments of ``lengths`` iterations."""

    first: int
    lengths: tuple[int, ...]
    ops: int  # ops replayed, all stages (the first outcome pattern of a post-validated run)

    @property
    def end(self) -> int:
        return self.first + sum(self.lengths)


class _ChainedSegments:
    """Consecutive segments of one schedule, seen by :func:`check_schedule` as one schedule:
    each stage's stream is its segments' streams in order, and post-validation's outcomes are
    shared (VALIDATE and its rerun are keyed by the global update): the chain's policy is its
    first segment's, whose outcomes every segment reads when the streams are made."""

    def __init__(self, segments: list[Schedule]):
        self.segments = segments
        self.layout: PipelineLayout = segments[0].layout
        self.policy: SchedulePolicy = segments[0].policy

    def streams(self) -> list[Iterator[Op]]:
        shared = self.policy.post_validation
        if shared is not None:
            for segment in self.segments[1:]:
                validation = segment.policy.post_validation
                assert validation is not None
                validation.outcomes = shared.outcomes
        # ``Schedule.streams``, not ``stage_ops``: a schedule may share one plan across its
        # stages' streams (AMDP's scheduler run), which ``stage_ops`` would redo per stage.
        per_segment = [segment.streams() for segment in self.segments]  # generators: lazy
        return [itertools.chain(*(streams[stage] for streams in per_segment))
                for stage in range(self.layout.num_stages)]


def segment_lengths(schedule: Schedule, available: int) -> tuple[int, ...]:
    """The iterations of each replayed segment (module docstring), at most ``available`` in all."""
    config = schedule.config
    if schedule.traits.asynchronous:
        first = math.ceil(config.num_stages * config.num_chunks / config.num_microbatches) + 1
    elif isinstance(schedule, ProfiledSchedule):
        first = schedule.profile_iters + 1
    else:
        first = 2
    first = min(first, available)
    return (first, 1) if available > first else (first,)


def one_line(error: ScheduleError) -> str:
    """The schedule check's message on one line. A deadlock lists every stage, one a line: keep the
    first stage blocked on a receive (its op and the message it waits for; stages waiting at a
    collective step wait for it) and count the stages that did not finish."""
    lines = [line.strip() for line in str(error).splitlines()]
    if len(lines) < 2 or lines[0] != "deadlock:":
        return " ".join(lines)
    stuck = [line for line in lines[1:] if not line.endswith(": finished")]
    named = next((line for line in stuck if ": blocked at " in line), stuck[0])
    return f"deadlock: {named} ({len(stuck)} of {len(lines) - 1} stages cannot go on)"


def replay_first_iterations(schedule: Schedule) -> PreflightReplay:
    """Replay ``schedule``'s first iterations (module docstring) through the schedule check; raise
    :class:`ScheduleError` with a one-line message naming the stage and the op on any fault.
    ``schedule`` is not changed (segments are copies)."""
    config = schedule.config
    lengths = segment_lengths(schedule, config.num_iterations or 1 << 30)  # None: an unbounded stream
    probe = schedule
    if isinstance(schedule, ProfiledSchedule) and not schedule.decided:
        probe = copy.copy(schedule)  # the order after profiling, for costs the run will measure
        probe.set_costs(PLACEHOLDER_COSTS)
    starts = itertools.accumulate(lengths, initial=config.first_iteration)
    segments = [probe.segment(start, length) for start, length in zip(starts, lengths)]
    try:
        ops = check_schedule(_ChainedSegments(segments))
    except ScheduleError as exc:
        raise ScheduleError(one_line(exc)) from exc
    return PreflightReplay(config.first_iteration, lengths, sum(ops))
