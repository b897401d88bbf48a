"""The schedule check: replays all stages' streams without tensors.

Reports deadlocks, unmatched or misordered point-to-point messages (via
:class:`~megatron.pipeline.replay.ReplayEngine`) and per-stage dependency violations
(backward before forward, W without B, a micro-batch run twice, work left undone), always
naming the stage and the op.

Post-validated streams (:mod:`megatron.pipeline.schedules.zero_bubble.post_validation`) are checked too: only
forwards run between a stage's PSTEP and its VALIDATE (nothing may touch the gradients the
validation needs), a re-running VALIDATE is followed by a DISCARD of exactly those forwards
before anything else, and the DRAINs and re-sent activations line up FIFO (the replay
engine checks that). The schedule check decides the outcome of every VALIDATE itself.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from megatron.pipeline.comm import Message, op_sends
from megatron.pipeline.ir import TIED_EXCHANGE_KINDS, Op, OpKind, PipelineLayout
from megatron.pipeline.schedules.zero_bubble.post_validation import ValidationOutcomes
from megatron.pipeline.replay import ReplayEngine, ScheduleError

RerunPolicy = Callable[[int], bool]  # update -> whether its VALIDATE re-runs the forwards

#: outcome patterns :func:`check_schedule` checks a post-validated schedule under
RERUN_POLICIES: dict[str, RerunPolicy] = {
    "never": lambda update: False,
    "always": lambda update: True,
    "alternating": lambda update: update % 2 == 0,
}


class _StageChecker:
    """Tracks one stage's micro-batch states: F done -> B (or BW) done -> W done."""

    def __init__(self, stage: int):
        self.stage = stage
        self.forwarded: set[tuple[int, int]] = set()
        self.backwarded: set[tuple[int, int]] = set()
        self.awaiting_w: set[tuple[int, int]] = set()
        self.weighted: set[tuple[int, int]] = set()
        self.evaluated: set[tuple[int, int]] = set()
        self.updates = 0
        # post-validation
        self.pending: int | None = None  # update stepped (PSTEP) but not validated yet
        self.prevalidation: list[tuple[int, int]] = []  # forwards run since that PSTEP
        self.must_discard: set[tuple[int, int]] = set()  # after a re-running VALIDATE
        self.rerunning = False  # between a re-running VALIDATE and the next backward

    def check(self, op: Op, rerun: bool = False) -> None:
        key = (op.microbatch, op.chunk)

        def fail(why: str) -> None:
            raise ScheduleError(f"stage {self.stage}: {op} {why}")

        if self.must_discard and op.kind is not OpKind.DISCARD:
            pending = sorted(self.must_discard)[0]
            fail(f"runs before the rerun discarded the pre-validation forward of micro-batch {pending[0]}")
        if self.pending is not None and op.kind not in (OpKind.F, OpKind.VALIDATE):
            fail(f"runs between PSTEP #{self.pending} and its VALIDATE (only forwards may: the "
                 f"validation needs the gradients and the weights of that update)")
        if op.kind in (OpKind.B, OpKind.BW, OpKind.W, OpKind.OPT, OpKind.PSTEP):
            self.rerunning = False

        if op.kind is OpKind.EVAL:
            if key in self.evaluated:
                fail("evaluates a micro-batch twice")
            self.evaluated.add(key)
        elif op.kind is OpKind.F:
            if key in self.forwarded:
                fail("runs a forward twice")
            self.forwarded.add(key)
            if self.pending is not None:
                self.prevalidation.append(key)
        elif op.kind is OpKind.DISCARD:
            if key not in self.must_discard:
                fail("discards a forward that is not a pre-validation forward of a re-running VALIDATE")
            self.must_discard.discard(key)
            self.forwarded.discard(key)
        elif op.kind is OpKind.DRAIN:
            if not self.rerunning:
                fail("drains an activation outside the rerun after a VALIDATE")
        elif op.kind is OpKind.PSTEP:
            self._step(op, fail)
            self.pending = op.update
            self.prevalidation = []
        elif op.kind is OpKind.VALIDATE:
            if self.pending != op.update:
                fail(f"but the update awaiting validation is {self.pending}")
            self.pending = None
            if rerun:
                self.must_discard = set(self.prevalidation)
                self.rerunning = True
            self.prevalidation = []
        elif op.kind in (OpKind.B, OpKind.BW):
            if key not in self.forwarded:
                fail("runs before the forward of its micro-batch")
            if key in self.backwarded:
                fail("runs a backward twice")
            self.backwarded.add(key)
            if op.kind is OpKind.B:
                self.awaiting_w.add(key)
        elif op.kind is OpKind.W:
            if key not in self.awaiting_w:
                fail("has no preceding split backward (B) of its micro-batch")
            self.awaiting_w.discard(key)
            self.weighted.add(key)
        elif op.kind is OpKind.OPT:
            self._step(op, fail)
        elif op.kind in TIED_EXCHANGE_KINDS:  # before the PSTEP: the update's gradients are final
            if op.update != self.updates:
                fail(f"sums the tied gradients of update {op.update} but {self.updates} updates were applied")
            if self.awaiting_w:
                fail(f"sums the tied gradients while the weight gradient of micro-batch "
                     f"{sorted(self.awaiting_w)[0][0]} is still deferred")

    def _step(self, op: Op, fail: Callable[[str], None]) -> None:
        """An optimizer step (OPT or PSTEP): the next update in order, no weight gradient pending."""
        if op.update != self.updates:
            fail(f"is update {op.update} but {self.updates} updates were applied before it")
        if self.awaiting_w:
            pending = sorted(self.awaiting_w)[0]
            fail(f"steps while the weight gradient of micro-batch {pending[0]} is still deferred")
        self.updates += 1

    def finish(self, forward_only: bool) -> None:
        if not forward_only:
            missing = self.forwarded - self.backwarded
            if missing:
                mb, chunk = sorted(missing)[0]
                raise ScheduleError(
                    f"stage {self.stage}: forward of micro-batch {mb} (chunk {chunk}) never has a backward"
                )
        if self.awaiting_w:
            mb, chunk = sorted(self.awaiting_w)[0]
            raise ScheduleError(f"stage {self.stage}: B{mb}.c{chunk} never gets its W")
        if self.pending is not None:
            raise ScheduleError(f"stage {self.stage}: PSTEP #{self.pending} is never validated")


def check_streams(
    streams: list[Iterable[Op]],
    layout: PipelineLayout,
    forward_only: bool = False,
    outcomes: ValidationOutcomes | None = None,
    rerun_policy: RerunPolicy | None = None,
) -> list[int]:
    """Replay the streams; raise :class:`ScheduleError` on any violation.

    Returns the number of ops per stage. Streams must be finite. For post-validated streams
    pass the ``outcomes`` object their generators read: each VALIDATE records
    ``rerun_policy(update)`` (default: never re-run) before the stream moves on.
    """
    checkers = [_StageChecker(s) for s in range(layout.num_stages)]
    policy = rerun_policy or RERUN_POLICIES["never"]

    def execute(op: Op, inputs: dict[Message, Any]) -> dict[Message, Any]:
        rerun = False
        if op.kind is OpKind.VALIDATE:
            rerun = policy(op.update)
            if outcomes is not None:
                outcomes.record(op.update, rerun)
        checkers[op.stage].check(op, rerun)
        return {msg: None for msg in op_sends(op, layout)}

    def execute_sync(ops: list[Op]) -> None:
        for op in ops:
            checkers[op.stage].check(op)

    engine = ReplayEngine(streams, layout, execute, execute_sync)
    engine.run()
    for checker in checkers:
        checker.finish(forward_only)
    return engine.ops_executed


def check_schedule(schedule: Any, rerun_policies: Iterable[str] | None = None) -> list[int]:
    """Check a :class:`~megatron.pipeline.schedules.base.Schedule` (finite config).

    A post-validated schedule is checked once per outcome pattern (by default every
    pattern in :data:`RERUN_POLICIES`); the op counts of the first are returned.
    """
    validation = schedule.policy.post_validation
    if validation is None:
        return check_streams(schedule.streams(), schedule.layout)
    original = validation.outcomes
    counts: list[int] | None = None
    try:
        for name in rerun_policies or RERUN_POLICIES:
            outcomes = validation.outcomes = ValidationOutcomes()
            try:
                got = check_streams(schedule.streams(), schedule.layout, outcomes=outcomes,
                                       rerun_policy=RERUN_POLICIES[name])
            except ScheduleError as exc:
                raise ScheduleError(f"{exc} (post-validation outcomes: {name} rerun)") from exc
            counts = got if counts is None else counts
    finally:
        validation.outcomes = original
    assert counts is not None
    return counts
