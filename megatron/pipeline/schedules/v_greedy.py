"""A greedy list scheduler for the V placement: per-stage orders of F, B and W from costs and
an activation-memory limit (the controllable-memory paper's ZB-V heuristic, our own code).

Time advances in order: the stage free earliest decides next, from what has arrived by then
(inputs along the V, :class:`~megatron.pipeline.ir.VShapeLayout`, ``t_comm`` across stages
and nothing on the local turn). Its choice, in order of preference:

1. a ready B (chunk 1 first: it sits earlier on the backward chain);
2. a ready F that fits under the memory limit (chunk 1 first: it brings the loss closer); a
   chunk-0 F leaves room for one more chunk activation, so a stage full of chunk-0
   activations can still run the chunk-1 forward that starts their backward (no deadlock);
3. a pending W (oldest first), which fills time the stage would otherwise idle;
4. otherwise it waits for the next arrival.

Memory counts chunk activations in units of ``M_B`` (one micro-batch through one chunk): F
adds ``m_f``, B keeps ``m_w`` of it until W frees it (the simulator's accounting).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron.pipeline.ir import OpKind, VShapeLayout
from megatron.pipeline.simulator import OpCosts

#: one planned op of a stage: (kind, micro-batch index in the iteration, chunk)
PlannedOp = tuple[OpKind, int, int]


class InfeasibleVMemory(ValueError):
    """The memory limit cannot hold what a V stage needs to make progress (one line)."""


@dataclass
class _Stage:
    free: float = 0.0
    memory: float = 0.0
    next_f: list[int] = field(default_factory=lambda: [0, 0])
    next_b: list[int] = field(default_factory=lambda: [0, 0])
    pending_w: deque[tuple[int, int]] = field(default_factory=deque)
    order: list[PlannedOp] = field(default_factory=list)


class VGreedyPlanner:
    """Plans one iteration of ``m`` micro-batches on ``p`` stages (module docstring)."""

    def __init__(self, costs: Sequence[OpCosts], num_microbatches: int, memory_limit: float):
        self.p, self.m, self.costs, self.limit = len(costs), num_microbatches, tuple(costs), memory_limit
        self.layout = VShapeLayout(self.p)
        least = max(c.m_f for c in costs) * 2
        if memory_limit < least:
            raise InfeasibleVMemory(
                f"memory limit {memory_limit:g} M_B is below {least:g}, the two chunk activations a V stage "
                f"must hold to start a backward")
        self.stages = [_Stage() for _ in range(self.p)]
        self.f_end: dict[tuple[int, int], float] = {}  # (virtual stage, micro-batch) -> end of its F
        self.b_end: dict[tuple[int, int], float] = {}

    def _arrival(self, ends: dict[tuple[int, int], float], src_virtual: int, dst_stage: int, mb: int) -> float:
        end = ends.get((src_virtual, mb), math.inf)
        src_stage = self.layout.physical(src_virtual)[0]
        return end if src_stage == dst_stage else end + self.costs[src_stage].t_comm

    def _f_ready(self, s: int, chunk: int) -> float:
        mb = self.stages[s].next_f[chunk]
        if mb >= self.m:
            return math.inf
        v = self.layout.virtual(s, chunk)
        return 0.0 if v == 0 else self._arrival(self.f_end, v - 1, s, mb)

    def _b_ready(self, s: int, chunk: int) -> float:
        mb = self.stages[s].next_b[chunk]
        if mb >= self.m or mb >= self.stages[s].next_f[chunk]:
            return math.inf
        v = self.layout.virtual(s, chunk)
        last = v == self.layout.num_virtual_stages - 1
        return self.f_end[(v, mb)] if last else self._arrival(self.b_end, v + 1, s, mb)

    def _fits(self, s: int, chunk: int) -> bool:
        reserve = self.costs[s].m_f if chunk == 0 else 0.0
        return self.stages[s].memory + self.costs[s].m_f + reserve <= self.limit + 1e-9

    def _choose(self, s: int) -> tuple[PlannedOp | None, float]:
        """The op stage ``s`` runs when it is free, or (None, when something may arrive)."""
        st, now = self.stages[s], self.stages[s].free
        for chunk in (1, 0):
            if self._b_ready(s, chunk) <= now:
                return (OpKind.B, st.next_b[chunk], chunk), now
        for chunk in (1, 0):
            if self._f_ready(s, chunk) <= now and self._fits(s, chunk):
                return (OpKind.F, st.next_f[chunk], chunk), now
        if st.pending_w:
            mb, chunk = st.pending_w[0]
            return (OpKind.W, mb, chunk), now
        arrivals = [self._b_ready(s, c) for c in (0, 1)]
        arrivals += [self._f_ready(s, c) for c in (0, 1) if self._fits(s, c)]
        return None, min(arrivals)

    def _run(self, s: int, op: PlannedOp) -> None:
        kind, mb, chunk = op
        st, cost = self.stages[s], self.costs[s]
        end = st.free + cost.duration(kind)
        v = self.layout.virtual(s, chunk)
        if kind is OpKind.F:
            st.next_f[chunk] += 1
            self.f_end[(v, mb)] = end
        elif kind is OpKind.B:
            st.next_b[chunk] += 1
            st.pending_w.append((mb, chunk))
            self.b_end[(v, mb)] = end
        else:
            st.pending_w.popleft()
        st.memory += cost.memory_delta(kind)
        st.free = end
        st.order.append(op)

    def plan(self) -> list[list[PlannedOp]]:
        """Every stage's order: ``2m`` each of F, B and W."""
        total = 6 * self.m
        while True:
            waiting = [s for s in range(self.p) if len(self.stages[s].order) < total]
            if not waiting:
                return [st.order for st in self.stages]
            for s in sorted(waiting, key=lambda i: self.stages[i].free):
                op, when = self._choose(s)
                if op is not None:
                    self._run(s, op)
                    break
                if math.isfinite(when):  # idle until its next input arrives
                    self.stages[s].free = when
                    break
            else:  # nothing runs and nothing is on its way
                s = waiting[0]
                raise InfeasibleVMemory(
                    f"memory limit {self.limit:g} M_B leaves every V stage waiting (stage {s} after "
                    f"{self.stages[s].order[-1:] or 'nothing'})")
