"""A greedy list scheduler for the V placement: per-stage orders of F, B and W from costs and
an activation-memory limit (the controllable-memory paper's ZB-V heuristic, our own code).

Time is kept by the layer's event clock (:class:`~megatron.pipeline.event_clock.EventClock`:
stage clocks, pass ends, memory, bubbles); this module is the policy. The stage free earliest decides next, from what has arrived by then
(inputs along the V, :class:`~megatron.pipeline.ir.VShapeLayout`, ``t_comm`` across stages
and nothing on the local turn). Its choice, in order of preference:

1. a ready B (chunk 1 first: it sits earlier on the backward chain);
2. a ready F that fits under the memory limit (chunk 1 first: it brings the loss closer); a
   chunk-0 F leaves room for one more chunk activation, so a stage full of chunk-0
   activations can still run the chunk-1 forward that starts their backward (no deadlock);
3. a pending W (oldest first), which fills time the stage would otherwise idle -- always when
   it ends before the next input arrives; when it would delay that input's op, only if the
   variant fills there (a chunk-1 B always; a chunk-0 B with ``fill_b``, an F with
   ``fill_f``) and the wait exceeds the stage's *room*: how much more it may idle before it
   idles more than the worst stage of an earlier pass (its "approved bubble");
4. otherwise it waits for the next arrival.

:func:`best_v_plan` runs the four (fill_b, fill_f) variants, each re-run with the per-stage
bubbles of its last pass approved while that lowers the worst stage's bubble, and keeps the
order with the smallest makespan (the ZB fork's ZB-V search; our own code).

Memory counts chunk activations in units of ``M_B`` (one micro-batch through one chunk): F
adds ``m_f``, B keeps ``m_w`` of it until W frees it (the simulator's accounting).

Costs are per stage (both chunks alike) or per chunk: ``2p`` entries in virtual-stage order
(the V's model parts), for a layer split whose chunks differ (the balanced split,
:mod:`megatron.pipeline.costs.chunk_partition`, puts fewer layers beside the head); a stage's
messages leave after its chunk-0 entry's ``t_comm``.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.event_clock import EventClock
from megatron.pipeline.ir import OpKind, VShapeLayout

#: one planned op of a stage: (kind, micro-batch index in the iteration, chunk)
PlannedOp = tuple[OpKind, int, int]


#: warm-up leads tried by :func:`best_v_plan` beyond ``2(p - s) - 1`` (None: only the memory limit)
LEAD_SLACKS: tuple[int | None, ...] = (None, -1, 0, 1, 2, 3)


class InfeasibleVMemory(ValueError):
    """The memory limit cannot hold what a V stage needs to make progress (one line)."""


#: keys of the passes' ends on the clock: (pass, virtual stage, micro-batch)
_F, _B = 0, 1


@dataclass
class _Stage:
    """What the policy tracks of a stage; its time, memory and bubble are on the clock."""

    next_f: list[int] = field(default_factory=lambda: [0, 0])
    next_b: list[int] = field(default_factory=lambda: [0, 0])
    pending_w: deque[tuple[int, int]] = field(default_factory=deque)
    order: list[PlannedOp] = field(default_factory=list)


class VGreedyPlanner:
    """Plans one iteration of ``m`` micro-batches on ``p`` stages (module docstring)."""

    def __init__(self, costs: Sequence[OpCosts], num_microbatches: int, memory_limit: float,
                 fill_b: bool = True, fill_f: bool = True, approved: Sequence[float] | None = None,
                 lead_slack: int | None = None, chunk_costs: Sequence[OpCosts] | None = None):
        self.p, self.m, self.limit = len(costs), num_microbatches, memory_limit
        self.layout = VShapeLayout(self.p)
        self.costs = tuple(costs)  # per stage: its clock's message delay
        if chunk_costs is not None and len(chunk_costs) != 2 * self.p:
            raise ValueError(f"need one OpCosts per V chunk ({2 * self.p}), got {len(chunk_costs)}")
        # per virtual stage: an op's duration and memory (a stage's entry for both of its chunks)
        self.part_costs = tuple(chunk_costs) if chunk_costs is not None else tuple(
            costs[self.layout.physical(v)[0]] for v in range(2 * self.p))
        self.fill_b, self.fill_f = fill_b, fill_f
        # chunk-0 forwards a stage may run ahead of its chunk-1 ones: 2(p - s) - 1 is what
        # reaches the turn and back just in time with equal costs (PyTorch's ZBV warm-up)
        self.lead = [math.inf if lead_slack is None else max(1, 2 * (self.p - s) - 1 + lead_slack)
                     for s in range(self.p)]
        self.approved = list(approved) if approved is not None else [-math.inf] * self.p
        least = max(c.m_f for c in self.part_costs) * 2
        if memory_limit < least:
            raise InfeasibleVMemory(
                f"memory limit {memory_limit:g} M_B is below {least:g}, the two chunk activations a V stage "
                f"must hold to start a backward")
        self.stages = [_Stage() for _ in range(self.p)]
        self.clock = EventClock(self.p, [c.t_comm for c in costs])

    def _arrival(self, kind: int, src_virtual: int, dst_stage: int, mb: int) -> float:
        return self.clock.arrival((kind, src_virtual, mb), self.layout.physical(src_virtual)[0], dst_stage)

    def _f_ready(self, s: int, chunk: int) -> float:
        mb = self.stages[s].next_f[chunk]
        if mb >= self.m:
            return math.inf
        v = self.layout.virtual(s, chunk)
        return 0.0 if v == 0 else self._arrival(_F, v - 1, s, mb)

    def _b_ready(self, s: int, chunk: int) -> float:
        mb = self.stages[s].next_b[chunk]
        if mb >= self.m or mb >= self.stages[s].next_f[chunk]:
            return math.inf
        v = self.layout.virtual(s, chunk)
        last = v == self.layout.num_virtual_stages - 1
        return self.clock.ends[(_F, v, mb)] if last else self._arrival(_B, v + 1, s, mb)

    def _fits(self, s: int, chunk: int) -> bool:
        st = self.stages[s]
        if chunk == 0 and st.next_f[0] - st.next_f[1] >= self.lead[s]:
            return False  # the warm-up's lead of chunk 0 over chunk 1 is used up
        # a chunk-0 F keeps room for the chunk-1 F that starts its backward
        reserve = self._cost(s, 1).m_f if chunk == 0 else 0.0
        return self.clock.memory[s] + self._cost(s, chunk).m_f + reserve <= self.limit + 1e-9

    def _cost(self, s: int, chunk: int) -> OpCosts:
        return self.part_costs[self.layout.virtual(s, chunk)]

    def _choose(self, s: int) -> tuple[PlannedOp | None, float]:
        """The op stage ``s`` runs when it is free, or (None, when something may arrive)."""
        st, now = self.stages[s], self.clock.free[s]
        for chunk in (1, 0):
            if self._b_ready(s, chunk) <= now:
                return (OpKind.B, st.next_b[chunk], chunk), now
        for chunk in (1, 0):
            if self._f_ready(s, chunk) <= now and self._fits(s, chunk):
                return (OpKind.F, st.next_f[chunk], chunk), now
        arrivals = [(self._b_ready(s, c), OpKind.B, c) for c in (1, 0)]
        arrivals += [(self._f_ready(s, c), OpKind.F, c) for c in (1, 0) if self._fits(s, c)]
        when, kind, chunk = min(arrivals, key=lambda a: a[0])
        if st.pending_w and self._fill(s, when, kind, chunk):
            mb, w_chunk = st.pending_w[0]
            return (OpKind.W, mb, w_chunk), now
        return None, when

    def _fill(self, s: int, arrival: float, kind: OpKind, chunk: int) -> bool:
        """Whether stage ``s`` runs a pending W now rather than wait for ``arrival`` (step 3)."""
        now = self.clock.free[s]
        w_chunk = self.stages[s].pending_w[0][1]
        if now + self._cost(s, w_chunk).t_w <= arrival or not math.isfinite(arrival):
            return True  # fits in the gap, or nothing else can run (memory full)
        if not (kind is OpKind.B and (chunk == 1 or self.fill_b)) and not (kind is OpKind.F and self.fill_f):
            return False
        worst = max(self.clock.max_bubble, max(self.approved) - self.approved[s])
        return arrival - now > worst - self.clock.bubble[s]

    def _run(self, s: int, op: PlannedOp) -> None:
        kind, mb, chunk = op
        st, cost = self.stages[s], self._cost(s, chunk)
        key: tuple[int, int, int] | None = None
        if kind is OpKind.F:
            st.next_f[chunk] += 1
            key = (_F, self.layout.virtual(s, chunk), mb)
        elif kind is OpKind.B:
            st.next_b[chunk] += 1
            st.pending_w.append((mb, chunk))
            key = (_B, self.layout.virtual(s, chunk), mb)
        else:
            st.pending_w.popleft()
        self.clock.place(s, cost.duration(kind), memory_delta=cost.memory_delta(kind), key=key)  # chosen: its inputs are here
        st.order.append(op)

    def plan(self) -> list[list[PlannedOp]]:
        """Every stage's order: ``2m`` each of F, B and W."""
        total = 6 * self.m
        while True:
            waiting = [s for s in range(self.p) if len(self.stages[s].order) < total]
            if not waiting:
                return [st.order for st in self.stages]
            for s in sorted(waiting, key=self.clock.free.__getitem__):
                op, when = self._choose(s)
                if op is not None:
                    self._run(s, op)
                    break
                if math.isfinite(when):  # idle until its next input arrives
                    self.clock.wait(s, when)
                    break
            else:  # nothing runs and nothing is on its way
                s = waiting[0]
                raise InfeasibleVMemory(
                    f"memory limit {self.limit:g} M_B leaves every V stage waiting (stage {s} after "
                    f"{self.stages[s].order[-1:] or 'nothing'})")

    def makespan(self) -> float:
        """End of the last op of any stage (after :meth:`plan`)."""
        return self.clock.makespan()

    def bubbles(self) -> list[float]:
        """Each stage's idle time after its first op (after :meth:`plan`)."""
        return list(self.clock.bubble)


