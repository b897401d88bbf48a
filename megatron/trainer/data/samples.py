"""Micro-batches as stacks of samples addressed by global index.

Every data source here is a pure function ``index -> sample``; building micro-batches from it
is the same for all of them (GPT or BERT, mock or real), so it lives in one mixin.
"""
from __future__ import annotations

from collections.abc import Sequence

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
