"""Replays per-stage op streams under the runtime's communication model.

The model: a send never blocks (the runtime uses ``isend``), a receive blocks until the
message arrives, and messages of one lane between an ordered pair of stages are delivered in
the order they were sent (NCCL ignores tags, so FIFO per group is the only safe assumption;
:func:`~megatron.pipeline.comm.fifo_channel`); a stage's message to itself is taken by name. A
``sync`` optimizer op is a collective over the stage's ``layout.sync_group`` (all stages, or
the replicas of the same logical stages for AMDP): it runs once every stage of the group has
reached its own ``sync`` op for the same update.

The engine is shared: the schedule check replays with a checker, the emulator with real tensors,
the timing simulator with timestamps. What travels in a message is opaque to the engine.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from megatron.pipeline.comm import Message, fifo_channel, op_recvs, op_sends
from megatron.pipeline.ir import Op, OpKind, PipelineLayout

ExecuteFn = Callable[[Op, dict[Message, Any]], dict[Message, Any]]
ExecuteSyncFn = Callable[[list[Op]], None]


class ScheduleError(RuntimeError):
    """A schedule that cannot run: deadlock, unmatched or misordered messages, bad deps."""


class _Peekable:
    def __init__(self, it: Iterable[Op]):
        self._it: Iterator[Op] = iter(it)
        self._head: Op | None = None
        self._done = False

    def peek(self) -> Op | None:
        if self._head is None and not self._done:
            try:
                self._head = next(self._it)
            except StopIteration:
                self._done = True
        return self._head

    def pop(self) -> Op:
        op = self.peek()
        assert op is not None
        self._head = None
        return op


class ReplayEngine:
    """Steps every stage's stream as far as its inputs allow, until all streams end."""

    def __init__(
        self,
        streams: list[Iterable[Op]],
        layout: PipelineLayout,
        execute: ExecuteFn,
        execute_sync: ExecuteSyncFn | None = None,
    ):
        if len(streams) != layout.num_stages:
            raise ValueError(f"{len(streams)} streams for {layout.num_stages} stages")
        self.layout = layout
        self._streams = [_Peekable(s) for s in streams]
        self._execute = execute
        self._execute_sync = execute_sync
        self._in_flight: dict[Hashable, deque[tuple[Message, Any, Op]]] = {}
        self.ops_executed = [0] * layout.num_stages

    # -- one stage -------------------------------------------------------------------
    def _blocking_reason(self, op: Op) -> str | None:
        """Why ``op`` cannot run now, or None if all its inputs are at the head of their queues."""
        for msg in op_recvs(op, self.layout):
            queue = self._in_flight.get(fifo_channel(msg))
            if not queue:
                return f"waiting for {msg} (nothing in flight from stage {msg.src_stage})"
            head, _, sender = queue[0]
            if head != msg:
                raise ScheduleError(
                    f"stage {op.stage}: {op} expects {msg} but the next message from stage "
                    f"{msg.src_stage} is {head} (sent by {sender}); point-to-point messages "
                    f"of one lane between two stages must be received in the order they are sent"
                )
        return None

    def _run_one(self, op: Op) -> None:
        inputs = {}
        for msg in op_recvs(op, self.layout):
            got, payload, _ = self._in_flight[fifo_channel(msg)].popleft()
            inputs[got] = payload
        outputs = self._execute(op, inputs)
        for msg in op_sends(op, self.layout):
            if msg not in outputs:
                raise ScheduleError(f"stage {op.stage}: {op} did not produce {msg}")
            self._in_flight.setdefault(fifo_channel(msg), deque()).append(
                (msg, outputs[msg], op)
            )
        self.ops_executed[op.stage] += 1

    def _advance_stage(self, stage: int) -> bool:
        progressed = False
        stream = self._streams[stage]
        while (op := stream.peek()) is not None:
            if op.stage != stage:
                raise ScheduleError(f"stream of stage {stage} yielded {op} for stage {op.stage}")
            if op.kind is OpKind.OPT and op.sync:
                break  # collectives are handled across stages
            if self._blocking_reason(op) is not None:
                break
            self._run_one(stream.pop())
            progressed = True
        return progressed

    def _try_collective(self) -> bool:
        """Run every ``sync`` OPT whose whole group (``layout.sync_group``) is at it.

        The group is all stages for one-chain layouts; for replicated pipelines
        (:class:`~megatron.pipeline.ir.MultiPipelineLayout`) it is the devices holding
        replicas of the same logical stages, so disjoint groups step independently.
        """
        progressed = False
        done: set[int] = set()
        for stage, stream in enumerate(self._streams):
            head = stream.peek()
            if stage in done or head is None or head.kind is not OpKind.OPT or not head.sync:
                continue
            group = self.layout.sync_group(stage)
            heads = [self._streams[s].peek() for s in group]
            if not all(h is not None and h.kind is OpKind.OPT and h.sync for h in heads):
                continue
            if len({h.update for h in heads}) != 1:  # type: ignore[union-attr]
                raise ScheduleError(
                    "stages disagree on the synchronous optimizer step: "
                    + ", ".join(str(h) for h in heads)
                )
            ops = [self._streams[s].pop() for s in group]
            if self._execute_sync is not None:
                self._execute_sync(ops)
            for op in ops:
                self.ops_executed[op.stage] += 1
            done.update(group)
            progressed = True
        return progressed

    # -- whole pipeline --------------------------------------------------------------
    def run(self) -> None:
        while True:
            progressed = False
            for stage in range(self.layout.num_stages):
                progressed |= self._advance_stage(stage)
            progressed |= self._try_collective()
            if all(s.peek() is None for s in self._streams):
                break
            if not progressed:
                raise ScheduleError("deadlock:\n" + self._describe_blocked())
        leftovers = [m for q in self._in_flight.values() for m in q]
        if leftovers:
            msg, _, sender = leftovers[0]
            raise ScheduleError(
                f"{len(leftovers)} message(s) sent but never received, first: {msg} sent by {sender}"
            )

    def _describe_blocked(self) -> str:
        lines = []
        for stage, stream in enumerate(self._streams):
            op = stream.peek()
            if op is None:
                lines.append(f"  stage {stage}: finished")
            elif op.kind is OpKind.OPT and op.sync:
                group = self.layout.sync_group(stage)
                lines.append(f"  stage {stage}: at {op}, waiting for stages {list(group)} to reach it")
            else:
                lines.append(f"  stage {stage}: blocked at {op}, {self._blocking_reason(op)}")
        return "\n".join(lines)
