"""Train a byte-level BPE tokenizer (GPT-2 style) or BERT WordPiece with Hugging Face ``tokenizers``.

    python tools/train_tokenizer.py --output-dir tok --vocab-size 8192           # pydoc corpus
    python tools/train_tokenizer.py --output-dir tok --input corpus.jsonl --json-keys text
    python tools/train_tokenizer.py --output-dir tok --vocab-size 1024 --wordpiece

BPE (the default) writes ``tokenizer.json`` (+ ``tokenizer_config.json``), for
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/tokenizer.json``, and GPT-2-style
``vocab.json`` + ``merges.txt`` for ``--tokenizer-type GPT2BPETokenizer --vocab-file
tok/vocab.json --merge-file tok/merges.txt``. ``--wordpiece`` trains BERT WordPiece instead:
``wordpiece-vocab.txt`` (``--tokenizer-type BertWordPieceLowerCase --vocab-file
tok/wordpiece-vocab.txt``) and the same as ``tok/wordpiece/tokenizer.json``
(``--tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/wordpiece``). The two kinds
never share a file name, so both can live in one ``--output-dir`` and training one never
overwrites the other.

Without ``--input`` the corpus is CPython's own documentation topics (``pydoc_data``), so this
runs offline. Inputs ending in ``.jsonl``/``.json`` are read one JSON object per line (the
``--json-keys`` fields); other files are plain text.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.trainer.data.corpus import pydoc_corpus, read_texts  # noqa: E402
from megatron.trainer.config.flag_checks import OneLineParser  # noqa: E402
from megatron.trainer.checkpointing.writable import OutputPathError, check_writable_directory  # noqa: E402
from megatron.trainer.tokenizer.tokenizer import GPT2_EOD  # noqa: E402

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDPIECE_VOCAB = "wordpiece-vocab.txt"  # not vocab.txt: one --output-dir holds BPE and WordPiece


def _texts(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    """The corpus; a missing file, bad UTF-8 or bad JSON is one ``error:`` line."""
    if not args.input:
        return pydoc_corpus("topic")
    for path in args.input:
        if not os.path.isfile(path):
            p.error(f"--input {path}: no such file")
    try:
        return list(read_texts(args.input, args.json_keys))
    except ValueError as exc:
        p.error(str(exc))


def train_bpe(texts: list[str], vocab_size: int, min_frequency: int, output_dir: str) -> list[str]:
    """Train GPT-2-style byte-level BPE; write tokenizer.json, vocab.json, merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[GPT2_EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: lossless on any text
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    written = list(tok.model.save(output_dir))  # vocab.json, merges.txt
    path = os.path.join(output_dir, "tokenizer.json")
    tok.save(path)
    config = os.path.join(output_dir, "tokenizer_config.json")
    with open(config, "w", encoding="utf-8") as f:
        json.dump({"eos_token": GPT2_EOD, "bos_token": GPT2_EOD, "unk_token": GPT2_EOD}, f, indent=2)
    return [path, config, *written]


def train_wordpiece(texts: list[str], vocab_size: int, min_frequency: int, lower_case: bool,
                    output_dir: str) -> list[str]:
    """Train BERT WordPiece; write wordpiece-vocab.txt (one token per line, id = line number) and the same
    tokenizer as wordpiece/tokenizer.json, whose tokenizer_config.json names BERT's special
    tokens (so ``--tokenizer-type HuggingFaceTokenizer`` serves BERT too)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lower_case, strip_accents=lower_case)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=BERT_SPECIALS,
        continuing_subword_prefix="##", show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    vocab = tok.get_vocab()
    path = os.path.join(output_dir, WORDPIECE_VOCAB)
    with open(path, "w", encoding="utf-8") as f:
        for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
            f.write(token + "\n")
    hf_dir = os.path.join(output_dir, "wordpiece")
    os.makedirs(hf_dir, exist_ok=True)
    hf_path, config = os.path.join(hf_dir, "tokenizer.json"), os.path.join(hf_dir, "tokenizer_config.json")
    tok.save(hf_path)
    with open(config, "w", encoding="utf-8") as f:
        json.dump({"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]", "pad_token": "[PAD]",
                   "unk_token": "[UNK]", "eos_token": "[SEP]"}, f, indent=2)  # BERT separates with [SEP]
    return [path, hf_path, config]


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--input", nargs="*", default=None, help="text or JSONL files (default: the pydoc corpus)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL fields to read")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary, 256 bytes + merges + <|endoftext|>")
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--wordpiece", action="store_true",
                   help=f"train BERT WordPiece ({WORDPIECE_VOCAB}, wordpiece/tokenizer.json) instead of BPE")
    p.add_argument("--wordpiece-vocab-size", type=int, default=None, help="default: --vocab-size")
    p.add_argument("--wordpiece-case", action="store_true", help="case-preserving WordPiece (BertWordPieceCase)")
    args = p.parse_args(argv)
    if args.vocab_size < 258 and not args.wordpiece:
        p.error("--vocab-size must be at least 258 (256 byte tokens, <|endoftext|>, one merge)")
    if args.min_frequency < 0:
        p.error(f"--min-frequency {args.min_frequency}: must be >= 0")
    if args.wordpiece_vocab_size is not None and args.wordpiece_vocab_size <= len(BERT_SPECIALS):
        p.error(f"--wordpiece-vocab-size {args.wordpiece_vocab_size}: must exceed its {len(BERT_SPECIALS)} special tokens")
    try:  # before reading and training, not after
        check_writable_directory(args.output_dir, "--output-dir")
    except OutputPathError as exc:
        p.error(str(exc))
    texts = _texts(args, p)
    if not any(t.strip() for t in texts):
        p.error(f"--input {' '.join(args.input)}: no text (empty or blank)")
    os.makedirs(args.output_dir, exist_ok=True)
    if args.wordpiece:
        size = args.wordpiece_vocab_size or args.vocab_size
        written = train_wordpiece(texts, size, args.min_frequency, not args.wordpiece_case, args.output_dir)
    else:
        written = train_bpe(texts, args.vocab_size, args.min_frequency, args.output_dir)
    chars = sum(len(t) for t in texts)
    print(f"trained on {len(texts)} texts ({chars} characters); wrote {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
