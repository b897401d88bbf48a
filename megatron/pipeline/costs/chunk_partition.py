"""Balanced layer split of a chunked layout (V, interleaved): even *rank* work, a pure solver.

Problem. ``L`` identical transformer layers are split into ``M`` consecutive model parts (the
layout's virtual stages, model order), part ``j`` living on rank ``owner[j]`` (a V: parts ``s``
and ``2N - 1 - s`` on rank ``s``; interleaving: part ``j`` on rank ``j mod N``). A layer costs
``t`` (time), ``s`` (static memory) and ``a`` (activation memory per micro-batch); part 0 adds
the embedding's ``first`` and part ``M - 1`` the head's ``last``. Every part keeps >= 1 layer.
Rank ``r`` of ``k_r`` parts and ``n_r`` layers works ``T_r = n_r t + X_r`` (``X_r``: the ends
it holds) and holds ``M_r = S_r + w_r A_r / k_r``: its static memory plus ``w_r`` in-flight
micro-batch activations of the mean of its parts (the simulator's unit for a chunked stage,
:func:`megatron.pipeline.costs.stages.stage_activation_unit`). Minimise ``max_r T_r`` subject to
``M_r <= B``.

Why identical layers rather than per-layer costs (as :mod:`.partition` takes for a chain): a
rank's total then depends only on how many layers it holds, not which, so the problem over the
``M - 1`` cut points reduces to an allocation of counts ``n_r`` (exactly, for the cost model's
and the profile's units, :mod:`.cost_model`, :mod:`.unit_costs`). Per-layer costs would couple
non-adjacent parts of a rank (a V's rank 0 holds the first and the last part) and need a search
over all cut points.

Algorithm (exact). Each rank's ``T_r`` and ``M_r`` grow with ``n_r``. Greedy filling, starting
from ``n_r = k_r`` and handing each next layer to the rank whose value after taking it is least,
minimises ``max_r g_r(n_r)`` for any non-decreasing ``g_r``: if it ever handed a layer to a rank
with ``g_r(n_r + 1) > G*`` (``G*`` the optimum, attained by some ``n*``), every rank ``q`` would
have ``g_q(n_q + 1) > G* >= g_q(n*_q)``, so ``n_q >= n*_q`` for all ``q`` with ``sum n_q < L =
sum n*_q``, a contradiction. The budget enters as ``g_r = +inf`` past it. Infeasible (some
rank cannot take its ``k_r`` layers, or the ranks cannot take ``L`` within the budget): the
least worst overshoot ``O*`` first (greedy on the overshoot), then the least max time with
every rank's overshoot <= ``O*``, as :mod:`.partition` does for a chain.

Within a rank, its ``n_r`` layers are spread over its parts by the same greedy on the part's own
time (its layers plus its end): the rank's total and memory do not depend on it, and even parts
keep the per-chunk ops even, which the schedules' orders assume. Ties go to the later rank (the
later part), as the chain's do.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """A layer's (or an end's) time, static bytes and activation bytes per micro-batch."""

    time: float
    static: float = 0.0
    activation: float = 0.0


@dataclass(frozen=True)
class ChunkPartition:
    """Layers per model part and what every rank costs; ``feasible`` False: the fallback overshot."""

    counts: tuple[int, ...]  # layers per model part, model order
    owners: tuple[int, ...]  # the rank of each part
    rank_time: tuple[float, ...]
    rank_memory: tuple[float, ...]
    budget: float
    feasible: bool

    @property
    def max_time(self) -> float:
        return max(self.rank_time)

    @property
    def rank_layers(self) -> tuple[int, ...]:
        out = [0] * len(self.rank_time)
        for part, rank in enumerate(self.owners):
            out[rank] += self.counts[part]
        return tuple(out)


def _greedy_fill(start: Sequence[int], total: int, value: Callable[[int, int], float]) -> list[int] | None:
    """Counts from ``start`` up to ``total`` in all, each unit to the entry whose ``value(i, n + 1)``
    is least (ties: the later entry); None when every entry's next value is infinite."""
    counts = list(start)
    for _ in range(total - sum(counts)):
        best, pick = math.inf, -1
        for i, n in enumerate(counts):
            v = value(i, n + 1)
            if v <= best and v < math.inf:
                best, pick = v, i
        if pick < 0:
            return None
        counts[pick] += 1
    return counts


def partition_chunks(num_layers: int, owners: Sequence[int], layer: Unit, first: Unit, last: Unit,
                     in_flight: Sequence[float], budget: float = math.inf) -> ChunkPartition:
    """The split of ``num_layers`` layers over the parts ``owners`` describes (problem, proof:
    module docstring); ``in_flight[r]``: micro-batches whose activations rank ``r`` holds at its
    peak, in units of its mean part's."""
    num_parts, num_ranks = len(owners), len(in_flight)
    if num_parts < 1 or num_layers < num_parts:
        raise ValueError(f"cannot split {num_layers} layers into {num_parts} non-empty parts")
    if sorted(set(owners)) != list(range(num_ranks)):
        raise ValueError(f"every rank 0..{num_ranks - 1} must own a part, got owners {list(owners)}")
    values = (layer.time, layer.static, layer.activation, first.time, first.static, first.activation,
              last.time, last.static, last.activation, *in_flight)
    if any(v < 0 or math.isnan(v) for v in values):
        raise ValueError("costs, memory sizes and in-flight counts must be non-negative numbers")
    parts_of = [[j for j, r in enumerate(owners) if r == rank] for rank in range(num_ranks)]

    def ends(rank: int, field: str) -> float:
        held = parts_of[rank]
        return (getattr(first, field) if 0 in held else 0.0) + (getattr(last, field) if num_parts - 1 in held else 0.0)

    def time(rank: int, n: int) -> float:
        return n * layer.time + ends(rank, "time")

    def memory(rank: int, n: int) -> float:
        act = (n * layer.activation + ends(rank, "activation")) / len(parts_of[rank])
        return n * layer.static + ends(rank, "static") + in_flight[rank] * act

    def overshoot(rank: int, n: int) -> float:
        return max(0.0, memory(rank, n) - budget)

    start = [len(p) for p in parts_of]
    per_rank = _greedy_fill(start, num_layers, lambda r, n: time(r, n) if overshoot(r, n) <= 0.0 else math.inf)
    feasible = per_rank is not None and all(overshoot(r, n) <= 0.0 for r, n in enumerate(start))
    if not feasible:
        least = _greedy_fill(start, num_layers, overshoot)
        assert least is not None
        worst = max(overshoot(r, n) for r, n in enumerate(least))  # >= every start's: counts only grow
        per_rank = _greedy_fill(start, num_layers, lambda r, n: time(r, n) if overshoot(r, n) <= worst else math.inf)
        assert per_rank is not None  # ``least`` is admitted
    counts = [0] * num_parts
    for rank, parts in enumerate(parts_of):
        def part_time(i: int, n: int, parts: list[int] = parts) -> float:
            j = parts[i]
            return n * layer.time + (first.time if j == 0 else 0.0) + (last.time if j == num_parts - 1 else 0.0)

        spread = _greedy_fill([1] * len(parts), per_rank[rank], part_time)
        assert spread is not None
        for j, n in zip(parts, spread):
            counts[j] = n
    return ChunkPartition(counts=tuple(counts), owners=tuple(owners),
                          rank_time=tuple(time(r, n) for r, n in enumerate(per_rank)),
                          rank_memory=tuple(memory(r, n) for r, n in enumerate(per_rank)),
                          budget=budget, feasible=feasible)
