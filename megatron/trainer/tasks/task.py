"""The seam between the generic trainer and a model family (GPT, BERT, synthetic)."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from megatron.trainer.config.run_plan import RunPlan

Batch = dict[str, torch.Tensor]


#: One part of a model built for profiling: (config -> model arguments, stage builder taking
#: ``(model_args, layers, pre_process=, post_process=, seed=, device=)``).
PartBuilder = tuple[Callable[[RunPlan], object], Callable[..., torch.nn.Module]]


class PretrainTask(Protocol):
    """What ``pretrain_gpt.py`` / ``pretrain_bert.py`` plug into :func:`training.pretrain`.

    Every member the trainer reads is declared here, the optional ones with their default, so
    a task states what it does instead of the trainer probing it (a task subclasses this
    protocol to inherit the defaults)."""

    name: str
    #: whether the task's modules are megatron-core's, so the trainer must initialise its
    #: parallel state (the synthetic-cost benchmark's are not, and skips seconds of start-up)
    uses_megatron_core: bool = True
    #: the log's name of a second loss reported beside the LM loss (BERT: "sop loss"); None:
    #: the task has none and :meth:`aux_loss_fn` is never called
    aux_loss_name: str | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Model-family flags beyond the common ones (none by default)."""
        return None

    def aux_loss_fn(self, output: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """Last stage's output -> the micro-batch's auxiliary loss (logged only; see
        :attr:`aux_loss_name`)."""
        return None

    def part_builder(self) -> PartBuilder | None:
        """How ``--pipeline-partition profiled`` builds one layer, the embedding and the head of
        this model to time them; None: the task's model cannot be profiled by parts."""
        return None

    def build_stage(self, config: RunPlan, stage: int, device: torch.device) -> list[torch.nn.Module]:
        """The model chunks of one stage, chunk c being virtual stage c * PP + stage."""

    def named_parameters(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters by name in the unsplit model (checkpoints, comparisons)."""

    def batch_fn(self, config: RunPlan, dp_rank: int, device: torch.device,
                 split: str = "train") -> Callable[[int], Batch]:
        """Global micro-batch index -> this data-parallel replica's micro-batch of ``split``
        ("train", "valid" or "test")."""

    def loss_fn(self, output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        """Last stage's output -> (mean loss of the micro-batch, tokens counted)."""

    def activation_spec(self, config: RunPlan) -> tuple[tuple[int, ...], torch.dtype]:
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


def pick_split(datasets: tuple[object | None, object | None, object | None], split: str, config: RunPlan) -> object:
    """The dataset of ``split`` from megatron-core's (train, valid, test); one-line error if empty."""
    data = config.data
    dataset = datasets[SPLITS.index(split)]
    if dataset is None:
        raise ValueError(f"--split {data.split} leaves no {split} data in --data-path {' '.join(data.data_path)}")
    return dataset
