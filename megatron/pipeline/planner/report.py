"""The planner's outputs: the flags that select a candidate, the JSON object, the terminal table.

The JSON schema is an interface (``docs/planning.md``; scripts read it): one object with
``model``, ``costs``, ``target``, ``synchronous`` and ``asynchronous`` (ranked indices into
``candidates``), ``pareto`` (indices) and ``candidates``, one object per candidate with at least
the fields of :data:`CANDIDATE_FIELDS`.

Like with like: each candidate records ``tied_embeddings``, its model's ``parameters`` and
``same_model`` (whether it trains the model the user's flags ask for: tied unless they pass
``--untie-embeddings-and-output-weights``). In the ranked lists and the text tables a candidate
training another model comes after every one that trains the asked-for model, marked
(``different_model`` in the JSON, ``*`` and a note in the table).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from megatron.pipeline.planner.candidates import Candidate
from megatron.pipeline.planner.evaluate import CandidateResult, Problem, model_parameters, same_model, tied_embeddings
from megatron.pipeline.planner.ranking import pareto_front, rank, split_by_semantics
from megatron.pipeline.schedules import schedule_class

CANDIDATE_FIELDS = (
    "schedule", "pipeline_model_parallel_size", "microbatches", "virtual_stages", "recompute", "layer_split",
    "iteration_time_ms", "tokens_per_s", "bubble_fraction", "peak_memory_gb", "fits", "max_drift", "semantics",
    "tied_embeddings", "parameters", "same_model", "flags",
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
    if cand.layer_split == "even":  # the default balances chains and chunked layouts alike
        out += ["--pipeline-partition", "even"]
    elif cand.layer_split == "offset":
        out += ["--pipeline-layer-split", *map(str, cand.counts)]
    return out


def model_fields(result: CandidateResult, problem: Problem | None) -> dict[str, Any]:
    """``tied_embeddings``, ``parameters`` (of the model the candidate trains) and ``same_model``."""
    c = result.candidate
    tied = tied_embeddings(c.schedule, problem)
    shape = problem.shape if problem is not None else None
    return {"tied_embeddings": tied,
            "parameters": None if shape is None else model_parameters(shape, tied == "tied"),
            "same_model": same_model(c.schedule, problem)}


def like_with_like(results: Sequence[CandidateResult], problem: Problem | None) -> list[CandidateResult]:
    """``results`` (ranked) with the candidates that train another model than the user's flags
    ask for moved after the rest, each group in its own order."""
    same = [r for r in results if model_fields(r, problem)["same_model"]]
    return same + [r for r in results if not model_fields(r, problem)["same_model"]]


def candidate_dict(result: CandidateResult, num_layers: int, problem: Problem | None = None) -> dict[str, Any]:
    c = result.candidate
    return {
        "schedule": c.schedule, "pipeline_model_parallel_size": c.pipeline_model_parallel_size,
        "micro_batch_size": c.micro_batch_size, "microbatches": c.microbatches, "virtual_stages": c.virtual_stages,
        "recompute": c.recompute, "layer_split": c.layer_split, "layer_counts": list(c.counts),
        "iteration_time_ms": result.iteration_time_ms, "tokens_per_s": result.tokens_per_s,
        "bubble_fraction": result.bubble_fraction, "peak_memory_gb": result.peak_memory_gb,
        "memory_breakdown_gb": [{k: v / 1e9 for k, v in dataclasses.asdict(m).items()} for m in result.memory],
        "fits": result.fits, "max_drift": result.max_drift, "semantics": result.semantics,
        **model_fields(result, problem),
        "comm_bytes_per_step": result.comm_bytes_per_step, "flags": flags(c, num_layers),
    }


def plan_dict(problem: Problem, results: Sequence[CandidateResult], refused: Sequence[str] = ()) -> dict[str, Any]:
    """The ``--json`` object (module docstring)."""
    index = {id(r): i for i, r in enumerate(results)}
    sync, asyn = (like_with_like(group, problem) for group in split_by_semantics(rank(results)))
    return {
        "model": {**dataclasses.asdict(problem.shape), "tied_embeddings": problem.tied,
                  "parameters": model_parameters(problem.shape, problem.tied)},
        "costs": problem.unit.to_dict(),
        "target": {"global_batch_size": problem.global_batch, **dataclasses.asdict(problem.parallel),
                   "device_memory_gb": None if problem.device_bytes is None else problem.device_bytes / 1e9},
        "synchronous": [index[id(r)] for r in sync],
        "asynchronous": [index[id(r)] for r in asyn],
        "pareto": [index[id(r)] for r in pareto_front(results)],
        "different_model": [i for i, r in enumerate(results) if not model_fields(r, problem)["same_model"]],
        "refused": sorted(set(refused)),
        "candidates": [candidate_dict(r, problem.shape.num_layers, problem) for r in results],
    }


def table(results: Sequence[CandidateResult], num_layers: int, title: str, top: int = 10,
          problem: Problem | None = None) -> str:
    """The top ``top`` of ranked ``results`` as text, with each one's flags. With ``problem``
    (the user's flags), candidates training another model come after the rest, marked ``*``."""
    lines = [title]
    if problem is not None:
        results = like_with_like(results, problem)
        other = [r for r in results if not model_fields(r, problem)["same_model"]]
        if other:
            asked = "tied" if problem.tied else "untied"
            lines.append(f"note: your flags ask for {asked} embeddings "
                         f"({model_parameters(problem.shape, problem.tied):,} parameters); candidates "
                         f"marked * train another model, listed after the rest: "
                         f"{model_fields(other[0], problem)['tied_embeddings']} "
                         f"({model_fields(other[0], problem)['parameters']:,} parameters)")
    lines.append(f"{'#':>2} {'schedule':<16} {'PP':>3} {'m':>4} {'v':>2} {'recomp':<9} {'split':<8} "
                 f"{'iter ms':>10} {'tokens/s':>11} {'bubble':>7} {'peak GB':>8} {'drift':>6}")
    for i, r in enumerate(results[:top], 1):
        c = r.candidate
        mark = "*" if problem is not None and not model_fields(r, problem)["same_model"] else " "
        lines.append(f"{i:>2}{mark}{c.schedule:<16} {c.pipeline_model_parallel_size:>3} {c.microbatches:>4} "
                     f"{c.virtual_stages:>2} {c.recompute:<9} {c.layer_split:<8} {r.iteration_time_ms:>10.2f} "
                     f"{r.tokens_per_s:>11.1f} {r.bubble_fraction:>7.3f} {max(r.peak_memory_gb):>8.3f} "
                     f"{max(r.max_drift, default=0):>6}")
        lines.append("     " + " ".join(flags(c, num_layers)))
    if not results:
        lines.append("   (no candidate fits)")
    return "\n".join(lines)
