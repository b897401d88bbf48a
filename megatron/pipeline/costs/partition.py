"""Memory-constrained min-max layer partition (PACI, Appendix D.5): a pure solver.

Problem. Layers ``0 .. L-1`` with time ``t[l]``, static memory ``s[l]`` (parameters, gradients,
optimizer state) and activation memory ``a[l]`` (saved for backward, per micro-batch) are split
into ``N`` contiguous, non-empty stages. Stage ``j`` keeps ``w[j]`` micro-batches in flight (1F1B
and PACI: ``N - j``, 0-based; GPipe: ``m``), so its memory is
``M_j = sum_{l in G_j} s[l] + w[j] * sum_{l in G_j} a[l]``. Minimise ``max_j T(G_j)`` subject to
``M_j <= B`` for every ``j``.

Algorithm: exact dynamic program over prefixes (the paper's recursion (15)), ``O(N L^2)``::

    D[i][j] = min over j-1 <= x < i with M_j(x, i) <= B of max(D[x][j-1], T(x, i))
    D[i][1] = T(0, i) if M_1(0, i) <= B else +inf

Why it is optimal (induction on j). Claim: ``D[i][j]`` is the least max stage time over all
splits of the first ``i`` layers into ``j`` non-empty stages that respect the budget, where
stage ``k`` uses ``w[k]`` (stage indices are positions, so a prefix split of ``j - 1`` stages
has the same in-flight counts as in the full problem). ``j = 1``: there is only one split.
Step: any feasible split of ``i`` layers into ``j`` stages consists of a last stage ``(x, i]``
with ``M_j(x, i) <= B`` and a feasible split of the first ``x`` layers into ``j - 1`` stages, of
cost ``max(prefix cost, T(x, i)) >= max(D[x][j-1], T(x, i))`` by the induction hypothesis and
monotonicity of ``max``; the recursion takes the minimum of exactly these lower bounds over
all admissible ``x``, and each bound is attained by extending an optimal prefix split (which
backtracking through ``argmin`` recovers). Constraints are per stage, so feasibility of the
extended split is feasibility of its parts. Hence ``D[L][N]`` is optimal, ``+inf`` iff no split
fits the budget.

Infeasibility fallback (the paper's second pass, lexicographic in (overshoot, time)). With
``o_j = max(0, M_j - B)``: first ``O* = min over splits of max_j o_j``, by the same recursion
with ``o`` in place of ``T`` and no constraint (optimal by the same argument, ``max`` being
monotone in ``o`` too); then the first pass again with the per-stage constraint ``o_j <= O*``
instead of ``o_j <= 0``. Every split the second run admits has worst overshoot exactly
``O*`` (no less, by optimality of ``O*``), and among those it returns the least max stage
time: the lexicographic minimum of (worst overshoot, max stage time). The constraint is
evaluated with the same floating-point expression in both runs, so the split attaining
``O*`` is admitted (no epsilon). ``O* = 0`` exactly when the budget is feasible.

Ties (several splits with the same optimum) go to the smallest ``x``, i.e. the latest stages
take as many layers as the optimum allows: under 1F1B they hold the fewest micro-batches.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class Partition:
    """A split and what it costs; ``feasible`` is False when the fallback had to overshoot."""

    counts: tuple[int, ...]  # layers per stage
    stage_time: tuple[float, ...]
    stage_memory: tuple[float, ...]
    budget: float
    feasible: bool

    @property
    def max_time(self) -> float:
        return max(self.stage_time)

    @property
    def overshoot(self) -> float:
        """The worst stage's memory above the budget (0 when feasible)."""
        return max(max(0.0, m - self.budget) for m in self.stage_memory)

    @property
    def bounds(self) -> list[range]:
        out, start = [], 0
        for c in self.counts:
            out.append(range(start, start + c))
            start += c
        return out


def _prefix(values: Sequence[float]) -> list[float]:
    return [0.0, *accumulate(float(v) for v in values)]


