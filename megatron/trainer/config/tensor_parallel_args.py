"""``--tensor-model-parallel-size``: what a tensor-parallel run can and cannot combine with.

Checked before any rank starts, each refusal one line. The model half (which dimensions are
sharded) lives in :mod:`megatron.trainer.models.tensor_parallel`; here are the run-level
limits:

* the emulator runs every stage in one process, so it has no T ranks for megatron's TP
  layers: TP runs use the distributed runtime (one process per TP rank per stage);
* heads, query groups, the FFN size and the (padded) vocabulary must split T ways;
* basis rotation keeps eigenbases of each weight matrix: a shard's bases are not the full
  matrix's, so a TP run would train a different optimizer than TP = 1;
* ``--pipeline-partition profiled`` times layers on rank 0 alone, but a TP layer's forward is a
  collective over its TP group;
* Transformer Engine's TP layers are not mapped by
  :func:`~megatron.trainer.models.tensor_parallel.mark_tensor_parallel` (shard initialisation,
  checkpoints, norms read those marks), so TP runs use the local spec (``auto`` picks it);
* ``--sequence-parallel`` splits the sequence over the TP group: it needs T > 1 (Megatron-LM
  turns it off silently at T = 1; here that is a refusal) and a sequence length divisible by T.
"""
from __future__ import annotations

import argparse
from typing import Protocol

from megatron.trainer.config.errors import ConfigError


class ShardedSizes(Protocol):
    """The model sizes a tensor-parallel split divides (a ``ModelConfig`` or ``TransformerArgs``)."""

    num_attention_heads: int
    num_query_groups: int | None
    hidden_size: int
    ffn_hidden_size: int | None


def check_tensor_parallel_args(model: ShardedSizes, tp_size: int, vocab_size: int | None) -> None:
    """Raise ValueError with one line when the model cannot be sharded ``tp_size`` ways;
    ``vocab_size``: the padded vocabulary (None: a tokenizer's, padded to a multiple of TP by
    construction)."""
    if tp_size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp_size}")
    groups = model.num_query_groups or model.num_attention_heads
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    for what, value in (("--num-attention-heads", model.num_attention_heads),
                        ("--num-query-groups", groups), ("--ffn-hidden-size", ffn),
                        ("--vocab-size (padded)", vocab_size)):
        if value is not None and value % tp_size:
            raise ValueError(f"{what} {value} is not divisible by --tensor-model-parallel-size {tp_size}")


def check_tensor_parallel_flags(args: argparse.Namespace) -> None:
    """Raise :class:`ConfigError` (one line) for a TP size this run cannot use."""
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel:
        if tp == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence "
                              "over the tensor-parallel group)")
        if args.seq_length % tp:
            raise ConfigError(f"--sequence-parallel: --seq-length {args.seq_length} is not divisible by "
                              f"--tensor-model-parallel-size {tp}")
    if tp == 1:
        return
    if args.pipeline_executor == "emulator":
        raise ConfigError(f"--tensor-model-parallel-size {tp} needs one process per tensor-parallel rank, which "
                          "the emulator (one process) does not have: use --pipeline-executor distributed")
    from megatron.trainer.config.job_config import build_job_config

    try:
        check_tensor_parallel_args(build_job_config(args).model, tp,
                                   None if args.tokenizer_type is not None else args.vocab_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.optimizer == "basis-rotation":
        raise ConfigError(f"--optimizer basis-rotation with --tensor-model-parallel-size {tp}: the rotation bases "
                          "of a weight's shard are not those of the full weight (use --optimizer adamw)")
    if args.transformer_impl == "transformer_engine":
        raise ConfigError(f"--transformer-impl transformer_engine with --tensor-model-parallel-size {tp}: TE's "
                          "tensor-parallel layers are not mapped for sharded init and checkpoints (use local)")
    if args.pipeline_partition == "profiled" and args.pipeline_layer_split is None:
        raise ConfigError(f"--pipeline-partition profiled with --tensor-model-parallel-size {tp}: rank 0 profiles "
                          "layers alone, and a tensor-parallel layer needs its whole TP group (use balanced)")
