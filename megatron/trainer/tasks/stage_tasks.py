"""What the megatron-core model tasks (GPT, BERT) share: model arguments from the flags, model
chunks per pipeline stage, the micro-batch function and the activation spec.

They differ only in the model built per virtual stage, the data source and the loss.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from megatron.pipeline.runtime.tied_embeddings import share_local_ends
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.config.megatron_compat_args import compat_model_kwargs
from megatron.trainer.config.recompute_args import recompute_model_kwargs
from megatron.trainer.models.stage import PipelineStage, model_dtype, split_layers
from megatron.trainer.tasks.task import Batch, microbatch_sample_indices


class BatchSource(Protocol):
    def micro_batch(self, sample_indices: list[int]) -> Batch: ...


def transformer_kwargs(config: RunPlan) -> dict[str, Any]:
    """:class:`~megatron.trainer.models.stage.TransformerArgs` fields from Megatron's flags."""
    impl = {"auto": None, "local": False, "transformer_engine": True}[config.model.transformer_impl]
    if impl is None and config.parallel.tensor_model_parallel_size > 1:
        impl = False  # auto at TP > 1: the local spec (TE layers' shard layout is not mapped)
    return dict(
        num_layers=config.model.num_layers,
        hidden_size=config.model.hidden_size,
        num_attention_heads=config.model.num_attention_heads,
        seq_length=config.model.seq_length,
        max_position_embeddings=config.model.max_position_embeddings,
        vocab_size=config.vocab.size,
        ffn_hidden_size=config.model.ffn_hidden_size,
        num_query_groups=config.model.num_query_groups,
        hidden_dropout=config.model.hidden_dropout,
        attention_dropout=config.model.attention_dropout,
        init_method_std=config.model.init_method_std,
        normalization=config.model.normalization,
        position_embedding_type=config.model.position_embedding_type,
        bf16=config.precision.bf16,
        fp16=config.precision.fp16,
        use_transformer_engine=impl,
        **compat_model_kwargs(config),
        **recompute_model_kwargs(config),
    )


def build_chunks(
    config: RunPlan, stage: int, build: Callable[[range, bool, bool], PipelineStage]
) -> list[torch.nn.Module]:
    """The chunks of ``stage``, each owning the global layers of its part of the model.

    The schedule's layout says which part chunk c holds (``layout.model_stage``): virtual
    stage c * PP + stage for interleaving (the model split evenly into PP * V parts), logical
    stage of pipeline c for AMDP's replicated pipelines (PP parts, each built once per
    pipeline; initialisation by global name makes the replicas identical).
    ``build(layers, pre_process, post_process)`` builds one part, the embedding on part 0
    only, the output heads and loss on the last one.
    """
    layout = config.run.layout
    parts = layout.num_model_stages
    split = layout.part_layer_split(config.layers.counts)  # per part (a V halves each stage's)
    part_layers = split_layers(config.model.num_layers, parts, split)
    model_stages = [layout.model_stage(stage, c) for c in range(layout.num_chunks)]
    chunks = [build(part_layers[j], j == 0, j == parts - 1) for j in model_stages]
    if config.embeddings.tied and parts > 1 and 0 in model_stages and parts - 1 in model_stages:
        # Both ends on this stage (a V's stage 0): one parameter, as at PP = 1.
        first, last = chunks[model_stages.index(0)], chunks[model_stages.index(parts - 1)]
        share_local_ends(last.model.output_layer, first.model.embedding.word_embeddings.weight)
    return chunks


def global_named_parameters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Parameters of a stage's chunks by their names in the unsplit model (a parameter two
    chunks share, the tied embedding on a V's stage 0, once: under the first chunk's name)."""
    seen: set[int] = set()
    for chunk in chunks:
        assert isinstance(chunk, PipelineStage)
        for name, param in chunk.global_named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param


def micro_batch_fn(
    data: BatchSource, config: RunPlan, dp_rank: int, device: torch.device
) -> Callable[[int], Batch]:
    """Global micro-batch index -> this data-parallel replica's samples on ``device``."""
    mbs, dp = config.training.micro_batch_size, config.parallel.data_parallel_size

    def get(microbatch: int) -> Batch:
        batch = data.micro_batch(microbatch_sample_indices(microbatch, mbs, dp_rank, dp))
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    return get


def hidden_activation_spec(config: RunPlan) -> tuple[tuple[int, ...], torch.dtype]:
    """Hidden states ``[s, b, h]`` cross stage boundaries, bf16/fp16 with ``--bf16``/``--fp16``;
    ``[s / T, b, h]`` with ``--sequence-parallel`` (each TP rank sends its own sequence shard
    to its TP-matched peer)."""
    seq = config.model.seq_length
    if config.parallel.sequence_parallel:
        seq //= config.parallel.tensor_model_parallel_size
    return (seq, config.training.micro_batch_size, config.model.hidden_size), model_dtype(config.precision)
