"""The tokenizer a run asks for, by Megatron's ``--tokenizer-type`` name.

Apart from the tokenizer classes so both families (:mod:`.tokenizer`'s own, :mod:`.core_backed`'s
megatron-core ones) can be chosen here without importing each other.
"""
from __future__ import annotations

import os
from typing import Any

from megatron.trainer.config.job_config import JobConfig
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.tokenizer.core_backed import core_tokenizer
from megatron.trainer.config.choices import TOKENIZER_TYPES
from megatron.trainer.tokenizer.tokenizer import (
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    Tokenizer,
    TokenizerError,
    _require_file,
)


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """The tokenizer named by Megatron's ``--tokenizer-type``; :class:`TokenizerError` if not loadable."""
    if tokenizer_type == "GPT2BPETokenizer":
        if not merge_file:
            raise TokenizerError("--tokenizer-type GPT2BPETokenizer needs --merge-file")
        return GPT2BPETokenizer(_require_file(vocab_file, "--vocab-file", tokenizer_type), merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_require_file(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(vocab_file, lower_case=tokenizer_type == "BertWordPieceLowerCase")
    if tokenizer_type in ("NullTokenizer", "SentencePieceTokenizer", "TikTokenizer"):
        return core_tokenizer(tokenizer_type, tokenizer_model, vocab_size)
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")


def tokenizer_from_args(config: JobConfig) -> Tokenizer:
    """:func:`build_tokenizer` from Megatron's flag names on a job config (``NullTokenizer``:
    ``--vocab-size`` ids)."""
    return build_tokenizer(
        config.data.tokenizer_type,
        vocab_file=config.data.vocab_file,
        merge_file=config.data.merge_file,
        tokenizer_model=config.data.tokenizer_model,
        vocab_size=config.model.vocab_size,
    )


# The flags that choose a run's tokenizer, as recorded in a checkpoint (file paths absolute).
TOKENIZER_FLAGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "null_vocab_size")


def tokenizer_record(config: RunPlan) -> dict[str, Any] | None:
    """The run's tokenizer flags for its checkpoints (None: no tokenizer, mock data), so tools
    that use a checkpoint outside its run (export, generation) find the same tokenizer. Paths
    are made absolute: the tools rarely run from the training run's directory."""
    data = config.data
    if data.tokenizer_type is None:
        return None
    record = {"tokenizer_type": data.tokenizer_type, "vocab_file": data.vocab_file, "merge_file": data.merge_file,
              "tokenizer_model": data.tokenizer_model, "null_vocab_size": config.vocab.null_size}
    for flag in ("vocab_file", "merge_file", "tokenizer_model"):
        if record[flag]:
            record[flag] = os.path.abspath(record[flag])
    return record


def tokenizer_from_record(record: dict[str, Any]) -> Tokenizer:
    """The tokenizer a :func:`tokenizer_record` names; :class:`TokenizerError` if its files are gone."""
    return build_tokenizer(record["tokenizer_type"], vocab_file=record.get("vocab_file"),
                           merge_file=record.get("merge_file"), tokenizer_model=record.get("tokenizer_model"),
                           vocab_size=record.get("null_vocab_size"))
