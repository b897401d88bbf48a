"""GPT pretraining on megatron-core's GPTModel, split into pipeline stages."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.data.gpt_dataset import GPTDataSource, build_gpt_datasets
from megatron.trainer.data.mock import MockGPTData
from megatron.trainer.models.gpt import GPTModelArgs, build_gpt_stage, gpt_loss
from megatron.trainer.tasks.stage_tasks import (
    build_chunks,
    global_named_parameters,
    hidden_activation_spec,
    micro_batch_fn,
    transformer_kwargs,
)
from megatron.trainer.tasks.task import Batch, PartBuilder, PretrainTask, pick_split, split_seed


def gpt_model_args(config: RunPlan) -> GPTModelArgs:
    return GPTModelArgs(**transformer_kwargs(config))


class GPTTask(PretrainTask):
    name = "gpt"

    def part_builder(self) -> PartBuilder:
        return gpt_model_args, build_gpt_stage

    def build_stage(self, config: RunPlan, stage: int, device: torch.device) -> list[torch.nn.Module]:
        """The stage's model chunks (see :func:`build_chunks`). Initial weights depend only on
        global names, so any split starts identically."""
        model_args = gpt_model_args(config)
        # With --reset-attention-mask every layer applies the batch's mask, middle stages too.
        middle_keys = ("attention_mask",) if config.data.reset_attention_mask else ()

        def build(layers: range, first: bool, last: bool) -> torch.nn.Module:
            chunk = build_gpt_stage(model_args, layers, pre_process=first, post_process=last,
                                    seed=config.training.seed, device=device)
            chunk.middle_batch_keys = middle_keys
            return chunk

        return build_chunks(config, stage, build)

    def named_parameters(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return global_named_parameters(chunks)

    def batch_fn(self, config: RunPlan, dp_rank: int, device: torch.device,
                 split: str = "train") -> Callable[[int], Batch]:
        """Mock data without ``--data-path``; else megatron-core's GPTDataset (train split).

        Building the real dataset is collective under torch.distributed (rank 0 writes the
        index cache first), so every rank builds its source here, at the same point.
        """
        model = config.model
        data: MockGPTData | GPTDataSource
        if config.data.data_path is None:
            data = MockGPTData(model.seq_length, config.vocab.size, split_seed(config.training.seed, split))
        else:
            dataset = pick_split(build_gpt_datasets(config), split, config)
            data = GPTDataSource(dataset, keep_attention_mask=bool(config.data.reset_attention_mask))
        return micro_batch_fn(data, config, dp_rank, device)

    def loss_fn(self, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        return gpt_loss(output, batch)

    def activation_spec(self, config: RunPlan) -> tuple[tuple[int, ...], torch.dtype]:
        return hidden_activation_spec(config)
