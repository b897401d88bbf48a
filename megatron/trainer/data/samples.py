"""Micro-batches as stacks of samples addressed by global index.

Every data source here is a pure function ``index -> sample``; building micro-batches from it
is the same for all of them (GPT or BERT, mock or real), so it lives in one mixin.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class StackedSamples:
    """Mixin: ``micro_batch`` stacks ``self.sample(i)`` for each index to ``[b, ...]``."""

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def micro_batch(self, sample_indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Samples stacked along a new leading batch dimension, in the order requested."""
        if len(sample_indices) == 0:
            raise ValueError("a micro-batch needs at least one sample index")
        samples = [self.sample(int(i)) for i in sample_indices]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class IndexedSamples(StackedSamples):
    """A megatron-core dataset as a sample source: bounds-checked ``raw(index)`` for subclasses
    that turn its sample dict into the keys their stages read."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def raw(self, index: int) -> Any:
        if not 0 <= index < len(self.dataset):
            raise IndexError(f"sample {index} outside the dataset's {len(self.dataset)} samples")
        return self.dataset[index]
