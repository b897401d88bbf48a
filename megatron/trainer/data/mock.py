"""Deterministic synthetic GPT data with structure a tiny transformer can learn.

Uniformly random tokens would give a flat loss at ``ln(vocab)`` and prove nothing about
training. Each sample here is an arithmetic progression modulo the vocabulary,
``x_i = (start + step * i) mod V``, with a random start and a step drawn from a small set.
Two levels of structure make progress visible quickly: a bigram model alone drops the loss
from ``ln(V)`` to ``ln(len(steps))`` (the next token is one of a few offsets of the current
one), and attending to the previous token (to read off the step) drives it towards zero.

Every sample is a pure function of ``(seed, index)``, so any process (any pipeline stage,
any data-parallel rank) can build any micro-batch independently and identically.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from megatron.trainer.data.samples import StackedSamples

DEFAULT_STEPS: tuple[int, ...] = (1, 2, 3, 5, 7)


def _sample_seed(seed: int, index: int, family: str = "gpt") -> int:
    """Stable per-sample seed; hashing avoids correlated streams for neighbouring indices."""
    digest = hashlib.sha256(f"mock-{family}:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class MockGPTData(StackedSamples):
    """Deterministic synthetic token sequences with learnable structure, so loss visibly
    falls (random tokens would not)."""

    def __init__(
        self, seq_length: int, vocab_size: int, seed: int, steps: Sequence[int] = DEFAULT_STEPS
    ) -> None:
        if seq_length < 1 or vocab_size < 2:
            raise ValueError(
                f"need seq_length >= 1 and vocab_size >= 2, got {seq_length}, {vocab_size}"
            )
        if not steps:
            raise ValueError("steps must not be empty")
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.steps = torch.tensor(list(steps), dtype=torch.int64)

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """One sample: ``tokens``, ``labels`` (tokens shifted by one), ``loss_mask``,
        ``position_ids``, each of shape ``[s]``."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        generator = torch.Generator(device="cpu").manual_seed(_sample_seed(self.seed, index))
        start = torch.randint(self.vocab_size, (), generator=generator)
        step = self.steps[torch.randint(len(self.steps), (), generator=generator)]
        # s + 1 tokens: inputs are the first s, labels the last s.
        sequence = (start + step * torch.arange(self.seq_length + 1)) % self.vocab_size
        return {
            "tokens": sequence[:-1].clone(),
            "labels": sequence[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }
