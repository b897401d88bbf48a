"""The model's vocabulary, derived from the flags and the tokenizer's files.

With ``--tokenizer-type`` the embedding has the tokenizer's ids padded like Megatron-LM (to a
multiple of ``--make-vocab-size-divisible-by`` x TP); without one, ``--vocab-size`` rows. The
flag checks (tensor-parallel divisibility, the balanced split's costs) and the run plan both
need the padded size, before and after the plan exists, so it is a function of the config; the
tokenizer's size is read once per set of files (a tokenizer can take a second to load).
"""
from __future__ import annotations

import functools

from megatron.trainer.config.job_config import JobConfig
from megatron.trainer.config.run_plan import Vocabulary
from megatron.trainer.tokenizer.factory import build_tokenizer
from megatron.trainer.tokenizer.tokenizer import vocab_size_with_padding


@functools.lru_cache(maxsize=16)
def _tokenizer_size(tokenizer_type: str, vocab_file: str | None, merge_file: str | None,
                    tokenizer_model: str | None, null_size: int | None) -> int:
    return build_tokenizer(tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                           tokenizer_model=tokenizer_model, vocab_size=null_size).vocab_size


def vocabulary(config: JobConfig) -> Vocabulary:
    """The vocabulary of ``config``'s model; raises
    :class:`~megatron.trainer.tokenizer.tokenizer.TokenizerError` where the tokenizer cannot load."""
    model, data = config.model, config.data
    if data.tokenizer_type is None:
        return Vocabulary(model.vocab_size, None, None)
    null_size = model.vocab_size if data.tokenizer_type == "NullTokenizer" else None
    size = _tokenizer_size(data.tokenizer_type, data.vocab_file, data.merge_file, data.tokenizer_model,
                           model.vocab_size)
    padded = vocab_size_with_padding(size, model.make_vocab_size_divisible_by,
                                     config.parallel.tensor_model_parallel_size)
    return Vocabulary(padded, size, null_size)
