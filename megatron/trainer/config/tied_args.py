"""Tied input embedding and output layer: Megatron-LM's default, ``--untie-embeddings-and-output-weights``
the opt-out.

Synchronous schedules tie: one parameter when a chunk holds both ends, else a copy on the output
layer's chunk whose gradient is summed with the embedding's before every synchronous step
(:mod:`megatron.pipeline.runtime.tied_embeddings`). The V layout (zb-v, v-half, v-min,
dualpipev) holds both ends on stage 0, in its two chunks: they share one parameter there, as at
PP = 1, so there is no copy and nothing to sum or send. Asynchronous schedules step each stage on
its own clock; an exact tie would need the first and the last stage to meet at every update,
the synchronisation they exist to avoid. Their default is untied and the banner says why
(Megatron-LM has no flag that asks for tying, so there is no request to refuse). They are the
only configurations that fall back to untied: every synchronous one ties, under any of the
options below (``tests/test_tied_post_validation.py`` checks every registered schedule).

With ``--use-distributed-optimizer`` at PP > 1 the two ends are tied too: the embedding group
sums the whole gradients before the data-parallel reduce-scatter (where Megatron-LM's
``finalize_model_grads`` sums them), so both ends' replicas step identical values with the
element-wise AdamW, whatever range of their stage's flat gradients the parameter falls in.

Under Zero Bubble's post-validation the two ends are tied too: each end's stage sums the two
gradients right before its optimistic step, in point-to-point ops placed in the streams
(:mod:`megatron.pipeline.schedules.zero_bubble.tied_exchange`), so both ends step and redo the
same bits, and an end rolls back bitwise (its stage may roll back a step the other end's stage
never took).

On the V layout ``--overlap-grad-reduce`` ties: the shared parameter's bucket is launched once
both chunks of stage 0 have accumulated into it
(:mod:`~megatron.pipeline.runtime.grad_buckets`).
"""
from __future__ import annotations

from megatron.pipeline.planner.evaluate import ASYNCHRONOUS_UNTIED
from megatron.pipeline.schedules import schedule_class
from megatron.trainer.config.job_config import JobConfig, ModelConfig
from megatron.trainer.config.run_plan import Embeddings, RunPlan

UNTIE = "--untie-embeddings-and-output-weights"


UNTIED_BY_FLAG_LINE = f"embeddings: untied ({UNTIE})"
TIED_LINE = "embeddings: tied to the output layer (Megatron-LM's default)"


def _untied_because(config: JobConfig) -> str | None:
    """Why this run cannot tie (None: it can). Only the asynchronous schedules (and
    ``auto-async``, which may pick one) fall back to untied; every synchronous configuration
    ties, post-validated or not, whatever the layout, the data-parallel options or the size."""
    name = config.schedule.pipeline_schedule
    cls = schedule_class(name)
    if cls.traits.asynchronous or cls.traits.may_become_asynchronous:  # auto-async may switch to one
        return f"as every asynchronous schedule ({name}): {ASYNCHRONOUS_UNTIED}"
    return None


def embeddings_of(config: JobConfig) -> Embeddings:
    """Tied unless ``--untie-embeddings-and-output-weights`` or an asynchronous schedule."""
    if config.model.untie_embeddings_and_output_weights:
        return Embeddings(False, UNTIED_BY_FLAG_LINE)
    reason = _untied_because(config)
    return Embeddings(True, TIED_LINE) if reason is None else Embeddings(False, f"embeddings: untied, {reason}")


def tied_parameter_count(plan: RunPlan) -> int:
    """Elements of the tied weight (the vocabulary matrix, whole: TP shards it): counted once in
    the banner's totals, however many stages hold a copy; 0 when untied."""
    return plan.vocab.size * plan.model.hidden_size if plan.embeddings.tied else 0


def embeddings_record(plan: RunPlan) -> dict:
    """What ``--log-json`` records say of the embeddings (with the banner's words)."""
    return {"tied": plan.embeddings.tied, "tied_parameters": tied_parameter_count(plan), "line": plan.embeddings.line}


def asks_for_tied(model: ModelConfig) -> bool:
    """Whether the user's flags ask for the tied model (no ``--untie-embeddings-and-output-weights``),
    whatever the chosen schedule runs (an asynchronous one unties by default)."""
    return not model.untie_embeddings_and_output_weights
