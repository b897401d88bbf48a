"""Tokenizers for data preprocessing and training, behind one small interface.

Megatron-LM's ``--tokenizer-type`` names select an implementation:

=========================  ================================================================
``GPT2BPETokenizer``       byte-level BPE from GPT-2's ``vocab.json`` + ``merges.txt``
``HuggingFaceTokenizer``   any Hugging Face ``tokenizers`` JSON (a ``tokenizer.json`` file, or
                           a directory holding one, optionally with ``tokenizer_config.json``)
``BertWordPieceLowerCase`` BERT WordPiece from a ``vocab.txt``, lower-casing and accent-stripping
``BertWordPieceCase``      BERT WordPiece from a ``vocab.txt``, case-preserving
``NullTokenizer``          text is already space-separated integer ids (``--vocab-size`` V:
                           vocabulary V + 1, end-of-document V); megatron-core's
``SentencePieceTokenizer`` a SentencePiece ``--tokenizer-model`` (needs ``sentencepiece``)
``TikTokenizer``           a tiktoken vocabulary ``--tokenizer-model`` (needs ``tiktoken``)
=========================  ================================================================

The last three are megatron-core's tokenizers (:mod:`.core_backed`). The first four are thin
adapters over the Hugging Face ``tokenizers`` library, which does the heavy lifting (BPE
merges, WordPiece, normalisation): megatron-core's versions of them need ``transformers`` and,
for GPT-2 and BERT, a Hugging Face hub download at run time (see :mod:`.core_backed`). Every failure to load is a :class:`TokenizerError` whose message is
one line naming the offending file.

The objects double as megatron-core dataset tokenizers: ``GPTDatasetConfig(tokenizer=...)``
reads ``vocab_size``, ``eod``, ``pad`` (optional) and ``unique_identifiers`` (the part of the
dataset cache key that identifies the tokenizer).
"""
from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


GPT2_EOD = "<|endoftext|>"
# End-of-document candidates for a bare tokenizer.json (no tokenizer_config.json beside it).
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; the message is one line naming the file."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if not path:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.exists(path):
        raise TokenizerError(f"{flag} {path}: no such file")
    return path