def _min_max_dp(num_layers: int, num_stages: int, cost: Callable[[int, int, int], float],
                allowed: Callable[[int, int, int], bool]) -> tuple[float, list[int] | None]:
    """min over splits of max_j cost(j, x, i), every stage (x, i] of stage j ``allowed``.

    Returns the optimum and the cut points ``[0, c_1, ..., L]`` (None if nothing is allowed).
    """
    inf = math.inf
    best = [[inf] * (num_stages + 1) for _ in range(num_layers + 1)]
    arg = [[-1] * (num_stages + 1) for _ in range(num_layers + 1)]
    for i in range(1, num_layers - num_stages + 2):
        if allowed(0, 0, i):
            best[i][1] = cost(0, 0, i)
            arg[i][1] = 0
    for j in range(2, num_stages + 1):
        stage = j - 1  # 0-based index of the last stage
        for i in range(j, num_layers - (num_stages - j) + 1):
            for x in range(j - 1, i):
                prev = best[x][j - 1]
                if prev == inf or not allowed(stage, x, i):
                    continue
                value = max(prev, cost(stage, x, i))
                if value < best[i][j]:
                    best[i][j] = value
                    arg[i][j] = x
    if best[num_layers][num_stages] == inf:
        return inf, None
    cuts = [num_layers]
    i = num_layers
    for j in range(num_stages, 0, -1):
        i = arg[i][j]
        cuts.append(i)
    return best[num_layers][num_stages], cuts[::-1]


def partition_layers(times: Sequence[float], static: Sequence[float], activation: Sequence[float],
                     in_flight: Sequence[float], budget: float = math.inf) -> Partition:
    """The optimal contiguous split of ``len(times)`` layers over ``len(in_flight)`` stages
    (problem and proof: module docstring). ``in_flight[j]``: micro-batches whose activations
    stage ``j`` holds at its peak under the schedule. Falls back to the least-overshoot split
    (then least max time) when nothing fits ``budget``; check :attr:`Partition.feasible`."""
    num_layers, num_stages = len(times), len(in_flight)
    if not (len(static) == len(activation) == num_layers):
        raise ValueError(f"need one time, static and activation value per layer, got "
                         f"{len(times)}, {len(static)}, {len(activation)}")
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} non-empty stages")
    if any(v < 0 or math.isnan(v) for v in (*times, *static, *activation, *in_flight)):
        raise ValueError("times, memory sizes and in-flight counts must be non-negative numbers")
    T, S, A = _prefix(times), _prefix(static), _prefix(activation)

    def stage_time(j: int, x: int, i: int) -> float:
        return T[i] - T[x]

    def memory(j: int, x: int, i: int) -> float:
        return (S[i] - S[x]) + in_flight[j] * (A[i] - A[x])

    def overshoot(j: int, x: int, i: int) -> float:
        return max(0.0, memory(j, x, i) - budget)

    _, cuts = _min_max_dp(num_layers, num_stages, stage_time, lambda j, x, i: overshoot(j, x, i) <= 0.0)
    feasible = cuts is not None
    if cuts is None:  # the paper's fallback: least worst overshoot, then least max time
        worst, _ = _min_max_dp(num_layers, num_stages, overshoot, lambda j, x, i: True)
        _, cuts = _min_max_dp(num_layers, num_stages, stage_time, lambda j, x, i: overshoot(j, x, i) <= worst)
        assert cuts is not None  # the split attaining ``worst`` is admitted
    pairs = list(zip(cuts, cuts[1:]))
    return Partition(
        counts=tuple(i - x for x, i in pairs),
        stage_time=tuple(stage_time(j, x, i) for j, (x, i) in enumerate(pairs)),
        stage_memory=tuple(memory(j, x, i) for j, (x, i) in enumerate(pairs)),
        budget=budget,
        feasible=feasible,
    )


def one_f_one_b_in_flight(num_stages: int, microbatches: int) -> list[int]:
    """Micro-batches in flight per stage in 1F1B / PACI steady state: ``min(N - j, m)`` (0-based)."""
    return [min(num_stages - j, microbatches) for j in range(num_stages)]
