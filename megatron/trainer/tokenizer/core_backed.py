"""Tokenizers served by megatron-core's own ``megatron.core.tokenizers``.

megatron-core 0.16.1 ships a tokenizer layer (``MegatronTokenizer.from_pretrained`` with a
``library``: sentencepiece, huggingface, megatron, tiktoken, byte-level, null). Where it serves
without extra downloads, the trainer uses it through :class:`CoreTokenizer`, which adds only
what the rest of this project relies on: one-line :class:`TokenizerError` messages naming the
flag and file, and the ``unique_identifiers`` of megatron-core's dataset cache key.

* ``NullTokenizer``: megatron-core's ``null`` library (ids are the text), plus a range check
  so an id beyond ``--vocab-size`` fails at preprocessing instead of in an embedding lookup.
* ``SentencePieceTokenizer``: the ``sentencepiece`` library on ``--tokenizer-model``.
* ``TikTokenizer``: the ``tiktoken`` library on ``--tokenizer-model`` (megatron-core's JSON
  vocabulary format).

GPT-2 BPE, BERT WordPiece and Hugging Face JSON stay in :mod:`.tokenizer`: megatron-core's
versions go through ``transformers.AutoTokenizer`` (not a dependency here) and, for the
``megatron`` library, resolve ``gpt2``/``bert-large-uncased`` on the Hugging Face hub at run
time, which an offline machine cannot do.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from megatron.trainer.tokenizer.tokenizer import Tokenizer, TokenizerError, _one_line, _require_file

# --tokenizer-type -> (megatron-core library, the Python package it needs or None)
CORE_TOKENIZERS = {
    "NullTokenizer": ("null", None),
    "SentencePieceTokenizer": ("sentencepiece", "sentencepiece"),
    "TikTokenizer": ("tiktoken", "tiktoken"),
}


class CoreTokenizer(Tokenizer):
    """A megatron-core ``MegatronTokenizerText`` behind this project's :class:`Tokenizer`."""

    def __init__(self, tokenizer_type: str, path: str | None = None, **kwargs: Any) -> None:
        library, package = CORE_TOKENIZERS[tokenizer_type]
        if package and importlib.util.find_spec(package) is None:
            raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs the '{package}' package: "
                                 f"pip install {package}")
        if library != "null":
            _require_file(path, "--tokenizer-model", tokenizer_type)
        from megatron.core.tokenizers import MegatronTokenizer  # heavy: megatron.core; only when used

        super().__init__(path, **kwargs)
        self.name = tokenizer_type
        try:
            self._core = MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path={"library": library},
                                                           **kwargs)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise TokenizerError(f"--tokenizer-model {path}: cannot load as {tokenizer_type} ({_one_line(exc)})") from None

    def tokenize(self, text: str) -> list[int]:
        return list(self._core.tokenize(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._core.detokenize([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return int(self._core.vocab_size)

    @property
    def eod(self) -> int:
        return int(self._core.eod)

    def _core_id(self, attribute: str, what: str) -> int:
        value = getattr(self._core, attribute, None)
        if value is None or value < 0:
            return self._missing(what)
        return int(value)

    @property
    def pad(self) -> int:
        return self._core_id("pad", "PAD")

    @property
    def bos(self) -> int:
        return self._core_id("bos", "BOS")


class NullTokenizer(CoreTokenizer):
    """Text that already is space-separated ids ``0..vocab_size`` (megatron-core's ``null``
    library: vocabulary ``vocab_size + 1``, end of document ``vocab_size``)."""

    def __init__(self, vocab_size: int | None) -> None:
        if vocab_size is None or vocab_size < 1:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size >= 1")
        super().__init__("NullTokenizer", vocab_size=int(vocab_size))
        self._ids = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        words = text.split()
        if not words:  # core would read "" as one bad id; empty text is no tokens
            return []
        try:
            ids = super().tokenize(" ".join(words))  # core splits on single spaces only
        except ValueError:
            raise TokenizerError(f"NullTokenizer input must be space-separated integers, got {text[:40]!r}") from None
        bad = next((i for i in ids if not 0 <= i <= self._ids), None)
        if bad is not None:
            raise TokenizerError(f"NullTokenizer id {bad} outside 0..{self._ids} (--vocab-size {self._ids})")
        return ids

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self._ids + 1)}


def core_tokenizer(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None) -> Tokenizer:
    """The megatron-core-backed tokenizer for ``tokenizer_type`` (a key of :data:`CORE_TOKENIZERS`)."""
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    return CoreTokenizer(tokenizer_type, tokenizer_model)
