"""DualPipeV (DeepSeek's DualPipe folded onto a V, deepseek-ai/DualPipe ``dualpipev.py``;
PyTorch's ``ScheduleDualPipeV``): closed-form phases per stage ``r`` of ``p``, ``m >= 2p``.

Chunk 0 is virtual stage ``r``, chunk 1 is ``2p - 1 - r``. "F&B" is an overlapped slot of one
chunk's forward and the other chunk's fused backward; without a custom overlap function (as
in PyTorch) the slot runs the forward and then the backward, which is what it is here, so in
the simulator a slot costs ``F + B + W`` by default; ``simulate_schedule(..., overlap=a)``
models an overlapping implementation (:mod:`megatron.pipeline.overlap`; :meth:`DualPipeV.overlapped_backward`
names the slots' backwards). Phases (counts per stage):

1. ``2 (p - r - 1)`` x F0 (warm-up);
2. ``r + 1`` x (F0, F1);
3. ``p - r - 1`` x (B1, a pending W, F1) (zero bubble: B split from W);
4. ``m - 2p + r + 1`` x (F0&B1, F1&B0) (the main loop; stage ``p - 1``'s first F0&B1 slot
   is not overlapped in the reference either);
5. ``p - r - 1`` x (B1, F1&B0);
6. ``r + 1`` x (B1, B0), switching to split B/W half-way (odd ``r`` before B1, even ``r``
   before B0);
7. ``p - r - 1`` x (a pending W, B0);
8. ``r + 1`` x a pending W.

Pending Ws run oldest first. The DualPipe README gives the bubble as
``(P/2 - 1)(F&B + B - 3W)`` with ``P = 2p`` virtual stages, and ``P + 1`` chunk activations
in flight per device.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter, deque
from collections.abc import Iterator

from megatron.pipeline.ir import BW, B, F, Op, OpKind, W
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.schedules.v_shape.layout import VShapeSchedule


class _Phases:
    """Emits one stage's ops in order, numbering micro-batches per (chunk, kind)."""

    def __init__(self, stage: int, first: int):
        self.stage, self.first = stage, first
        self.next_mb: Counter[tuple[int, str]] = Counter()
        self.pending_w: deque[tuple[int, int]] = deque()
        self.ops: list[Op] = []
        self.slots: set[tuple[int, int]] = set()  # (micro-batch - first, chunk) of overlapped backwards

    def forward(self, chunk: int) -> None:
        self.ops.append(F(self.stage, self.first + self.next_mb[(chunk, "F")], chunk))
        self.next_mb[(chunk, "F")] += 1

    def backward(self, chunk: int, split: bool) -> None:
        mb = self.first + self.next_mb[(chunk, "B")]
        self.next_mb[(chunk, "B")] += 1
        if split:
            self.ops.append(B(self.stage, mb, chunk))
            self.pending_w.append((mb, chunk))
        else:
            self.ops.append(BW(self.stage, mb, chunk))

    def weight(self) -> None:
        if self.pending_w:
            mb, chunk = self.pending_w.popleft()
            self.ops.append(W(self.stage, mb, chunk))

    def overlapped(self, forward_chunk: int) -> None:
        """One F&B slot: this chunk's forward, then the other chunk's fused backward."""
        self.forward(forward_chunk)
        self.backward(1 - forward_chunk, split=False)
        self.slots.add((self.ops[-1].microbatch - self.first, 1 - forward_chunk))


class DualPipeV(VShapeSchedule):
    """DualPipeV's eight phases (module docstring), flushed every iteration."""

    name = "dualpipev"
    min_microbatches_per_stage = 2

    @functools.cached_property
    def policy(self) -> SchedulePolicy:
        """The V policy, with this schedule's overlapped F&B slots for the timing simulator."""
        return dataclasses.replace(super().policy, overlapped_backward=self.overlapped_backward)

    def overlapped_backward(self, op: Op) -> bool:
        """Whether ``op`` is the fused backward of an F&B slot (it runs right after the slot's
        forward). Every iteration has the same slots, iteration ``i`` holding micro-batches
        ``i m .. (i + 1) m - 1``."""
        if op.kind is not OpKind.BW:
            return False
        m = self.config.num_microbatches
        cache: dict[int, set[tuple[int, int]]] = self.__dict__.setdefault("_slots", {})
        if op.stage not in cache:
            cache[op.stage] = self._phases(op.stage, range(0, m)).slots
        return (op.microbatch % m, op.chunk) in cache[op.stage]

    def _phases(self, stage: int, microbatches: range) -> _Phases:
        p, m, r = self.config.num_stages, len(microbatches), stage
        e = _Phases(stage, microbatches.start)
        for _ in range(2 * (p - r - 1)):
            e.forward(0)
        for _ in range(r + 1):
            e.forward(0)
            e.forward(1)
        for _ in range(p - r - 1):
            e.backward(1, split=True)
            e.weight()
            e.forward(1)
        for _ in range(m - 2 * p + r + 1):
            e.overlapped(0)
            e.overlapped(1)
        for _ in range(p - r - 1):
            e.backward(1, split=False)
            e.overlapped(1)
        split = False
        for i in range(r + 1):
            split |= i == (r + 1) // 2 and r % 2 == 1
            e.backward(1, split)
            split |= i == (r + 1) // 2 and r % 2 == 0
            e.backward(0, split)
        for _ in range(p - r - 1):
            e.weight()
            e.backward(0, split)
        for _ in range(r + 1):
            e.weight()
        assert not e.pending_w, "every split backward's W is placed"
        return e

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        yield from self._phases(stage, microbatches).ops
