"""Data files, tokenizer files and the model's vocabulary, checked before any rank starts.

The flags are the config's (:mod:`megatron.trainer.config.arguments`); reading the files takes
the tokenizer and dataset packages, so the check is planned here, above them.
"""
from __future__ import annotations

import argparse
import os

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.job_config import build_job_config


def check_data(args: argparse.Namespace) -> None:
    """Data files, tokenizer files and the vocabulary, checked before any rank starts (the
    model's vocabulary itself is the run plan's: :func:`~megatron.trainer.tokenizer.vocabulary.vocabulary`)."""
    if args.data_path is not None and args.mock_data:
        raise ConfigError("--mock-data and --data-path are mutually exclusive")
    if args.data_path is not None and args.tokenizer_type is None:
        raise ConfigError("--data-path needs --tokenizer-type (and its --vocab-file/--merge-file/--tokenizer-model)")
    if args.make_vocab_size_divisible_by < 1:
        raise ConfigError("--make-vocab-size-divisible-by must be >= 1")
    if args.tokenizer_type is None:
        return
    # Imported here: a run on mock data (the default) never loads a tokenizer or dataset module.
    from megatron.trainer.data.gpt_dataset import (
        DataError, check_data as check_dataset_files, check_token_ids, parse_data_path, parse_split, usable_splits)
    from megatron.trainer.tokenizer import TokenizerError
    from megatron.trainer.tokenizer.vocabulary import vocabulary

    try:
        infos = []
        if args.data_path is not None:
            infos = check_dataset_files(parse_data_path(args.data_path)[0], parse_split(args.split), args.seq_length)
        tokenizer_size = vocabulary(build_job_config(args)).tokenizer_size
        assert tokenizer_size is not None  # a tokenizer was given
        check_token_ids(infos, tokenizer_size)
        if infos and args.eval_interval and not usable_splits(infos, args.seq_length)[1]:
            raise DataError(f"--eval-interval: --split {args.split} leaves no validation sample of "
                            f"{args.seq_length} tokens in --data-path {infos[0].prefix}; give the validation "
                            f"split a share or drop --eval-interval")
    except (DataError, TokenizerError) as exc:
        raise ConfigError(str(exc)) from None
    if args.data_cache_path is not None:
        try:
            os.makedirs(args.data_cache_path, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--data-cache-path {args.data_cache_path}: {exc.strerror}") from None
        if not os.access(args.data_cache_path, os.W_OK):
            raise ConfigError(f"--data-cache-path {args.data_cache_path}: not writable")
