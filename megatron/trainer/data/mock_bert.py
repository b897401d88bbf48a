"""Deterministic synthetic masked-LM data for BERT, with structure a tiny model can learn.

The words of a sample are one of :class:`MockGPTData`'s arithmetic progressions (shifted past
the special ids), so a masked word is predictable from its neighbours. Each sample then looks
like a BERT sample: ``[CLS] A [SEP] B [SEP]`` with A and B swapped half of the time (the
sentence-order label; a swap breaks the progression, so it is learnable too), a random length
with padding after it, and ~``mask_prob`` of the words replaced by ``[MASK]``.

Every sample is a pure function of ``(seed, index)``, like the GPT mock data, so any stage and
any data-parallel rank can build any micro-batch on its own.
"""
from __future__ import annotations

import torch

from megatron.trainer.data.mock import MockGPTData, _sample_seed
from megatron.trainer.data.samples import StackedSamples

PAD, CLS, SEP, MASK = 0, 1, 2, 3
FIRST_WORD = 4  # ids below are special tokens
MIN_SEQ_LENGTH = 8  # [CLS] A [SEP] B [SEP] with room for some padding


class MockBertData(StackedSamples):
    """Synthetic BERT samples: ``tokens``, ``labels``, ``loss_mask``, ``padding_mask``
    (1 = real token), ``tokentype_ids`` and, with the binary head, ``sentence_order``."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int, binary_head: bool = True,
                 mask_prob: float = 0.15) -> None:
        if seq_length < MIN_SEQ_LENGTH or vocab_size < FIRST_WORD + 4:
            raise ValueError(f"mock BERT data needs seq_length >= {MIN_SEQ_LENGTH} and vocab_size >= "
                             f"{FIRST_WORD + 4}, got {seq_length}, {vocab_size}")
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
        self.seq_length = seq_length
        self.seed = seed
        self.binary_head = binary_head
        self.mask_prob = mask_prob
        self._words = MockGPTData(seq_length - 3, vocab_size - FIRST_WORD, seed)

    def _pieces(self, words: torch.Tensor, generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
        """``[CLS] A [SEP] (B [SEP])`` pieces and whether A and B were swapped."""
        special = lambda t: torch.tensor([t])  # noqa: E731
        if not self.binary_head:
            return [special(CLS), words, special(SEP)], 0
        pivot = int(torch.randint(1, len(words), (), generator=generator))
        first, second = words[:pivot], words[pivot:]
        swapped = int(torch.rand((), generator=generator) < 0.5)
        if swapped:
            first, second = second, first
        return [special(CLS), first, special(SEP), second, special(SEP)], swapped

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """One sample, every entry ``[s]`` except the scalar ``sentence_order``."""
        generator = torch.Generator(device="cpu").manual_seed(_sample_seed(self.seed, index, "bert"))
        words = self._words.sample(index)["tokens"] + FIRST_WORD
        content = int(torch.randint(max(2, len(words) // 2), len(words) + 1, (), generator=generator))
        pieces, swapped = self._pieces(words[:content], generator)
        real = torch.cat(pieces)
        types = torch.cat([torch.full((len(p),), int(i >= 3)) for i, p in enumerate(pieces)])
        s, n = self.seq_length, len(real)

        positions = (real >= FIRST_WORD).nonzero().flatten()
        count = max(1, round(self.mask_prob * len(positions)))
        masked = positions[torch.randperm(len(positions), generator=generator)[:count]]
        tokens = torch.full((s,), PAD, dtype=torch.int64)
        tokens[:n] = real
        labels = torch.zeros(s, dtype=torch.int64)
        labels[masked] = tokens[masked]
        loss_mask = torch.zeros(s, dtype=torch.float32)
        loss_mask[masked] = 1.0
        tokens[masked] = MASK
        out = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "padding_mask": (torch.arange(s) < n).to(torch.int64),
            "tokentype_ids": torch.cat([types, torch.zeros(s - n, dtype=torch.int64)]),
        }
        if self.binary_head:
            out["sentence_order"] = torch.tensor(swapped, dtype=torch.int64)
        return out
