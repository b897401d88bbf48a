"""Static validation of a schedule: replays all stages' streams without tensors.

Reports deadlocks, unmatched or misordered point-to-point messages (via
:class:`~megatron.pipeline.replay.ReplayEngine`) and per-stage dependency violations
(backward before forward, W without B, a micro-batch run twice, work left undone), always
naming the stage and the op.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from megatron.pipeline.comm import Message, op_sends
from megatron.pipeline.ir import Op, OpKind, PipelineLayout
from megatron.pipeline.replay import ReplayEngine, ScheduleError


class _StageChecker:
    """Tracks one stage's micro-batch states: F done -> B (or BW) done -> W done."""

    def __init__(self, stage: int):
        self.stage = stage
        self.forwarded: set[tuple[int, int]] = set()
        self.backwarded: set[tuple[int, int]] = set()
        self.awaiting_w: set[tuple[int, int]] = set()
        self.weighted: set[tuple[int, int]] = set()
        self.updates = 0

    def check(self, op: Op) -> None:
        key = (op.microbatch, op.chunk)

        def fail(why: str) -> None:
            raise ScheduleError(f"stage {self.stage}: {op} {why}")

        if op.kind is OpKind.F:
            if key in self.forwarded:
                fail("runs a forward twice")
            self.forwarded.add(key)
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


def validate_streams(
    streams: list[Iterable[Op]], layout: PipelineLayout, forward_only: bool = False
) -> list[int]:
    """Replay the streams; raise :class:`ScheduleError` on any violation.

    Returns the number of ops per stage. Streams must be finite.
    """
    checkers = [_StageChecker(s) for s in range(layout.num_stages)]

    def execute(op: Op, inputs: dict[Message, Any]) -> dict[Message, Any]:
        checkers[op.stage].check(op)
        return {msg: None for msg in op_sends(op, layout)}

    def execute_sync(ops: list[Op]) -> None:
        for op in ops:
            checkers[op.stage].check(op)

    engine = ReplayEngine(streams, layout, execute, execute_sync)
    engine.run()
    for checker in checkers:
        checker.finish(forward_only)
    return engine.ops_executed


def validate_schedule(schedule: Any) -> list[int]:
    """Validate a :class:`~megatron.pipeline.schedules.base.Schedule` (finite config)."""
    return validate_streams(schedule.streams(), schedule.layout)
