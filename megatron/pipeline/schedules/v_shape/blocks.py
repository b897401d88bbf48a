"""Building-block V schedules (Qi et al., "Pipeline Parallelism with Controllable Memory",
§3-4): a pipeline is one micro-batch's *building block* repeated, then squeezed and reordered.

Time is cut into unit slots, one op each (``T_F = T_B = T_W`` per chunk, the paper's setting).
A building block gives each stage the slots of one micro-batch's four passes, in lane order
F (chunk 0), F (chunk 1), B (chunk 1), B (chunk 0). Micro-batch ``j`` runs the block shifted by
``6 j``: every stage does six ops per micro-batch (two F, two B, two W), so once the block
repeats there is no bubble, and the block's *lifespan* (first F to last W on a stage) fixes
how many micro-batches a stage holds at once, i.e. the peak activation memory (the paper's
Theorem: ``ceil(lifespan / 6)`` micro-batches of the stage's two chunks).

The repeated blocks leave the warm-up and cool-down sparse. As the paper does:

1. **W fill**: every free slot runs the oldest pending W (a W frees the activations its B
   kept, so this is what keeps the memory at the block's bound).
2. **Squeeze and reorder**: in slot order, an op of the warm-up or the cool-down moves to the
   earliest free slot after its dependencies where its stage's peak memory does not grow; the
   steady state (stage 0's first chunk-0 B to its last chunk-0 F) stays as the block put it.
   Then every stage's order is compacted (each op as early as its order and inputs allow).
3. The Ws are dropped and the cool-down reordered again with Ws implied in the free slots,
   then the Ws are put back per chunk (chunk 1's first: its B comes first along the V).

What comes out is each stage's order; the executors time it from real costs. Our own code
from the paper's description; the sail-sg/zero-bubble-pipeline-parallelism fork's
``zbv_greedy.py`` was read for the facts only (the block offsets and the phase boundaries).
"""
from __future__ import annotations

from collections.abc import Sequence

from megatron.pipeline.ir import OpKind
from megatron.pipeline.schedules.v_shape.greedy import PlannedOp

#: one lane of ops per (kind, chunk); a stage's slots are ``slots[lane][microbatch]``
LANES: tuple[tuple[OpKind, int], ...] = (
    (OpKind.F, 0), (OpKind.F, 1), (OpKind.B, 1), (OpKind.B, 0), (OpKind.W, 1), (OpKind.W, 0))
F0, F1, B1, B0, W1, W0 = range(6)
#: slots one micro-batch takes on a stage: F, B and W of both chunks
PERIOD = 6

#: per stage, the block's slots of (F chunk 0, F chunk 1, B chunk 1, B chunk 0)
Block = Sequence[tuple[int, int, int, int]]
#: per stage, per lane, the slot of every micro-batch
Slots = list[list[list[int]]]


def _peak(stage: list[list[int]]) -> int:
    """Peak chunk activations of one stage's slots: F adds one, W frees one; without W lanes
    the Ws run in the free slots as soon as a B has made one pending (step 1)."""
    at = {t: lane for lane, ts in enumerate(stage) for t in ts}
    explicit_w = len(stage) > B0 + 1
    current = peak = pending = 0
    for t in range(max(at) + 1):
        lane = at.get(t)
        if lane is None:
            if pending and not explicit_w:
                pending, current = pending - 1, current - 1
        elif lane <= F1:
            current += 1
            peak = max(peak, current)
        elif lane <= B0:
            pending += 1
        else:
            current -= 1
    return peak


def _put_w(stage: list[list[int]], per_chunk: bool) -> list[list[int]]:
    """The four F/B lanes plus W lanes filled into free slots (one lane, or one per chunk with
    chunk 1's first); Ws still pending at the end follow the last op."""
    lanes = [list(ts) for ts in stage[:B0 + 1]]
    busy = {t: lane for lane, ts in enumerate(lanes) for t in ts}
    w_lanes: list[list[int]] = [[], []] if per_chunk else [[]]
    pending = [0, 0]
    end = max(busy)
    for t in range(end + 1):
        lane = busy.get(t)
        if lane in (B1, B0):
            pending[lane - B1 if per_chunk else 0] += 1
        elif lane is None:
            for k, n in enumerate(pending):
                if n:
                    w_lanes[k].append(t)
                    pending[k] -= 1
                    break
    for k, n in enumerate(pending):
        for _ in range(n):
            end += 1
            w_lanes[k].append(end)
    return lanes + w_lanes


