"""Real GPT training data: megatron-core's ``GPTDataset`` (and ``BlendedDataset``) on indexed
``.bin``/``.idx`` files written by ``tools/preprocess_data.py``.

Three layers:

* checks that run in the launching process, before any rank exists
  (:func:`parse_data_path`, :func:`parse_split`, :func:`inspect_prefix`,
  :func:`check_data`), each failure a :class:`DataError` with one line naming the file;
* :func:`build_gpt_datasets`, the train/valid/test datasets through megatron-core's
  ``BlendedMegatronDatasetBuilder``;
* :class:`GPTDataSource`, samples by index -> our micro-batch dict.

Distributed building. The builder is collective when ``torch.distributed`` is initialised:
rank 0 builds each dataset (and writes the index cache), then all ranks meet in a barrier
on the default group, then the other ranks build (reading rank 0's cache). Every rank of
our world (PP x DP processes, each building its own data source) therefore calls
:func:`build_gpt_datasets` exactly once, at the same point of start-up, with the same
configuration, and ``is_built_on_rank`` is True everywhere: each stage needs random access
to the same sample order. Only rank 0 writes the cache, so there is no race on it. The
cache (``--data-cache-path``, default megatron-core's ``<prefix>/cache/GPTDataset_indices``)
must be visible to all ranks, i.e. on a shared file system for multi-node runs.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.data.index_check import IndexFileError, read_index_header
from megatron.trainer.data.samples import IndexedSamples
from megatron.trainer.config.flag_checks import parse_blend, parse_split_weights
from megatron.trainer.config.run_plan import RunPlan

SplitMatrix = Sequence["tuple[float, float] | None"]


class DataError(ValueError):
    """Unusable training data; the message is one line naming the file or flag."""


# --------------------------------------------------------------------------------------------
# Flag parsing and file checks (launching process)
# --------------------------------------------------------------------------------------------

def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: ``PREFIX [PREFIX ...]`` or ``W1 PREFIX1 W2 PREFIX2 ...``.

    Returns ``(prefixes, weights)``; ``weights`` is None without weights (then several
    prefixes are blended in proportion to their sizes). Parsed strictly
    (:func:`megatron.trainer.config.flag_checks.parse_blend`).
    """
    try:
        return parse_blend(data_path)
    except ConfigError as exc:
        raise DataError(str(exc)) from None


def parse_split(split: str) -> list[tuple[float, float] | None]:
    """Megatron's ``--split`` "train,valid,test" weights -> megatron-core's split matrix: per
    split the (begin, end) fraction of each dataset's sequences, or None for an empty share."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )

    try:
        weights = parse_split_weights(split)
    except ConfigError as exc:
        raise DataError(str(exc)) from None
    total = sum(weights)
    return convert_split_vector_to_split_matrix([w / total for w in weights])


def split_ranges(num_sequences: int, split_matrix: SplitMatrix) -> list[tuple[int, int] | None]:
    """The sequence index range of each split, rounded as megatron-core rounds it."""
    return [
        None if bounds is None else (int(round(bounds[0] * num_sequences)), int(round(bounds[1] * num_sequences)))
        for bounds in split_matrix
    ]


@dataclass
class PrefixInfo:
    prefix: str
    num_sequences: int
    num_documents: int
    dtype: Any  # token dtype of the .bin file
    split_tokens: list[int | None]  # tokens in each split (None where the split is absent)


def inspect_prefix(prefix: str, split_matrix: SplitMatrix) -> PrefixInfo:
    """Open one indexed dataset with megatron-core, check it against its .bin file, and count
    the tokens of each split."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

    idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"--data-path {prefix}: missing {path}")
    try:
        read_index_header(idx_path, bin_path)  # megatron-core only ever sees an index it can open
        dataset = IndexedDataset(prefix, multimodal=False, mmap=True)
    except IndexFileError as exc:
        raise DataError(str(exc)) from None
    except OSError as exc:  # unreadable, not malformed
        raise DataError(f"{exc.filename or idx_path}: {exc.strerror or exc}") from None
    except (AssertionError, ValueError, IndexError, struct.error, TypeError, KeyError) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise DataError(f"{idx_path}: corrupt or not a megatron-core index file ({detail})") from None
    lengths = pointers = None  # views into the index's mmap: dropped before the dataset below
    try:
        lengths = dataset.sequence_lengths
        dtype = dataset.index.dtype
        pointers = dataset.index.sequence_pointers
        num_documents = len(dataset.document_indices) - 1
        if lengths.size and (lengths.min() < 0 or pointers.min() < 0):
            raise DataError(f"{idx_path}: corrupt index (negative sequence length or offset)")
        expected = int(pointers[-1]) + int(lengths[-1]) * dataset.index.dtype_size if lengths.size else 0
        actual = os.path.getsize(bin_path)
        if actual < expected:
            raise DataError(f"{bin_path}: truncated ({actual} bytes, {idx_path} describes {expected})")
        split_tokens = [
            None if r is None else int(lengths[r[0]:r[1]].sum(dtype=numpy.int64))
            for r in split_ranges(int(lengths.size), split_matrix)
        ]
        num_sequences = int(lengths.size)
    finally:
        del lengths, pointers, dataset
    return PrefixInfo(prefix, num_sequences, num_documents, dtype, split_tokens)


