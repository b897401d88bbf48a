"""BERT pretraining on megatron-core's BertModel, split into pipeline stages.

Masked-LM loss over the masked tokens, plus the sentence-order loss unless
``--bert-no-binary-head``; data from megatron-core's ``BERTMaskedWordPieceDataset`` with
``--data-path``, else deterministic mock masked-LM data.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.job_config import JobConfig, TaskOptions
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.data.bert_dataset import BertDataSource, build_bert_datasets, check_bert_data
from megatron.trainer.data.gpt_dataset import DataError
from megatron.trainer.data.mock_bert import FIRST_WORD, MIN_SEQ_LENGTH, MockBertData
from megatron.trainer.models.bert import BertModelArgs, BertOutput, bert_loss, build_bert_stage, sentence_order_loss
from megatron.trainer.tasks.stage_tasks import (
    build_chunks,
    global_named_parameters,
    hidden_activation_spec,
    micro_batch_fn,
    transformer_kwargs,
)
from megatron.trainer.tasks.task import Batch, PartBuilder, PretrainTask, pick_split, split_seed
from megatron.trainer.tokenizer import TokenizerError, tokenizer_from_args
from megatron.trainer.tokenizer.vocabulary import vocabulary

BERT_SPECIAL_TOKENS = ("cls", "sep", "mask", "pad")


@dataclass(frozen=True)
class BertOptions(TaskOptions):
    """BERT's own flags (``config.task``)."""

    model_family: ClassVar[str] = "bert"
    bert_binary_head: bool
    mask_prob: float
    short_seq_prob: float


def bert_model_args(config: RunPlan) -> BertModelArgs:
    return BertModelArgs(**transformer_kwargs(config), add_binary_head=config.task.bert_binary_head)


def check_bert_args(config: JobConfig) -> None:
    """BERT's flag checks, run with the common ones before any rank starts: masking
    probabilities, a tokenizer with BERT's special tokens, and data that yields samples."""
    if not 0.0 < config.task.mask_prob < 1.0:
        raise ConfigError(f"--mask-prob must be in (0, 1), got {config.task.mask_prob}")
    if not 0.0 <= config.task.short_seq_prob <= 1.0:
        raise ConfigError(f"--short-seq-prob must be in [0, 1], got {config.task.short_seq_prob}")
    if config.parallel.sequence_parallel:
        raise ConfigError("--sequence-parallel is implemented for GPT only (BERT's final norm, pooler and heads "
                          "would need the sequence-shard handling GPT's have here)")
    if config.model.seq_length < MIN_SEQ_LENGTH:
        raise ConfigError(f"BERT needs --seq-length >= {MIN_SEQ_LENGTH} ([CLS] A [SEP] B [SEP])")
    if config.data.data_path is None:
        if vocabulary(config).size < FIRST_WORD + 4:
            raise ConfigError(f"BERT mock data needs --vocab-size >= {FIRST_WORD + 4}")
        return
    tokenizer = tokenizer_from_args(config)
    try:
        ids = {kind: getattr(tokenizer, kind) for kind in BERT_SPECIAL_TOKENS}
    except (NotImplementedError, TokenizerError) as exc:
        raise ConfigError(
            f"--tokenizer-type {config.data.tokenizer_type}: BERT needs [CLS], [SEP], [MASK] and [PAD] "
            f"tokens ({exc})") from None
    if ids["pad"] == 1:
        # megatron-core's BERT dataset writes the pad id into its 0/1 padding mask.
        raise ConfigError(f"--tokenizer-type {config.data.tokenizer_type}: the [PAD] id must not be 1")
    try:
        usable = check_bert_data(config)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    if config.training.eval_interval and not usable[1]:
        what = "two or more sentences" if config.task.bert_binary_head else "a sentence"
        raise ConfigError(f"--eval-interval: no document of the validation split of --split {config.data.split} has "
                          f"{what}; give the validation split a larger share or drop --eval-interval")


class BertTask(PretrainTask):
    name = "bert"

    def part_builder(self) -> PartBuilder:
        return bert_model_args, build_bert_stage

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("BERT")
        g.add_argument("--bert-no-binary-head", dest="bert_binary_head", action="store_false",
                       help="no sentence-order head (and no token types): masked LM only")
        g.add_argument("--mask-prob", type=float, default=0.15, help="share of tokens masked")
        g.add_argument("--short-seq-prob", type=float, default=0.1,
                       help="share of real-data samples cut shorter than --seq-length")
        parser.set_defaults(task_checks=(check_bert_args,), task_options=BertOptions)

    def build_stage(self, config: RunPlan, stage: int, device: torch.device) -> list[torch.nn.Module]:
        """The stage's model chunks; initial weights depend only on global names."""
        model_args = bert_model_args(config)
        return build_chunks(config, stage, lambda layers, first, last: build_bert_stage(
            model_args, layers, pre_process=first, post_process=last, seed=config.training.seed, device=device))

    def named_parameters(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return global_named_parameters(chunks)

    def batch_fn(self, config: RunPlan, dp_rank: int, device: torch.device,
                 split: str = "train") -> Callable[[int], Batch]:
        """Mock masked-LM data without ``--data-path``; else megatron-core's BERT dataset
        (train split), built collectively on every rank like GPT's."""
        model, task = config.model, config.task
        data: MockBertData | BertDataSource
        if config.data.data_path is None:
            data = MockBertData(model.seq_length, config.vocab.size, split_seed(config.training.seed, split),
                                binary_head=task.bert_binary_head, mask_prob=task.mask_prob)
        else:
            dataset = pick_split(build_bert_datasets(config), split, config)
            data = BertDataSource(dataset, binary_head=task.bert_binary_head)
        return micro_batch_fn(data, config, dp_rank, device)

    def loss_fn(self, output: BertOutput, batch: Batch) -> tuple[torch.Tensor, int]:
        return bert_loss(output, batch)

    # The sentence-order part of the loss, logged on its own (text, --log-json, TensorBoard).
    aux_loss_name = "sop loss"

    def aux_loss_fn(self, output: BertOutput, batch: Batch) -> torch.Tensor | None:
        return sentence_order_loss(output, batch)

    def activation_spec(self, config: RunPlan) -> tuple[tuple[int, ...], torch.dtype]:
        return hidden_activation_spec(config)
