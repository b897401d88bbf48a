"""Tokenize a JSONL corpus into megatron-core indexed datasets (Megatron-LM's preprocess_data.py).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file tok/vocab.json --merge-file tok/merges.txt \\
        --append-eod --workers 4

For every ``--json-keys`` field K this writes ``{output-prefix}_{K}_document.bin`` and
``.idx`` (``_sentence`` with ``--split-sentences``), which ``--data-path
{output-prefix}_{K}_document`` then trains on. Each input line is one JSON object, one
document. Files appear only when complete (written under a temporary name, then renamed).

``--split-sentences`` splits with nltk's Punkt like Megatron-LM, offline: the installed English
model when nltk has one, else Punkt trained on the input's first characters
(``megatron/trainer/data/sentence_split.py``); nothing is downloaded. Sentences lose their
surrounding whitespace as in Megatron-LM; ``--keep-newlines`` keeps each sentence's trailing
whitespace, so the sentences of a document concatenate back to its exact text.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Only light imports at module level: worker processes start before torch is imported.
from megatron.trainer.data.corpus import EncodingError, json_record, utf8_lines  # noqa: E402
from megatron.trainer.config.flag_checks import OneLineParser  # noqa: E402
from megatron.trainer.data.sentence_split import TRAINING_SAMPLE_CHARS, build_splitter, split_sentences  # noqa: E402
from megatron.trainer.tokenizer.factory import build_tokenizer  # noqa: E402
from megatron.trainer.config.choices import TOKENIZER_TYPES  # noqa: E402
from megatron.trainer.tokenizer.tokenizer import TokenizerError  # noqa: E402
from megatron.trainer.checkpointing.writable import OutputPathError, check_writable_directory  # noqa: E402


class InputError(ValueError):
    """A bad input line; the message is one line with file and line number."""


class Encoder:
    """Per-process tokenizer state; ``encode`` turns one JSON line into token ids per key."""

    tokenizer: Any = None

    def __init__(self, args: argparse.Namespace, splitter: Any = None) -> None:
        self.args = args
        self.splitter = splitter  # Punkt with --split-sentences (pickled into each worker)

    def initializer(self) -> None:
        Encoder.tokenizer = build_tokenizer(
            self.args.tokenizer_type, vocab_file=self.args.vocab_file, merge_file=self.args.merge_file,
            tokenizer_model=self.args.tokenizer_model, vocab_size=self.args.vocab_size,
        )

    def encode(self, numbered_line: tuple[int, str]) -> tuple[dict[str, list[int]], dict[str, list[int]], int]:
        line_number, line = numbered_line
        where = f"{self.args.input}:{line_number}"
        try:
            record = json_record(line, where)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        ids, lens = {}, {}
        for key in self.args.json_keys:
            if key not in record:
                raise InputError(f"{where}: no {key!r} field (--json-keys {' '.join(self.args.json_keys)})")
            text = str(record[key])
            if self.args.split_sentences:
                sentences = split_sentences(self.splitter, text, keep_whitespace=self.args.keep_newlines)
            else:
                sentences = [text]
            doc_ids: list[int] = []
            sentence_lens: list[int] = []
            for sentence in sentences:
                try:
                    sentence_ids = Encoder.tokenizer.tokenize(sentence)
                except TokenizerError as exc:
                    raise InputError(f"{where}: {exc}") from None
                if sentence_ids:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if doc_ids and self.args.append_eod:
                doc_ids.append(Encoder.tokenizer.eod)
                sentence_lens[-1] += 1
            ids[key], lens[key] = doc_ids, sentence_lens
        return ids, lens, len(line)


def _numbered_lines(path: str):
    try:
        for number, line in utf8_lines(path):
            if line.strip():
                yield number, line
    except EncodingError as exc:
        raise InputError(str(exc)) from None


def _has_content(path: str) -> bool:
    """Whether ``path`` has a non-blank line (reads only up to the first one)."""
    with open(path, "rb") as f:
        return any(raw.strip() for raw in f)


def _sample_texts(args: argparse.Namespace):
    """The --json-keys texts of the input's leading lines (Punkt's training sample); lines that
    are not JSON objects are skipped here and reported with their line number by the encoder."""
    size = 0
    for _, line in _numbered_lines(args.input):
        try:
            record = json_record(line, args.input)
        except ValueError:
            continue
        for key in args.json_keys:
            if key in record:
                text = str(record[key])
                size += len(text)
                yield text
        if size >= TRAINING_SAMPLE_CHARS:
            return


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file, one JSON object (document) per line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="fields to extract, one dataset each")
    g.add_argument("--split-sentences", action="store_true", help="store each sentence as its own sequence")
    g.add_argument("--keep-newlines", action="store_true", help="with --split-sentences: keep whitespace between sentences")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json or BERT vocab.txt")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    g.add_argument("--tokenizer-model", default=None, help="Hugging Face tokenizer.json (or its directory), SentencePiece or tiktoken model")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: number of ids")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix of the .bin/.idx files")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--chunk-size", type=int, default=32, help="documents per task sent to a worker")
    g.add_argument("--log-interval", type=int, default=1000, help="report progress every N documents")
    args = p.parse_args(argv)
    if args.workers < 1 or args.chunk_size < 1 or args.log_interval < 1:
        p.error("--workers, --chunk-size and --log-interval must be >= 1")
    if args.keep_newlines and not args.split_sentences:
        p.error("--keep-newlines needs --split-sentences")
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input}: no such file")
    if not _has_content(args.input):
        p.error(f"--input {args.input}: empty (no non-blank line), nothing to preprocess")
    try:  # the output directory must exist and take files; no output file may be a directory
        check_writable_directory(os.path.dirname(os.path.abspath(args.output_prefix)),
                                 f"--output-prefix {args.output_prefix}: directory", create_missing=False)
    except OutputPathError as exc:
        p.error(str(exc))
    for prefix in output_prefixes(args).values():
        for path in (prefix + ".bin", prefix + ".idx"):
            if os.path.isdir(path):
                p.error(f"--output-prefix {args.output_prefix}: {path} is a directory")
    try:
        # Load once here: bad tokenizer files fail before any worker starts.
        args.tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file,
                                         args.tokenizer_model, args.vocab_size)
    except TokenizerError as exc:
        p.error(str(exc))
    return args


def output_prefixes(args: argparse.Namespace) -> dict[str, str]:
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)
    vocab_size = args.tokenizer.vocab_size
    del args.tokenizer  # workers build their own; keep the Namespace picklable and small
    splitter = None
    if args.split_sentences:
        try:
            splitter, how = build_splitter(_sample_texts(args))
        except InputError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"Splitting sentences with {how}.", file=sys.stderr, flush=True)
    encoder = Encoder(args, splitter)
    start = time.monotonic()
    pool = None
    if args.workers > 1:
        # Workers tokenize with one thread each; start them before torch is imported here.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, _numbered_lines(args.input), args.chunk_size)
    else:
        encoder.initializer()
        encoded = map(encoder.encode, _numbered_lines(args.input))

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefixes = output_prefixes(args)
    dtype = DType.optimal_dtype(vocab_size)
    builders = {key: IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=dtype) for key, prefix in prefixes.items()}
    total_bytes = documents = tokens = 0
    try:
        for documents, (ids, lens, nbytes) in enumerate(encoded, 1):
            total_bytes += nbytes
            for key, doc in ids.items():
                builders[key].add_document(doc, lens[key])
                tokens += len(doc)
            if documents % args.log_interval == 0:
                elapsed = max(time.monotonic() - start, 1e-9)
                print(f"Processed {documents} documents ({documents / elapsed:.1f} docs/s, "
                      f"{total_bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr, flush=True)
    except InputError as exc:
        _abort(pool, builders, prefixes)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BaseException:
        _abort(pool, builders, prefixes)
        raise
    if pool is not None:
        pool.close()
        pool.join()
    if tokens == 0:  # a dataset of no tokens trains nothing; say so instead of writing it
        _abort(None, builders, prefixes)
        print(f"error: --input {args.input}: {documents} documents but no tokens in --json-keys "
              f"{' '.join(args.json_keys)}; nothing written", file=sys.stderr)
        return 1
    for key, prefix in prefixes.items():
        builders[key].finalize(prefix + ".idx.tmp")
        os.replace(prefix + ".bin.tmp", prefix + ".bin")
        os.replace(prefix + ".idx.tmp", prefix + ".idx")
    elapsed = time.monotonic() - start
    print(f"Done: {documents} documents, {tokens} tokens in {elapsed:.1f} s; wrote "
          + ", ".join(f"{p}.bin/.idx" for p in prefixes.values()), flush=True)
    return 0


def _abort(pool: Any, builders: dict[str, Any], prefixes: dict[str, str]) -> None:
    if pool is not None:
        pool.terminate()
        pool.join()
    for key, prefix in prefixes.items():
        builders[key].data_file.close()
        for suffix in (".bin.tmp", ".idx.tmp"):
            try:
                os.remove(prefix + suffix)
            except FileNotFoundError:
                pass


if __name__ == "__main__":
    sys.exit(main())