class Tokenizer(ABC):
    """What preprocessing, datasets and training need from a tokenizer.

    ``tokenize`` maps text to ids without adding any special token (documents get their
    end-of-document token from ``tools/preprocess_data.py --append-eod``); ``detokenize``
    maps ids back to text.
    """

    name: str = "tokenizer"

    def __init__(self, *paths: str | None, **options: Any) -> None:
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [os.path.abspath(p) for p in paths if p]
        for key, value in options.items():
            self.unique_identifiers[key] = str(value)

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text -> ids."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids -> text."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before Megatron's padding)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """The end-of-document id."""

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError(f"{self.name} has no vocabulary")

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    def _missing(self, what: str) -> int:
        raise NotImplementedError(f"{self.name} has no {what} token")

    @property
    def cls(self) -> int:
        return self._missing("CLS")

    @property
    def sep(self) -> int:
        return self._missing("SEP")

    @property
    def mask(self) -> int:
        return self._missing("MASK")

    @property
    def pad(self) -> int:
        return self._missing("PAD")

    @property
    def bos(self) -> int:
        return self._missing("BOS")

    @property
    def eos(self) -> int:
        return self.eod

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class _HFBackedTokenizer(Tokenizer):
    """Common code of the tokenizers backed by a ``tokenizers.Tokenizer``."""

    def __init__(self, backend: Any, *paths: str | None, **options: Any) -> None:
        super().__init__(*paths, **options)
        self._backend = backend
        self._vocab: dict[str, int] | None = None

    def tokenize(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once (the library parallelises this internally)."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = self._backend.get_vocab(with_added_tokens=True)
        return self._vocab

    @property
    def vocab_size(self) -> int:
        # Ids may be sparse when added tokens sit beyond the model vocabulary.
        return max(self._backend.get_vocab_size(with_added_tokens=True), max(self.vocab.values(), default=-1) + 1)

    def _token_id(self, token: str, source: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{source}: the vocabulary has no {token} token")
        return token_id


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - a declared dependency
        raise TokenizerError("this tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
    return tokenizers


class GPT2BPETokenizer(_HFBackedTokenizer):
    """GPT-2's byte-level BPE: lossless on any text; end of document is ``<|endoftext|>``."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        tk = _import_tokenizers()
        _require_file(vocab_file, "--vocab-file", self.name)
        _require_file(merge_file, "--merge-file", self.name)
        _check_vocab_json(vocab_file)
        try:
            model = tk.models.BPE.from_file(vocab_file, merge_file)
        except Exception as exc:  # the library raises a bare Exception
            raise _bpe_error(exc, vocab_file, merge_file) from None
        backend = tk.Tokenizer(model)
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tk.decoders.ByteLevel()
        super().__init__(backend, vocab_file, merge_file)
        eod = backend.token_to_id(GPT2_EOD)
        if eod is None:
            raise TokenizerError(f"--vocab-file {vocab_file}: no {GPT2_EOD} token (GPT-2's end of document)")
        backend.add_special_tokens([tk.AddedToken(GPT2_EOD, special=True)])
        self._eod = eod

    @property
    def eod(self) -> int:
        return self._eod


def _check_vocab_json(vocab_file: str) -> None:
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json ({_one_line(exc)})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json (expected {{token: id}})")


def _bpe_error(exc: Exception, vocab_file: str, merge_file: str) -> TokenizerError:
    msg = _one_line(exc)
    missing = re.search(r"Token `(.*)` out of vocabulary", msg)
    if missing:
        return TokenizerError(
            f"--merge-file {merge_file} does not match --vocab-file {vocab_file}: "
            f"a merge uses token {missing.group(1)!r}, which is not in the vocabulary")
    if "Merges text file invalid" in msg:
        return TokenizerError(f"--merge-file {merge_file}: not a GPT-2 merges.txt ({msg})")
    return TokenizerError(f"cannot load BPE from --vocab-file {vocab_file} and --merge-file {merge_file}: {msg}")


class HuggingFaceTokenizer(_HFBackedTokenizer):
    """Any ``tokenizers`` JSON. ``path`` is a ``tokenizer.json`` or a directory with one; a
    ``tokenizer_config.json`` beside it names the end-of-document token (``eos_token``),
    otherwise the first special token among the usual names is used."""

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str) -> None:
        tk = _import_tokenizers()
        _require_file(path, "--tokenizer-model", self.name)
        directory, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (os.path.dirname(path), path)
        if not os.path.isfile(file):
            raise TokenizerError(f"--tokenizer-model {path}: no tokenizer.json in the directory")
        try:
            backend = tk.Tokenizer.from_file(file)
        except Exception as exc:  # the library raises a bare Exception
            raise TokenizerError(f"--tokenizer-model {file}: not a Hugging Face tokenizer JSON ({_one_line(exc)})") from None
        super().__init__(backend, file)
        self._file = file
        config = _read_tokenizer_config(os.path.join(directory, "tokenizer_config.json"))
        self._special = {k: config.get(f"{k}_token") for k in ("eos", "bos", "pad", "cls", "sep", "mask")}
        eos = self._special["eos"]
        if eos is None:
            eos = next((t for t in _EOD_CANDIDATES if backend.token_to_id(t) is not None), None)
        if eos is None:
            raise TokenizerError(
                f"--tokenizer-model {file}: no end-of-document token (put eos_token in a "
                f"tokenizer_config.json beside it, or add one of {', '.join(_EOD_CANDIDATES)})")
        self._eod = self._token_id(eos, f"--tokenizer-model {file}")

    @property
    def eod(self) -> int:
        return self._eod

    def _special_id(self, kind: str) -> int:
        token = self._special.get(kind)
        if token is None:
            return self._missing(kind.upper())
        return self._token_id(token, f"--tokenizer-model {self._file}")

    @property
    def bos(self) -> int:
        return self._special_id("bos")

    @property
    def pad(self) -> int:
        return self._special_id("pad")

    @property
    def cls(self) -> int:
        return self._special_id("cls")

    @property
    def sep(self) -> int:
        return self._special_id("sep")

    @property
    def mask(self) -> int:
        return self._special_id("mask")


def _read_tokenizer_config(path: str) -> dict[str, str]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not a tokenizer_config.json ({_one_line(exc)})") from None
    out = {}
    for key, value in raw.items() if isinstance(raw, dict) else ():
        if isinstance(value, dict):  # {"content": "</s>", ...}, an AddedToken
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    return out


class BertWordPieceTokenizer(_HFBackedTokenizer):
    """BERT's WordPiece from a ``vocab.txt`` (one token per line).

    As in Megatron-LM, ``[BOS]`` and ``[EOS]`` are appended to the vocabulary when absent and
    ``[EOS]`` is the end-of-document token. Detokenizing joins word pieces with spaces
    (WordPiece is not lossless: case, accents and spacing around punctuation are lost).
    """

    name = "BertWordPiece"

    def __init__(self, vocab_file: str, lower_case: bool = True) -> None:
        tk = _import_tokenizers()
        kind = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        _require_file(vocab_file, "--vocab-file", kind)
        try:
            vocab = tk.models.WordPiece.read_file(vocab_file)
        except Exception as exc:  # the library raises a bare Exception
            raise TokenizerError(f"--vocab-file {vocab_file}: not a WordPiece vocab.txt ({_one_line(exc)})") from None
        for token in ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"):
            if token not in vocab:
                raise TokenizerError(f"--vocab-file {vocab_file}: the vocabulary has no {token} token (BERT needs it)")
        backend = tk.Tokenizer(tk.models.WordPiece(vocab, unk_token="[UNK]"))
        backend.normalizer = tk.normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case)
        backend.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
        backend.decoder = tk.decoders.WordPiece(prefix="##")
        specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "[BOS]", "[EOS]"]
        backend.add_special_tokens([tk.AddedToken(t, special=True) for t in specials])
        super().__init__(backend, vocab_file, lower_case=lower_case)
        self.name = kind
        ids = {t: backend.token_to_id(t) for t in specials}
        self._cls, self._sep, self._pad, self._mask = ids["[CLS]"], ids["[SEP]"], ids["[PAD]"], ids["[MASK]"]
        self._bos, self._eod = ids["[BOS]"], ids["[EOS]"]

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def cls(self) -> int:
        return self._cls

    @property
    def sep(self) -> int:
        return self._sep

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def mask(self) -> int:
        return self._mask

    @property
    def bos(self) -> int:
        return self._bos


def vocab_size_with_padding(vocab_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by x TP``."""
    multiple = max(1, divisible_by) * max(1, tensor_parallel)
    return -(-vocab_size // multiple) * multiple