def check_token_ids(infos: Sequence[PrefixInfo], vocab_size: int, max_tokens: int = 1 << 22) -> None:
    """The first ``max_tokens`` ids of every dataset are below the tokenizer's vocabulary: data
    preprocessed with another tokenizer fails here, not as an embedding index error on a rank."""
    for info in infos:
        bin_path = info.prefix + ".bin"
        if os.path.getsize(bin_path) == 0:
            continue
        tokens = numpy.memmap(bin_path, dtype=info.dtype, mode="r")
        try:
            head = tokens[:max_tokens]
            largest = int(head.max()) if head.size else 0
        finally:
            del tokens
        if largest >= vocab_size:
            raise DataError(
                f"{bin_path}: token id {largest} is outside the tokenizer's vocabulary of {vocab_size} "
                f"(preprocessed with another tokenizer?)")


def check_data(
    prefixes: Sequence[str], split_matrix: SplitMatrix, seq_length: int
) -> list[PrefixInfo]:
    """Every prefix readable, and its training split long enough for one sample."""
    infos = [inspect_prefix(p, split_matrix) for p in prefixes]
    for info in infos:
        train_tokens = info.split_tokens[0] or 0
        if train_tokens < seq_length + 1:
            raise DataError(
                f"--data-path {info.prefix}: its training split has {train_tokens} tokens "
                f"({info.num_documents} documents), fewer than --seq-length {seq_length} + 1")
    return infos


def usable_splits(infos: Sequence[PrefixInfo], seq_length: int) -> list[bool]:
    """Which splits have at least one sample's worth of tokens in every prefix.

    megatron-core loops forever on a split without tokens, so empty valid/test splits (a
    small corpus with ``--split 969,30,1``) are skipped instead.
    """
    usable = [True, True, True]
    for info in infos:
        for i, tokens in enumerate(info.split_tokens):
            if tokens is None or tokens < seq_length + 1:
                usable[i] = False
    return usable


# --------------------------------------------------------------------------------------------
# Building (every rank)
# --------------------------------------------------------------------------------------------

def default_split_sizes(config: RunPlan) -> list[int]:
    """Samples per split: the whole run for train; one global batch x ``--eval-iters`` (when a
    later evaluation feature defines it, else 1) for valid and test."""
    gbs = config.training.global_batch_size
    eval_iters = max(1, int(config.training.eval_iters or 1))
    return [config.training.train_iters * gbs, eval_iters * gbs, eval_iters * gbs]


