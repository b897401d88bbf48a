"""Zero Bubble's automatic scheduling heuristic (Qi et al., §3.1; spec §4.3).

Places F, B and W passes stage by stage in simulated time, from per-stage costs
(``t_f, t_b, t_w, t_comm``) and an activation-memory limit in units of ``M_B`` (F adds 1,
B adds ``m_w - 1``, W adds ``-m_w``; ``m_w`` from the costs, 1/2 by default as in the reference
implementation's units F = +2, B = -1, W = -1):

* warm-up: as many forwards as fit in memory and before the first B's gradient arrives (binary
  choice ``allow_bubble_before_first_b``: stop before a forward that would end after the arrival,
  or keep going while the stage is still free before it), counts made strictly decreasing
  along the pipeline;
* then rounds of one F and one B per stage, W passes filling gaps before an input's arrival
  (a gap shorter than ``t_w`` is filled only if leaving it idle would raise the largest
  cumulative bubble, or always with ``no_bubble_greedy``) and freeing memory when the limit is
  hit; ``prioritize_b`` lets a stage two or more forwards ahead of the next skip its forward
  when that does not cause more bubble;
* finally the remaining W passes.

The grid over the three binary choices keeps the order with the lowest cost (largest
per-stage span, ties broken by makespan). The greedy computes the same times as the timing
simulator (``megatron.pipeline.simulator``): both keep time on the same event clock
(:class:`~megatron.pipeline.event_clock.EventClock`, which also keeps the per-stage memory and
bubbles the rules read); this module is only the placement policy.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.event_clock import EventClock
from megatron.pipeline.ir import OpKind

_EPS = 1e-9
#: keys of the passes' ends on the clock: (pass, stage, local micro-batch), ints hash fast
_F, _B, _W = 0, 1, 2
_KEY = {OpKind.F: _F, OpKind.B: _B, OpKind.W: _W}


class InfeasibleMemory(ValueError):
    """The memory limit cannot hold the activations the order needs."""


@dataclass(frozen=True)
class GreedyResult:
    """Per-stage pass order as ``(kind, local micro-batch index)`` and its simulated cost."""

    order: tuple[tuple[tuple[OpKind, int], ...], ...]
    cost: float  # max over stages of (end of last W - start of first F)
    makespan: float
    options: tuple[bool, bool, bool]  # (allow_bubble_before_first_b, prioritize_b, no_bubble_greedy)


def greedy_order(
    costs: Sequence[OpCosts],
    m: int,
    memory_limit: float,
    allow_bubble_before_first_b: bool,
    prioritize_b: bool,
    no_bubble_greedy: bool,
) -> GreedyResult:
    """One run of the heuristic for one combination of the binary hyperparameters."""
    p = len(costs)
    tf = [c.t_f for c in costs]
    tb = [c.t_b for c in costs]
    tw = [c.t_w for c in costs]
    tc = [c.t_comm for c in costs]
    # the reference's units: F keeps one M_B whatever the costs' m_f (the heuristic's own rule)
    dmem = {OpKind.F: [1.0] * p, OpKind.B: [c.m_w - 1.0 for c in costs], OpKind.W: [-c.m_w for c in costs]}
    dur = {OpKind.F: tf, OpKind.B: tb, OpKind.W: tw}
    limit = memory_limit + _EPS

    count = {OpKind.F: [0] * p, OpKind.B: [0] * p, OpKind.W: [0] * p}
    f, b, w = count[OpKind.F], count[OpKind.B], count[OpKind.W]
    clock = EventClock(p, tc)
    ends, free, mem, bub = clock.ends, clock.free, clock.memory, clock.bubble
    order: list[list[tuple[OpKind, int]]] = [[] for _ in range(p)]

    def put(j: int, kind: OpKind) -> None:
        idx = count[kind][j]
        if (kind is OpKind.F and j > 0 and count[kind][j - 1] <= idx) or (
            kind is OpKind.B and (f[j] <= idx or (j < p - 1 and count[kind][j + 1] <= idx))
        ):
            raise RuntimeError(f"zero-bubble heuristic: {kind.value}{idx} on stage {j} before its inputs")
        ready = 0.0
        if kind is OpKind.F and j > 0:
            ready = clock.arrival((_F, j - 1, idx), j - 1, j)
        elif kind is OpKind.B and j < p - 1:
            ready = clock.arrival((_B, j + 1, idx), j + 1, j)
        clock.place(j, dur[kind][j], ready, dmem[kind][j], (_KEY[kind], j, idx))
        count[kind][j] += 1
        order[j].append((kind, idx))

    def fill_w(j: int, arrival: float) -> None:
        while w[j] < b[j] and free[j] + tw[j] <= arrival + _EPS:
            put(j, OpKind.W)
        if w[j] < b[j] and free[j] < arrival - _EPS:
            if arrival - free[j] <= clock.max_bubble - bub[j] + _EPS:
                if no_bubble_greedy:
                    put(j, OpKind.W)
            else:
                put(j, OpKind.W)

    def make_room(j: int, kind: OpKind) -> None:
        while mem[j] + dmem[kind][j] > limit:
            if w[j] >= b[j]:
                raise InfeasibleMemory(f"cannot fit memory limit {memory_limit} M_B on stage {j}")
            put(j, OpKind.W)

    # Phase A: micro-batch 0 everywhere, warm-up forwards, then B_0 up the pipeline.
    for j in range(p):
        make_room(j, OpKind.F)
        put(j, OpKind.F)
    extra = [0] * p
    last_t = ends[(_F, p - 1, 0)] + tb[p - 1]
    for j in range(p - 2, -1, -1):
        arrival = last_t + tc[j + 1]
        cur, mm, k = free[j], mem[j], 0
        while f[j] + k < m and mm + 1.0 <= limit:
            if allow_bubble_before_first_b:
                if cur + tf[j] > arrival + _EPS:
                    break
            elif cur >= arrival - _EPS:
                break
            k += 1
            cur += tf[j]
            mm += 1.0
        extra[j] = k
        last_t = max(cur, arrival) + tb[j]
    for j in range(1, p):
        # A stage cannot run a forward its predecessor has not run. The reference's rule below
        # keeps a larger count when it uses up all m forwards; with unequal stage costs the
        # estimate can exceed the predecessor's, so clamp first (a no-op wherever the
        # reference's order is valid).
        extra[j] = min(extra[j], extra[j - 1])
        while extra[j] > 0 and extra[j] >= extra[j - 1] and f[j] + extra[j] < m:
            extra[j] -= 1
    for j in range(p):
        for _ in range(extra[j]):
            put(j, OpKind.F)
    for j in range(p - 1, -1, -1):
        put(j, OpKind.B)

    # Phase B: rounds of at most one F and exactly one B per stage.
    for i in range(1, m):
        take = [1] * p
        for j in range(p):
            if f[j] == m:
                take[j] = 0
            elif prioritize_b and j < p - 1 and f[j] >= f[j + 1] + 2:
                nxt = free[j + 1] + tf[j + 1] + tb[j + 1] + tc[j + 1]
                if free[j] >= nxt - _EPS:
                    take[j] = 0
                else:
                    pending, needed = b[j] - w[j], 0
                    while needed < pending and mem[j] - needed * costs[j].m_w + 1.0 > limit:
                        needed += 1
                    if free[j] + tf[j] + needed * tw[j] <= nxt + _EPS:
                        take[j] = 1
                    elif nxt - free[j] <= clock.max_bubble - bub[j] + _EPS:
                        take[j] = 0
        for j in range(p - 2, -1, -1):
            take[j] = min(take[j], take[j + 1])
        for j in range(p):
            if take[j]:
                make_room(j, OpKind.F)
                if j > 0:
                    fill_w(j, clock.arrival((_F, j - 1, f[j]), j - 1, j))
                put(j, OpKind.F)
        for j in range(p - 1, -1, -1):
            make_room(j, OpKind.B)
            if j < p - 1:
                fill_w(j, clock.arrival((_B, j + 1, i), j + 1, j))
            if j == 0 and f[0] == m:
                while w[j] < b[j]:
                    put(j, OpKind.W)
            put(j, OpKind.B)

    # Phase C: the remaining W passes.
    for j in range(p):
        while w[j] < m:
            put(j, OpKind.W)

    cost = max(ends[(_W, j, m - 1)] - ends[(_F, j, 0)] + tf[j] for j in range(p))
    makespan = clock.makespan()
    return GreedyResult(
        tuple(tuple(o) for o in order), cost, makespan,
        (allow_bubble_before_first_b, prioritize_b, no_bubble_greedy),
    )


@functools.lru_cache(maxsize=64)
def best_greedy_order(costs: tuple[OpCosts, ...], m: int, memory_limit: float) -> GreedyResult:
    """Grid search over the heuristic's three binary choices; the lowest (cost, makespan) wins.

    Cached: a schedule asks for the same order on every stage and every iteration.
    """
    best: GreedyResult | None = None
    for options in itertools.product((False, True), repeat=3):
        try:
            result = greedy_order(costs, m, memory_limit, *options)
        except InfeasibleMemory:
            continue
        if (
            best is None
            or result.cost < best.cost - _EPS
            or (result.cost <= best.cost + _EPS and result.makespan < best.makespan - _EPS)
        ):
            best = result
    if best is None:
        raise InfeasibleMemory(
            f"no zero-bubble schedule fits an activation memory limit of {memory_limit} M_B "
            f"({len(costs)} stages, {m} micro-batches)"
        )
    return best
