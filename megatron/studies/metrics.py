"""What a study reports: smoothed loss curves, iterations to a target loss, depth slowdown.

Slowdown follows the basis-rotation paper: iterations a method needs to reach a target loss at
depth P, divided by the iterations the same method needs at P = 1. Training loss is smoothed
with a trailing mean first: a single lucky micro-batch must not count as reaching the target.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def iterations_to_target(iterations: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """First iteration at which ``losses`` reaches ``target``, linearly interpolated between the
    two surrounding points (as the PACI paper times perplexity crossings); None if never."""
    for i, (it, loss) in enumerate(zip(iterations, losses)):
        if loss <= target:
            if i == 0:
                return float(it)
            it0, loss0 = iterations[i - 1], losses[i - 1]
            return it0 + (it - it0) * (loss0 - target) / (loss0 - loss)
    return None


def value_at(iterations: Sequence[float], values: Sequence[float], iteration: float) -> float:
    """``values`` linearly interpolated at ``iteration`` (clamped to the ends)."""
    if iteration <= iterations[0]:
        return values[0]
    for (i0, v0), (i1, v1) in zip(zip(iterations, values), zip(iterations[1:], values[1:])):
        if iteration <= i1:
            return v0 + (v1 - v0) * (iteration - i0) / (i1 - i0)
    return values[-1]


def slowdowns(to_target: dict[str, dict[int, float | None]]) -> dict[str, dict[int, float | None]]:
    """method -> depth -> iterations-to-target at that depth / at depth 1 (None: not reached,
    or the method's P = 1 run did not reach it either)."""
    out: dict[str, dict[int, float | None]] = {}
    for method, by_depth in to_target.items():
        base = by_depth.get(1)
        out[method] = {p: (None if base is None or its is None else its / base) for p, its in by_depth.items()}
    return out


def relative_gap(loss: float, reference: float) -> float:
    """(loss - reference) / reference: + means worse than the reference."""
    return (loss - reference) / reference if reference else math.inf
