"""Tied input embedding and output layer: Megatron-LM's default, ``--untie-embeddings-and-output-weights``
the opt-out.

Synchronous schedules tie: one parameter when a chunk holds both ends, else a copy on the output
layer's stage whose gradient is summed with the embedding's before every synchronous step
(:mod:`megatron.pipeline.runtime.tied_embeddings`). Asynchronous schedules step each stage on
its own clock; an exact tie would need the first and the last stage to meet at every update,
the synchronisation they exist to avoid. Their default is untied and the banner says why
(Megatron-LM has no flag that asks for tying, so there is no request to refuse).

Refused with one line, before any rank starts, where the two ends live on different stages:
Zero Bubble's post-validation (its optimistic per-stage step has no synchronous point to sum
at) and ``--use-distributed-optimizer`` (each replica steps only its own range of a stage's flat
gradients, which differ between the two stages).
"""
from __future__ import annotations

import argparse

from megatron.pipeline.schedules import schedule_class
from megatron.trainer.config.errors import ArgumentError

UNTIE = "--untie-embeddings-and-output-weights"


def resolve_tied_embeddings(args: argparse.Namespace) -> None:
    """Set ``args.tie_embeddings`` and ``args.embeddings_line`` (the banner's words); one-line
    :class:`ArgumentError` for a tied run this runtime cannot keep tied."""
    asynchronous = schedule_class(args.pipeline_schedule).asynchronous
    if args.untie_embeddings_and_output_weights:
        args.tie_embeddings, args.embeddings_line = False, f"embeddings: untied ({UNTIE})"
    elif asynchronous:
        args.tie_embeddings = False
        args.untie_embeddings_and_output_weights = True  # what runs, and what a checkpoint records
        args.embeddings_line = (f"embeddings: untied, as every asynchronous schedule ({args.pipeline_schedule}): "
                                f"each stage steps on its own clock, and tying would make the first and "
                                f"last stage meet at every update")
    else:
        args.tie_embeddings, args.embeddings_line = True, "embeddings: tied to the output layer (Megatron-LM's default)"
    if not args.tie_embeddings or args.pipeline_model_parallel_size == 1:
        return
    if getattr(args, "enable_optimizer_post_validation", False):
        raise ArgumentError(f"tied embeddings need a synchronous step to sum the two copies' gradients; "
                            f"--enable-optimizer-post-validation has none: add {UNTIE}")
    if getattr(args, "use_distributed_optimizer", False):
        raise ArgumentError(f"tied embeddings with --use-distributed-optimizer at --pipeline-model-parallel-size > 1 "
                            f"are not supported (each replica steps its own range of the copies): add {UNTIE}")
