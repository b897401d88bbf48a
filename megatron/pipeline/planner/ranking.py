"""Ranking and the Pareto front of the planner's candidates.

Why apart by semantics: a synchronous schedule computes exactly what one device would, an
asynchronous one trades that for throughput, so the two are ranked separately and a user
chooses across them knowingly. Within each list, candidates that fit the device come first by
tokens/s (higher first); ties (equal within float noise of the same simulation) keep a stable,
documented order: less peak memory, then fewer micro-batches, then the candidate's own order.
"""
from __future__ import annotations

from collections.abc import Sequence

from megatron.pipeline.planner.evaluate import CandidateResult

#: Relative difference under which two simulated throughputs count as equal: the simulator adds
#: at most a few hundred float64 op durations per stage, each rounding by 2^-53 relative, so
#: equal schedules agree to ~1e-13; 1e-9 is far above that and far below any real difference.
TIE = 1e-9


def _tie_key(result: CandidateResult) -> tuple[float, int]:
    return (max(result.peak_memory_gb, default=0.0), result.candidate.microbatches)


def rank(results: Sequence[CandidateResult]) -> list[CandidateResult]:
    """Fitting candidates by tokens/s (throughputs within :data:`TIE` sorted by memory, then
    micro-batches), stable otherwise."""
    fitting = [r for r in results if r.fits]
    ordered = sorted(fitting, key=lambda r: -r.tokens_per_s)
    out: list[CandidateResult] = []
    i = 0
    while i < len(ordered):  # group ties, then order each group by memory and micro-batches
        j = i + 1
        while j < len(ordered) and ordered[i].tokens_per_s - ordered[j].tokens_per_s <= TIE * ordered[i].tokens_per_s:
            j += 1
        out.extend(sorted(ordered[i:j], key=_tie_key))
        i = j
    return out


def split_by_semantics(ranked: Sequence[CandidateResult]) -> tuple[list[CandidateResult], list[CandidateResult]]:
    """(synchronous, asynchronous), each in ranked order."""
    return ([r for r in ranked if r.semantics == "exact"], [r for r in ranked if r.semantics != "exact"])


def pareto_front(results: Sequence[CandidateResult]) -> list[CandidateResult]:
    """The candidates no other candidate beats on both throughput (higher) and peak memory
    (lower), the largest stage's; sorted by memory. One that ties another on both is kept
    once (the first given)."""
    points = sorted(results, key=lambda r: (max(r.peak_memory_gb, default=0.0), -r.tokens_per_s))
    front: list[CandidateResult] = []
    best = float("-inf")
    for r in points:
        if r.tokens_per_s > best:
            front.append(r)
            best = r.tokens_per_s
    return front