def _deps(slots: Slots, s: int, lane: int, j: int, w_input: bool = True) -> list[int]:
    """Slots the op must follow: its input along the V, the pass before it on this stage,
    the same lane's previous micro-batch (per-lane FIFO), and for a W its B (``w_input``;
    needless where the stage's order already puts each W after its B)."""
    p, stage = len(slots), slots[s]
    out = [stage[lane][j - 1]] if j else []
    if lane == F0 and s > 0:
        out.append(slots[s - 1][F0][j])
    elif lane == F1:
        out += [stage[F0][j]] + ([slots[s + 1][F1][j]] if s < p - 1 else [])
    elif lane == B1:
        out += [stage[F1][j]] + ([slots[s - 1][B1][j]] if s > 0 else [])
    elif lane == B0:
        out += [stage[B1][j]] + ([slots[s + 1][B0][j]] if s < p - 1 else [])
    elif lane > B0 and w_input:  # the single W lane: the j-th B on this stage
        out.append(sorted(stage[B1] + stage[B0])[j])
    return out


def _in_slot_order(slots: Slots) -> list[tuple[int, int, int, int]]:
    return sorted((t, s, lane, j) for s, stage in enumerate(slots)
                  for lane, ts in enumerate(stage) for j, t in enumerate(ts))


def _compact(slots: Slots) -> Slots:
    """Every op as early as its stage's order and its dependencies allow (unit costs)."""
    out: Slots = [[[0] * len(ts) for ts in stage] for stage in slots]
    free = [0] * len(slots)
    for _, s, lane, j in _in_slot_order(slots):
        start = max([free[s], *(t + 1 for t in _deps(out, s, lane, j, w_input=False))])
        out[s][lane][j], free[s] = start, start + 1
    return out


def _reorder(slots: Slots, move_warm_up: bool) -> Slots:
    """Step 2: moves warm-up (if asked) and cool-down ops to the earliest free slot after
    their dependencies that keeps the largest stage peak; then compacts, with the implied Ws
    placed (compacting must not close the free slots they run in)."""
    slots = [[list(ts) for ts in stage] for stage in slots]
    budget = max(_peak(stage) for stage in slots)
    m = len(slots[0][F0])
    order = _in_slot_order(slots)
    steady_from = order.index((slots[0][B0][0], 0, B0, 0))
    steady_to = order.index((slots[0][F0][m - 1], 0, F0, m - 1))
    taken: list[set[int]] = [set() for _ in slots]
    for i, (t, s, lane, j) in enumerate(order):
        fixed = steady_from <= i <= steady_to or (i < steady_from and not move_warm_up)
        if not fixed:
            for candidate in range(max(_deps(slots, s, lane, j), default=-1) + 1, t):
                if candidate in taken[s]:
                    continue
                slots[s][lane][j] = candidate
                if _peak(slots[s]) <= budget:
                    break
            else:
                slots[s][lane][j] = t
        taken[s].add(slots[s][lane][j])
    return _compact(slots if move_warm_up else [_put_w(stage, per_chunk=False) for stage in slots])


def block_plan(block: Block, num_microbatches: int) -> list[list[PlannedOp]]:
    """Every stage's order for ``num_microbatches`` repeats of ``block`` (module docstring)."""
    repeated: Slots = [[[t + PERIOD * j for j in range(num_microbatches)] for t in stage] for stage in block]
    squeezed = _reorder([_put_w(stage, per_chunk=False) for stage in repeated], move_warm_up=True)
    reordered = _reorder([stage[:B0 + 1] for stage in squeezed], move_warm_up=False)
    final = [_put_w(stage[:B0 + 1], per_chunk=True) for stage in reordered]
    plan: list[list[PlannedOp]] = []
    for stage in final:
        ops = sorted((t, lane, j) for lane, ts in enumerate(stage) for j, t in enumerate(ts))
        plan.append([(LANES[lane][0], j, LANES[lane][1]) for _, lane, j in ops])
    return plan

