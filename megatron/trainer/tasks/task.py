"""The seam between the generic trainer and a model family (GPT, BERT, synthetic)."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from megatron.trainer.config.job_config import JobConfig

Batch = dict[str, torch.Tensor]


class PretrainTask(Protocol):
    """What ``pretrain_gpt.py`` / ``pretrain_bert.py`` plug into :func:`training.pretrain`."""

    name: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Model-family flags beyond the common ones (may do nothing)."""

    def build_stage(self, config: JobConfig, stage: int, device: torch.device) -> list[torch.nn.Module]:
        """The model chunks of one stage, chunk c being virtual stage c * PP + stage."""

    def named_parameters(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters by name in the unsplit model (checkpoints, comparisons)."""

    def batch_fn(self, config: JobConfig, dp_rank: int, device: torch.device,
                 split: str = "train") -> Callable[[int], Batch]:
        """Global micro-batch index -> this data-parallel replica's micro-batch of ``split``
        ("train", "valid" or "test")."""

    def loss_fn(self, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        """Last stage's output -> (mean loss of the micro-batch, tokens counted)."""

    def activation_spec(self, config: JobConfig) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of tensors crossing stage boundaries."""


def microbatch_sample_indices(microbatch: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[int]:
    """Megatron's pretraining sampler: consecutive samples, each micro-batch split over DP ranks."""
    base = (microbatch * dp_size + dp_rank) * micro_batch_size
    return list(range(base, base + micro_batch_size))


SPLITS = ("train", "valid", "test")


def split_seed(seed: int, split: str) -> int:
    """Seed of a split's synthetic data: the training data keeps ``seed``; validation and
    test data are other streams, so evaluation never scores samples the model trained on."""
    return seed + 1_000_003 * SPLITS.index(split)


def pick_split(datasets: tuple[object | None, object | None, object | None], split: str, config: JobConfig) -> object:
    """The dataset of ``split`` from megatron-core's (train, valid, test); one-line error if empty."""
    data = config.data
    dataset = datasets[SPLITS.index(split)]
    if dataset is None:
        raise ValueError(f"--split {data.split} leaves no {split} data in --data-path {' '.join(data.data_path)}")
    return dataset