def best_v_plan(costs: Sequence[OpCosts], num_microbatches: int, memory_limit: float,
                chunk_costs: Sequence[OpCosts] | None = None) -> list[list[PlannedOp]]:
    """The smallest-makespan order over the fill variants and warm-up leads, each re-run with
    its last pass's per-stage bubbles approved while the worst stage's bubble drops (module
    docstring); the first order without any bubble ends the search; ``chunk_costs``: per V chunk
(virtual-stage order), else ``costs`` per stage price both chunks. Raises
    :class:`InfeasibleVMemory` when no variant fits the memory limit."""
    best: tuple[float, list[list[PlannedOp]]] | None = None
    error: InfeasibleVMemory | None = None
    for fill_b, fill_f, lead in itertools.product((True, False), (True, False), LEAD_SLACKS):
        approved, previous = None, math.inf
        while True:
            planner = VGreedyPlanner(costs, num_microbatches, memory_limit, fill_b, fill_f, approved, lead,
                                     chunk_costs)
            try:
                plan = planner.plan()
            except InfeasibleVMemory as e:
                error = error or e
                break
            if best is None or planner.makespan() < best[0]:
                best = planner.makespan(), plan
            worst = planner.clock.max_bubble  # bubbles never shrink, so the largest is the worst
            if worst <= 0.0:  # no stage idles after its first op: nothing left to search for
                return plan
            if worst >= previous:
                break
            previous, approved = worst, planner.bubbles()
    if best is None:
        assert error is not None
        raise error
    return best[1]
