"""Real BERT training data: megatron-core's ``BERTMaskedWordPieceDataset`` on indexed datasets
written by ``tools/preprocess_data.py`` (ideally with ``--split-sentences``: a BERT sample is
a run of sentences, and the sentence-order head needs two per document).

Flag parsing, file checks, the split handling and distributed building are GPT's
(:mod:`.gpt_dataset`); this module adds the masked-LM configuration, the BERT-specific
usability check and the sample -> micro-batch conversion.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy
import torch

from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.data.gpt_dataset import (
    DataError,
    build_usable_splits,
    common_config_kwargs,
    default_split_sizes,
    parse_data_path,
    parse_split,
    split_ranges,
)
from megatron.trainer.data.samples import IndexedSamples

# megatron-core's build_mapping skips documents holding a sentence longer than this.
LONG_SENTENCE_LEN = 512


def min_sentences(binary_head: bool) -> int:
    """Sentences a document needs to yield BERT samples (a sample's two spans A and B need two)."""
    return 2 if binary_head else 1


def usable_bert_splits(prefixes: Sequence[str], split_matrix: Any, binary_head: bool) -> list[bool]:
    """Which splits have, in every prefix, a document that megatron-core can sample from.

    Masked datasets split by documents; a split none of whose documents has enough sentences
    (of at most 512 tokens) makes megatron-core's sampler loop over epochs without end, so such
    splits are skipped (valid/test) or refused (train) instead.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    need = min_sentences(binary_head)
    usable = [True, True, True]
    for prefix in prefixes:
        dataset = IndexedDataset(prefix, multimodal=False, mmap=True)
        docs = numpy.asarray(dataset.document_indices)
        lengths = numpy.asarray(dataset.sequence_lengths)
        long = numpy.zeros(len(docs) - 1, dtype=bool)
        np_long = numpy.flatnonzero(lengths > LONG_SENTENCE_LEN)
        long[numpy.searchsorted(docs, np_long, side="right") - 1] = True
        ok = (numpy.diff(docs) >= need) & ~long
        for i, bounds in enumerate(split_ranges(len(docs) - 1, split_matrix)):
            if bounds is None or not ok[bounds[0]:bounds[1]].any():
                usable[i] = False
        del dataset, docs, lengths
    return usable


def check_bert_data(config: RunPlan) -> list[bool]:
    """One-line :class:`DataError` unless the training split can yield BERT samples."""
    prefixes, _ = parse_data_path(config.data.data_path)
    usable = usable_bert_splits(prefixes, parse_split(config.data.split), config.task.bert_binary_head)
    if not usable[0]:
        what = "two or more sentences" if config.task.bert_binary_head else "a sentence"
        raise DataError(
            f"--data-path: no document of the training split has {what} of at most "
            f"{LONG_SENTENCE_LEN} tokens (preprocess with --split-sentences"
            f"{', or pass --bert-no-binary-head' if config.task.bert_binary_head else ''})")
    return usable


def bert_dataset_config(config: RunPlan, tokenizer: Any) -> Any:
    """Megatron-LM's BERT masking: whole words, n-grams up to 3, no permutation."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig

    return BERTMaskedWordPieceDatasetConfig(
        **common_config_kwargs(config, tokenizer),
        masking_probability=config.task.mask_prob,
        short_sequence_probability=config.task.short_seq_prob,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=config.task.bert_binary_head,
    )


_BUILT: dict[tuple, tuple[Any, Any, Any]] = {}


def build_bert_datasets(
    config: RunPlan, tokenizer: Any = None, sizes: Sequence[int] | None = None
) -> tuple[Any, Any, Any]:
    """(train, valid, test) BERT datasets, valid/test None when unusable. Collective under
    ``torch.distributed`` (call on every rank); built once per process per configuration."""
    data, task = config.data, config.task
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset

    if tokenizer is None:
        from megatron.trainer.tokenizer import tokenizer_from_args

        tokenizer = tokenizer_from_args(config)
    sizes = list(sizes) if sizes is not None else default_split_sizes(config)
    key = (tuple(data.data_path), data.split, config.model.seq_length, config.training.seed, tuple(sizes),
           data.data_cache_path, task.mask_prob, task.short_seq_prob,
           task.bert_binary_head, repr(dict(tokenizer.unique_identifiers)))
    if key not in _BUILT:
        usable = check_bert_data(config)
        _BUILT[key] = build_usable_splits(
            BERTMaskedWordPieceDataset, bert_dataset_config(config, tokenizer), sizes, usable)
    return _BUILT[key]


class BertDataSource(IndexedSamples):
    """Micro-batches from a megatron-core BERT dataset, in the keys the BERT stages read."""

    def __init__(self, dataset: Any, binary_head: bool) -> None:
        super().__init__(dataset)
        self.binary_head = binary_head

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        raw = self.raw(index)
        # megatron-core writes the pad id (0, or -1 when it collides) where padding_mask
        # pads and into the labels/types of unmasked and padded positions; normalise to
        # 1 = real token and in-range ids (the loss mask already excludes those positions).
        real = torch.as_tensor(raw["padding_mask"]) == 1
        out = {
            "tokens": torch.as_tensor(raw["text"], dtype=torch.int64),
            "labels": torch.as_tensor(raw["labels"], dtype=torch.int64).clamp(min=0),
            "loss_mask": torch.as_tensor(raw["loss_mask"], dtype=torch.float32),
            "padding_mask": real.to(torch.int64),
            "tokentype_ids": torch.as_tensor(raw["types"], dtype=torch.int64).clamp(min=0) * real,
        }
        if self.binary_head:
            out["sentence_order"] = torch.tensor(int(raw["is_random"]), dtype=torch.int64)
        return out
