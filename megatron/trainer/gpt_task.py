"""GPT pretraining on megatron-core's GPTModel, split into pipeline stages."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import torch

from megatron.trainer.data.gpt_dataset import GPTDataSource, build_gpt_datasets
from megatron.trainer.data.mock import MockGPTData
from megatron.trainer.models.gpt import GPTModelArgs, GPTStage, build_gpt_stage, gpt_loss, split_layers
from megatron.trainer.task import Batch, microbatch_sample_indices


def gpt_model_args(args: argparse.Namespace) -> GPTModelArgs:
    impl = {"auto": None, "local": False, "transformer_engine": True}[args.transformer_impl]
    return GPTModelArgs(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        vocab_size=args.vocab_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        position_embedding_type=args.position_embedding_type,
        bf16=args.bf16,
        use_transformer_engine=impl,
    )


class GPTTask:
    name = "gpt"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        return None

    def build_stage(self, args: argparse.Namespace, stage: int, device: torch.device) -> list[torch.nn.Module]:
        """Chunk c of ``stage`` owns the global layers of virtual stage c * PP + stage.

        With V chunks per stage the model is split evenly into PP * V virtual stages; the
        embedding lives on virtual stage 0 only, the output layer and loss on the last one.
        Initial weights depend only on global names, so any split starts identically.
        """
        pp, chunks = args.pipeline_model_parallel_size, getattr(args, "num_model_chunks", 1)
        split = args.pipeline_layer_split if chunks == 1 else None
        virtual_layers = split_layers(args.num_layers, pp * chunks, split)
        model_args = gpt_model_args(args)
        built = []
        for c in range(chunks):
            v = c * pp + stage
            chunk = build_gpt_stage(
                model_args, virtual_layers[v], pre_process=v == 0, post_process=v == pp * chunks - 1,
                seed=args.seed, device=device,
            )
            if getattr(args, "reset_attention_mask", False):
                chunk.middle_batch_keys = ("attention_mask",)  # every layer applies the mask
            built.append(chunk)
        return built

    def named_parameters(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for chunk in chunks:
            assert isinstance(chunk, GPTStage)
            yield from chunk.global_named_parameters()

    def batch_fn(self, args: argparse.Namespace, dp_rank: int, device: torch.device) -> Callable[[int], Batch]:
        """Mock data without ``--data-path``; else megatron-core's GPTDataset (train split).

        Building the real dataset is collective under torch.distributed (rank 0 writes the
        index cache first), so every rank builds its source here, at the same point.
        """
        data: MockGPTData | GPTDataSource
        if getattr(args, "data_path", None) is None:
            data = MockGPTData(args.seq_length, args.vocab_size, args.seed)
        else:
            train, _, _ = build_gpt_datasets(args)
            data = GPTDataSource(train, keep_attention_mask=bool(getattr(args, "reset_attention_mask", False)))
        mbs, dp = args.micro_batch_size, args.data_parallel_size

        def get(microbatch: int) -> Batch:
            batch = data.micro_batch(microbatch_sample_indices(microbatch, mbs, dp_rank, dp))
            return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

        return get

    def loss_fn(self, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        return gpt_loss(output, batch)

    def activation_spec(self, args: argparse.Namespace) -> tuple[tuple[int, ...], torch.dtype]:
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        return (args.seq_length, args.micro_batch_size, args.hidden_size), dtype