def common_config_kwargs(config: RunPlan, tokenizer: Any) -> dict[str, Any]:
    """The ``BlendedMegatronDatasetConfig`` fields every dataset family takes from the flags."""
    prefixes, weights = parse_data_path(config.data.data_path)
    return dict(
        random_seed=config.training.seed,
        sequence_length=config.model.seq_length,
        blend=(prefixes, weights),
        split=config.data.split,
        path_to_cache=config.data.data_cache_path,
        tokenizer=tokenizer,
        mid_level_dataset_surplus=0.005,
    )


def gpt_dataset_config(config: RunPlan, tokenizer: Any) -> Any:
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        **common_config_kwargs(config, tokenizer),
        reset_position_ids=bool(config.data.reset_position_ids),
        reset_attention_mask=bool(config.data.reset_attention_mask),
        eod_mask_loss=bool(config.data.eod_mask_loss),
        # The full [s, s] mask is only needed when documents must not attend to each other;
        # otherwise our attention is causal by itself.
        create_attention_mask=bool(config.data.reset_attention_mask),
    )


_BUILT: dict[tuple, tuple[Any, Any, Any]] = {}


def build_gpt_datasets(
    config: RunPlan, tokenizer: Any = None, sizes: Sequence[int] | None = None
) -> tuple[Any, Any, Any]:
    """(train, valid, test) megatron-core datasets; valid/test are None when their split is
    empty (for some prefix). Collective when ``torch.distributed`` is initialised: call on
    every rank. Built once per process for the same arguments (the emulator builds all
    stages in one process)."""
    model, data = config.model, config.data
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if tokenizer is None:
        from megatron.trainer.tokenizer import tokenizer_from_args

        tokenizer = tokenizer_from_args(config)
    sizes = list(sizes) if sizes is not None else default_split_sizes(config)
    key = (tuple(data.data_path), data.split, model.seq_length, config.training.seed, tuple(sizes),
           data.data_cache_path, bool(data.reset_position_ids),
           bool(data.reset_attention_mask), bool(data.eod_mask_loss),
           repr(dict(tokenizer.unique_identifiers)))
    if key in _BUILT:
        return _BUILT[key]
    prefixes, _ = parse_data_path(data.data_path)
    infos = check_data(prefixes, parse_split(data.split), model.seq_length)
    usable = usable_splits(infos, model.seq_length)
    _BUILT[key] = build_usable_splits(GPTDataset, gpt_dataset_config(config, tokenizer), sizes, usable)
    return _BUILT[key]


def build_usable_splits(
    dataset_cls: Any, config: Any, sizes: Sequence[int], usable: Sequence[bool]
) -> tuple[Any, Any, Any]:
    """megatron-core's builder over the usable splits only (it loops forever on a split with
    no sample); the training split must hold ``sizes[0]`` samples."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    for i, ok in enumerate(usable):
        if not ok:
            config.split_matrix[i] = None  # megatron-core skips a None split
    builder = BlendedMegatronDatasetBuilder(dataset_cls, list(sizes), lambda: True, config)
    train, valid, test = builder.build()
    if train is None or len(train) < sizes[0]:
        have = 0 if train is None else len(train)
        raise DataError(f"--data-path: built {have} training samples, need {sizes[0]}")
    return train, valid, test


# --------------------------------------------------------------------------------------------
# Samples -> micro-batches
# --------------------------------------------------------------------------------------------

class GPTDataSource(IndexedSamples):
    """Micro-batches from a megatron-core GPT dataset, by sample index (a pure function)."""

    def __init__(self, dataset: Any, keep_attention_mask: bool = False) -> None:
        super().__init__(dataset)
        self.keep_attention_mask = keep_attention_mask

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        raw = self.raw(index)
        out = {
            "tokens": raw["tokens"].to(torch.int64),
            "labels": raw["labels"].to(torch.int64),
            "loss_mask": raw["loss_mask"].to(torch.float32),
            "position_ids": raw["position_ids"].to(torch.int64),
        }
        if self.keep_attention_mask and raw.get("attention_mask") is not None:
            out["attention_mask"] = raw["attention_mask"]  # [1, s, s] bool, True = masked out
        return out
