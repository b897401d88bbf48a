"""Real data end to end: train a tokenizer, preprocess JSONL to indexed datasets, train on them.

The corpus is CPython's own documentation (``pydoc_data``), so everything runs offline. The
tokenizer and datasets are built once per module.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

from megatron.trainer.plan.parse import parse_args, parse_run_plan
from megatron.trainer.config.job_config import JobConfig
from megatron.trainer.data.corpus import pydoc_corpus, write_jsonl
from megatron.trainer.tokenizer import TokenizerError, build_tokenizer

from async_helpers import REPO, eval_records, run_pretrain

TOKENIZER_VOCAB = 600  # padded to 640 by --make-vocab-size-divisible-by 128


def _tool(name: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / name), *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> argparse.Namespace:
    """Tokenizer files, the corpus as JSONL, and two preprocessed datasets (topics, paragraphs)."""
    from tools.make_corpus import main as make_corpus
    from tools.preprocess_data import main as preprocess
    from tools.train_tokenizer import main as train_tokenizer

    root = tmp_path_factory.mktemp("data")
    tok = root / "tok"
    assert train_tokenizer(["--output-dir", str(tok), "--vocab-size", str(TOKENIZER_VOCAB)]) == 0
    gpt2_files = {name: (tok / name).read_bytes() for name in ("vocab.json", "merges.txt", "tokenizer.json")}
    assert train_tokenizer(["--output-dir", str(tok), "--wordpiece", "--wordpiece-vocab-size", "500"]) == 0
    # WordPiece beside BPE in one directory leaves the BPE files as they were.
    assert {name: (tok / name).read_bytes() for name in gpt2_files} == gpt2_files
    topics = root / "topics.jsonl"
    assert make_corpus(["--output", str(topics)]) == 0
    paragraphs = root / "paragraphs.jsonl"
    write_jsonl(pydoc_corpus("paragraph"), paragraphs)
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
            "--merge-file", str(tok / "merges.txt")]
    # The CLI with two worker processes ...
    _tool("preprocess_data.py", "--input", str(topics), "--output-prefix", str(root / "topics"),
          *gpt2, "--append-eod", "--workers", "2", "--log-interval", "20")
    # ... and in-process with one (no pool).
    assert preprocess(["--input", str(paragraphs), "--output-prefix", str(root / "paragraphs"),
                       *gpt2, "--append-eod", "--workers", "1"]) == 0
    return argparse.Namespace(
        root=root, tok=tok, topics=topics, gpt2=gpt2,
        topics_prefix=str(root / "topics_text_document"),
        paragraphs_prefix=str(root / "paragraphs_text_document"),
    )


def _gpt2(corpus: argparse.Namespace):
    return build_tokenizer("GPT2BPETokenizer", str(corpus.tok / "vocab.json"), str(corpus.tok / "merges.txt"))


# -- (a) tokenizer + preprocessing -----------------------------------------------------------

def test_preprocess_writes_indexed_dataset_that_detokenizes_to_the_text(corpus) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = _gpt2(corpus)
    assert tokenizer.vocab_size == TOKENIZER_VOCAB
    docs = pydoc_corpus("topic")
    dataset = IndexedDataset(corpus.topics_prefix)
    assert len(dataset) == len(docs) and dataset.index.dtype == numpy.uint16
    for i in (0, 7, len(docs) - 1):
        ids = dataset[i]
        assert ids[-1] == tokenizer.eod  # --append-eod
        assert tokenizer.detokenize(ids[:-1].tolist()) == docs[i]
    # Byte-level BPE is lossless on every document.
    assert all(tokenizer.detokenize(dataset[i][:-1].tolist()) == d for i, d in enumerate(docs))


def test_tokenizer_json_and_gpt2_files_agree(corpus) -> None:
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(corpus.tok / "tokenizer.json"))
    gpt2 = _gpt2(corpus)
    text = pydoc_corpus("topic")[3]
    assert hf.tokenize(text) == gpt2.tokenize(text)
    assert hf.eod == gpt2.eod and hf.vocab_size == gpt2.vocab_size
    # A directory works too (tokenizer_config.json names the end-of-document token).
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(corpus.tok)).eod == gpt2.eod


def test_bert_wordpiece_and_null_tokenizers(corpus) -> None:
    bert = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(corpus.tok / "wordpiece-vocab.txt"))
    specials = {bert.cls, bert.sep, bert.pad, bert.mask, bert.eod}
    assert len(specials) == 5 and max(specials) < bert.vocab_size
    assert bert.inv_vocab[bert.cls] == "[CLS]" and bert.inv_vocab[bert.eod] == "[EOS]"
    assert bert.detokenize(bert.tokenize("The Assignment Statement")) == "the assignment statement"
    null = build_tokenizer("NullTokenizer", vocab_size=10)
    assert (null.vocab_size, null.eod) == (11, 10)
    assert null.tokenize("1 2 3") == [1, 2, 3] and null.detokenize([4, 5]) == "4 5"


def test_split_sentences_keep_newlines_round_trip(corpus, tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tools.preprocess_data import main as preprocess

    text = 'First sentence. Second one, "quoted." Third!\n\nA new paragraph? Yes.'
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps({"body": text}) + "\n")
    assert preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "s"), "--json-keys", "body",
                       *corpus.gpt2, "--split-sentences", "--keep-newlines"]) == 0
    dataset = IndexedDataset(str(tmp_path / "s_body_sentence"))
    assert len(dataset) == 5 and len(dataset.document_indices) == 2  # five sentences, one document
    tokenizer = _gpt2(corpus)
    assert "".join(tokenizer.detokenize(dataset[i].tolist()) for i in range(len(dataset))) == text


def test_preprocess_bad_json_line_is_one_line_error(corpus, tmp_path: Path, capsys) -> None:
    from tools.preprocess_data import main as preprocess

    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"text": oops}\n')
    assert preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "bad"), *corpus.gpt2]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {src}:2: not a JSON object (Expecting value)"]
    assert not list(tmp_path.glob("bad_text_document*"))  # no partial output


# -- (b) training ----------------------------------------------------------------------------

def _train_flags(corpus: argparse.Namespace, *data: str) -> list[str]:
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--lr-warmup-iters", "2",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-threads", "1",
        "--data-path", *data, *corpus.gpt2, "--data-cache-path", str(corpus.root / "cache"),
    ]


@pytest.mark.slow
def test_two_stage_pretraining_on_preprocessed_data_lowers_the_loss(corpus, tmp_path: Path) -> None:
    argv = [*_train_flags(corpus, corpus.topics_prefix), "--pipeline-model-parallel-size", "2",
            "--train-iters", "20", "--log-interval", "1", "--eval-interval", "10", "--eval-iters", "1",
            "--split", "90,10,0"]
    records, params = run_pretrain(argv, tmp_path)
    losses = [r["loss"] for r in records]
    assert len(losses) == 20 and all(numpy.isfinite(losses))
    # Validation through the pipeline, on held-out text: at iterations 10 and 20, and it improves.
    # (The 90,10,0 split leaves no test data: that evaluation is skipped.)
    evals = eval_records(tmp_path)
    assert [(r["iteration"], r["eval_split"]) for r in evals] == [(10, "valid"), (20, "valid")]
    assert evals[1]["eval_loss"] < numpy.log(640) - 0.5
    assert evals[1]["eval_ppl"] == pytest.approx(numpy.exp(evals[1]["eval_loss"]))
    assert losses[0] == pytest.approx(numpy.log(640), abs=0.3)  # uniform over the padded vocabulary
    assert numpy.mean(losses[-3:]) < losses[0] - 0.5, losses
    embedding = next(v for k, v in params.items() if "word_embeddings" in k)
    assert embedding.shape[0] == 640


# -- (c) one-line errors naming the file ----------------------------------------------------

def _parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


def _copy_prefix(src: str, dst: Path) -> str:
    for ext in (".bin", ".idx"):
        Path(str(dst) + ext).write_bytes(Path(src + ext).read_bytes())
    return str(dst)


@pytest.fixture
def _no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_idx_is_one_line_error(corpus, tmp_path, capsys, _no_torchrun_env, damage: str) -> None:
    prefix = _copy_prefix(corpus.topics_prefix, tmp_path / "broken")
    idx = Path(prefix + ".idx")
    data = idx.read_bytes()
    idx.write_bytes({"garbage": b"NOT-AN-INDEX" + data[12:], "truncated": data[: len(data) // 3], "empty": b""}[damage])
    line = _parse_error(_train_flags(corpus, prefix), capsys)
    assert str(idx) in line and "corrupt" in line, line


def test_truncated_bin_is_one_line_error(corpus, tmp_path, capsys, _no_torchrun_env) -> None:
    prefix = _copy_prefix(corpus.topics_prefix, tmp_path / "short")
    bin_path = Path(prefix + ".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:1000])
    line = _parse_error(_train_flags(corpus, prefix), capsys)
    assert str(bin_path) in line and "truncated" in line, line


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_data_file_is_one_line_error(corpus, tmp_path, capsys, _no_torchrun_env, missing: str) -> None:
    prefix = _copy_prefix(corpus.topics_prefix, tmp_path / "half")
    os.remove(prefix + missing)
    line = _parse_error(_train_flags(corpus, prefix), capsys)
    assert f"missing {prefix}{missing}" in line, line


def test_vocab_merges_mismatch_is_one_line_error(corpus, tmp_path, capsys, _no_torchrun_env) -> None:
    vocab = json.loads((corpus.tok / "vocab.json").read_text())
    merges = (corpus.tok / "merges.txt").read_text().splitlines()
    left, right = merges[1].split()  # merges[0] is the "#version" header
    del vocab[left + right]  # the result of the first merge
    bad_vocab = tmp_path / "vocab.json"
    bad_vocab.write_text(json.dumps(vocab))
    argv = _train_flags(corpus, corpus.topics_prefix)
    argv[argv.index("--vocab-file") + 1] = str(bad_vocab)
    line = _parse_error(argv, capsys)
    assert str(corpus.tok / "merges.txt") in line and str(bad_vocab) in line and "not in the vocabulary" in line, line


@pytest.mark.parametrize("flag", ["--vocab-file", "--merge-file"])
def test_missing_tokenizer_file_is_one_line_error(corpus, tmp_path, capsys, _no_torchrun_env, flag: str) -> None:
    argv = _train_flags(corpus, corpus.topics_prefix)
    missing = str(tmp_path / "nowhere.txt")
    argv[argv.index(flag) + 1] = missing
    line = _parse_error(argv, capsys)
    assert line == f"error: {flag} {missing}: no such file", line


def test_tokenizer_errors_name_the_file(corpus, tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n")
    with pytest.raises(TokenizerError, match=rf"{vocab}.*\[MASK\]"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(vocab))
    hf = tmp_path / "tokenizer.json"
    hf.write_text("{not json")
    with pytest.raises(TokenizerError, match=str(hf)):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf))


def test_data_flags_need_a_tokenizer_and_exclude_mock(corpus, capsys, _no_torchrun_env) -> None:
    argv = _train_flags(corpus, corpus.topics_prefix)
    no_tok = argv[: argv.index("--tokenizer-type")] + argv[argv.index("--merge-file") + 2:]
    assert "--tokenizer-type" in _parse_error(no_tok, capsys)
    assert "--mock-data" in _parse_error([*argv, "--mock-data"], capsys)
    assert "--split" in _parse_error([*argv, "--split", "0,1,0"], capsys)
    mixed = _train_flags(corpus, "0.5", corpus.topics_prefix, "oops", corpus.topics_prefix)
    assert "--data-path mixes" in _parse_error(mixed, capsys)


def test_data_from_another_tokenizer_is_one_line_error(corpus, capsys, _no_torchrun_env) -> None:
    argv = _train_flags(corpus, corpus.topics_prefix)
    argv = argv[: argv.index("--tokenizer-type")] + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"] \
        + argv[argv.index("--merge-file") + 2:]
    line = _parse_error(argv, capsys)
    assert f"{corpus.topics_prefix}.bin: token id" in line and "vocabulary of 101" in line, line


def test_vocab_size_comes_from_the_tokenizer(corpus, capsys, _no_torchrun_env) -> None:
    vocab = parse_run_plan([*_train_flags(corpus, corpus.topics_prefix), "--vocab-size", "7"]).vocab
    assert (vocab.tokenizer_size, vocab.size) == (600, 640)
    vocab = parse_run_plan([*_train_flags(corpus, corpus.topics_prefix), "--make-vocab-size-divisible-by", "64"]).vocab
    assert vocab.size == 640
    vocab = parse_run_plan([*_train_flags(corpus, corpus.topics_prefix), "--make-vocab-size-divisible-by", "7"]).vocab
    assert vocab.size == 602
    assert parse_run_plan([]).vocab.size == 256 and parse_args([]).mock_data  # mock data is unchanged
    assert capsys.readouterr() == ("", "")


# -- (d) datasets, blending ------------------------------------------------------------------

def _data_config(corpus: argparse.Namespace, *data: str, extra: tuple[str, ...] = ()) -> JobConfig:
    return parse_run_plan([*_train_flags(corpus, *data), "--train-iters", "10", *extra])


def test_samples_are_a_pure_function_of_the_index(corpus, megatron_world1, _no_torchrun_env) -> None:
    from megatron.trainer.data import gpt_dataset
    from megatron.trainer.tasks.gpt import GPTTask

    config = _data_config(corpus, corpus.topics_prefix)
    train, valid, test = gpt_dataset.build_gpt_datasets(config)
    assert len(train) >= 10 * 8 and valid is not None
    assert test is None  # 969,30,1 of 79 documents leaves no test document
    batch = GPTTask().batch_fn(config, 0, torch.device("cpu"))(3)
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert batch["tokens"].shape == (2, 32) and batch["tokens"].dtype == torch.int64
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert int(batch["tokens"].max()) < 600
    gpt_dataset._BUILT.clear()  # a fresh build (from the cache) gives the same micro-batch
    again = GPTTask().batch_fn(config, 0, torch.device("cpu"))(3)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    # Data-parallel replicas read disjoint samples of the same global micro-batch.
    dp_config = _data_config(corpus, corpus.topics_prefix, extra=("--data-parallel-size", "2", "--global-batch-size", "8"))
    r0 = GPTTask().batch_fn(dp_config, 0, torch.device("cpu"))(1)
    r1 = GPTTask().batch_fn(dp_config, 1, torch.device("cpu"))(1)
    assert not torch.equal(r0["tokens"], r1["tokens"])


def test_eod_flags_reset_positions_mask_loss_and_attention(corpus, megatron_world1, _no_torchrun_env) -> None:
    from megatron.trainer.data.gpt_dataset import GPTDataSource, build_gpt_datasets

    config = _data_config(corpus, corpus.paragraphs_prefix, extra=(
        "--reset-position-ids", "--eod-mask-loss", "--reset-attention-mask"))
    eod = _gpt2(corpus).eod
    source = GPTDataSource(build_gpt_datasets(config)[0], keep_attention_mask=True)
    batch = source.micro_batch(range(8))
    assert batch["attention_mask"].shape == (8, 1, 32, 32) and batch["attention_mask"].dtype == torch.bool
    b, i = (batch["tokens"] == eod).nonzero()[0].tolist()  # paragraphs are short: EODs abound
    assert batch["loss_mask"][b, i] == 0
    if i + 1 < 32:
        assert batch["position_ids"][b, i + 1] == 0
        assert batch["attention_mask"][b, 0, i + 1, i]  # the next document cannot see this one


def test_blending_two_prefixes_with_weights(corpus, megatron_world1, _no_torchrun_env, tmp_path: Path) -> None:
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.trainer.data.gpt_dataset import GPTDataSource, build_gpt_datasets

    config = _data_config(corpus, "3", corpus.topics_prefix, "1", corpus.paragraphs_prefix,
                        extra=("--split", "90,10,0", "--train-iters", "50"))
    train, valid, test = build_gpt_datasets(config)
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset) and test is None
    assert len(train) == 50 * 8
    ids = numpy.array([int(train[i]["dataset_id"]) for i in range(len(train))])
    assert abs((ids == 0).mean() - 0.75) < 0.02, (ids == 0).mean()
    batch = GPTDataSource(train).micro_batch([0, 1, 2])
    assert batch["tokens"].shape == (3, 32)
    # And the trainer runs on the blend (emulated pipeline, in this process).
    from async_helpers import emulate

    workers = emulate([*_train_flags(corpus, "3", corpus.topics_prefix, "1", corpus.paragraphs_prefix),
                       "--pipeline-executor", "emulator", "--pipeline-model-parallel-size", "2",
                       "--train-iters", "3", "--log-interval", "1", "--split", "90,10,0"])
    assert len(workers) == 2
