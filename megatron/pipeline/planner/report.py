"""The planner's outputs: the flags that select a candidate, the JSON object, the terminal table.

The JSON schema is an interface (``docs/planning.md``; scripts read it): one object with
``model``, ``costs``, ``target``, ``synchronous`` and ``asynchronous`` (ranked indices into
``candidates``), ``pareto`` (indices) and ``candidates``, one object per candidate with at least
the fields of :data:`CANDIDATE_FIELDS`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from megatron.pipeline.planner.candidates import Candidate
from megatron.pipeline.planner.evaluate import CandidateResult, Problem, tied_embeddings
from megatron.pipeline.planner.ranking import pareto_front, rank, split_by_semantics
from megatron.pipeline.schedules import schedule_class

CANDIDATE_FIELDS = (
    "schedule", "pipeline_model_parallel_size", "microbatches", "virtual_stages", "recompute", "layer_split",
    "iteration_time_ms", "tokens_per_s", "bubble_fraction", "peak_memory_gb", "fits", "max_drift", "semantics",
    "tied_embeddings", "flags",
)

_RECOMPUTE_FLAGS = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}


def flags(cand: Candidate, num_layers: int) -> list[str]:
    """The trainer's flags that select ``cand`` (to paste after the user's own)."""
    out = ["--pipeline-model-parallel-size", str(cand.pipeline_model_parallel_size),
           "--pipeline-schedule", cand.schedule, "--micro-batch-size", str(cand.micro_batch_size)]
    if schedule_class(cand.schedule).traits.takes_model_chunks and cand.virtual_stages > 1:
        out += ["--num-layers-per-virtual-pipeline-stage",
                str(num_layers // (cand.pipeline_model_parallel_size * cand.virtual_stages))]
    out += _RECOMPUTE_FLAGS[cand.recompute]
    if cand.layer_split == "even" and cand.virtual_stages == 1 and len(cand.counts) == cand.pipeline_model_parallel_size:
        out += ["--pipeline-partition", "even"]
    elif cand.layer_split == "offset":
        out += ["--pipeline-layer-split", *map(str, cand.counts)]
    return out


def candidate_dict(result: CandidateResult, num_layers: int) -> dict[str, Any]:
    c = result.candidate
    return {
        "schedule": c.schedule, "pipeline_model_parallel_size": c.pipeline_model_parallel_size,
        "micro_batch_size": c.micro_batch_size, "microbatches": c.microbatches, "virtual_stages": c.virtual_stages,
        "recompute": c.recompute, "layer_split": c.layer_split, "layer_counts": list(c.counts),
        "iteration_time_ms": result.iteration_time_ms, "tokens_per_s": result.tokens_per_s,
        "bubble_fraction": result.bubble_fraction, "peak_memory_gb": result.peak_memory_gb,
        "memory_breakdown_gb": [{k: v / 1e9 for k, v in dataclasses.asdict(m).items()} for m in result.memory],
        "fits": result.fits, "max_drift": result.max_drift, "semantics": result.semantics,
        "tied_embeddings": tied_embeddings(c.schedule),
        "comm_bytes_per_step": result.comm_bytes_per_step, "flags": flags(c, num_layers),
    }


def plan_dict(problem: Problem, results: Sequence[CandidateResult], refused: Sequence[str] = ()) -> dict[str, Any]:
    """The ``--json`` object (module docstring)."""
    index = {id(r): i for i, r in enumerate(results)}
    sync, asyn = split_by_semantics(rank(results))
    return {
        "model": dataclasses.asdict(problem.shape),
        "costs": problem.unit.to_dict(),
        "target": {"global_batch_size": problem.global_batch, **dataclasses.asdict(problem.parallel),
                   "device_memory_gb": None if problem.device_bytes is None else problem.device_bytes / 1e9},
        "synchronous": [index[id(r)] for r in sync],
        "asynchronous": [index[id(r)] for r in asyn],
        "pareto": [index[id(r)] for r in pareto_front(results)],
        "refused": sorted(set(refused)),
        "candidates": [candidate_dict(r, problem.shape.num_layers) for r in results],
    }


def table(results: Sequence[CandidateResult], num_layers: int, title: str, top: int = 10) -> str:
    """The top ``top`` of ranked ``results`` as text, with each one's flags."""
    lines = [title, f"{'#':>2} {'schedule':<16} {'PP':>3} {'m':>4} {'v':>2} {'recomp':<9} {'split':<8} "
                    f"{'iter ms':>10} {'tokens/s':>11} {'bubble':>7} {'peak GB':>8} {'drift':>6}"]
    for i, r in enumerate(results[:top], 1):
        c = r.candidate
        lines.append(f"{i:>2} {c.schedule:<16} {c.pipeline_model_parallel_size:>3} {c.microbatches:>4} "
                     f"{c.virtual_stages:>2} {c.recompute:<9} {c.layer_split:<8} {r.iteration_time_ms:>10.2f} "
                     f"{r.tokens_per_s:>11.1f} {r.bubble_fraction:>7.3f} {max(r.peak_memory_gb):>8.3f} "
                     f"{max(r.max_drift, default=0):>6}")
        lines.append("     " + " ".join(flags(c, num_layers)))
    if not results:
        lines.append("   (no candidate fits)")
    return "\n".join(lines)
