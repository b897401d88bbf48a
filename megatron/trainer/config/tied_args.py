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

import argparse

from megatron.pipeline.planner.evaluate import ASYNCHRONOUS_UNTIED
from megatron.pipeline.schedules import schedule_class

UNTIE = "--untie-embeddings-and-output-weights"


def _untied_because(args: argparse.Namespace) -> str | None:
    """Why this run cannot tie (None: it can). Only the asynchronous schedules (and
    ``auto-async``, which may pick one) fall back to untied; every synchronous configuration
    ties, post-validated or not, whatever the layout, the data-parallel options or the size."""
    cls = schedule_class(args.pipeline_schedule)
    if cls.traits.asynchronous or cls.traits.may_become_asynchronous:  # auto-async may switch to one
        return f"as every asynchronous schedule ({args.pipeline_schedule}): {ASYNCHRONOUS_UNTIED}"
    return None


def tied_parameter_count(model) -> int:
    """Elements of the tied weight (the vocabulary matrix, whole: TP shards it): counted once in
    the banner's totals, however many stages hold a copy; 0 when untied."""
    return model.padded_vocab_size * model.hidden_size if model.tie_embeddings else 0


def embeddings_record(model) -> dict:
    """What ``--log-json`` records say of the embeddings (with the banner's words)."""
    record = {"tied": bool(model.tie_embeddings), "tied_parameters": tied_parameter_count(model)}
    if model.embeddings_line is not None:
        record["line"] = model.embeddings_line
    return record


UNTIED_BY_FLAG_LINE = f"embeddings: untied ({UNTIE})"


def asks_for_tied(model) -> bool:
    """Whether the user's flags ask for the tied model (no ``--untie-embeddings-and-output-weights``),
    whatever the chosen schedule runs (an asynchronous one unties by default). Before
    :func:`resolve_tied_embeddings` (the planner's flags) the flag is still the user's own."""
    if model.embeddings_line is None:
        return not model.untie_embeddings_and_output_weights
    return model.embeddings_line != UNTIED_BY_FLAG_LINE


def resolve_tied_embeddings(args: argparse.Namespace) -> None:
    """Set ``args.tie_embeddings`` and ``args.embeddings_line`` (the banner's words)."""
    if args.untie_embeddings_and_output_weights:
        args.tie_embeddings, args.embeddings_line = False, UNTIED_BY_FLAG_LINE
        return
    reason = _untied_because(args)
    if reason is None:
        args.tie_embeddings, args.embeddings_line = True, "embeddings: tied to the output layer (Megatron-LM's default)"
    else:
        args.tie_embeddings = False
        args.untie_embeddings_and_output_weights = True  # what runs, and what a checkpoint records
        args.embeddings_line = f"embeddings: untied, {reason}"
