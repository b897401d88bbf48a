"""megatron-core's tokenizers behind ``--tokenizer-type``: NullTokenizer, SentencePieceTokenizer,
TikTokenizer (megatron/trainer/tokenizer/core_backed.py).

References: megatron-core's own ``null`` library for the ids, and this project's previous
dataset cache key (class, path, vocabulary) so indexed datasets built before keep their cache.
"""
from __future__ import annotations

import importlib.util

import pytest

from megatron.trainer.tokenizer import NullTokenizer, TokenizerError, build_tokenizer


def test_null_tokenizer_is_megatron_cores() -> None:
    from megatron.core.tokenizers import MegatronTokenizer

    ours = build_tokenizer("NullTokenizer", vocab_size=10)
    core = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=10)
    assert isinstance(ours, NullTokenizer)
    assert ours.tokenize("3 1  4\n1") == core.tokenize("3 1 4 1") == [3, 1, 4, 1]
    assert (ours.vocab_size, ours.eod) == (core.vocab_size, core.eod) == (11, 10)
    assert ours.detokenize([5, 9]) == core.detokenize([5, 9]) == "5 9"
    assert list(ours.unique_identifiers.items()) == [("class", "NullTokenizer"), ("tokenizer_path", []),
                                                     ("vocab_size", "10")]
    for text, message in (("1 x", "space-separated integers"), ("11", "outside 0..10")):
        with pytest.raises(TokenizerError, match=message):
            ours.tokenize(text)


@pytest.mark.parametrize("kind,package", [("SentencePieceTokenizer", "sentencepiece"), ("TikTokenizer", "tiktoken")])
def test_optional_tokenizer_libraries_fail_in_one_line(kind: str, package: str, tmp_path, capsys) -> None:
    from megatron.trainer.plan.parse import parse_args

    model = tmp_path / "missing.model"
    argv = ["--mock-data", "--tokenizer-type", kind, "--tokenizer-model", str(model)]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    installed = importlib.util.find_spec(package) is not None
    assert (str(model) in err[0]) if installed else f"pip install {package}" in err[0]


def test_sentencepiece_round_trip(tmp_path) -> None:
    spm = pytest.importorskip("sentencepiece")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of a tiny corpus for sentencepiece" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=40)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model"))
    ids = tok.tokenize("line 7 of a tiny corpus")
    assert tok.detokenize(ids) == "line 7 of a tiny corpus" and max(ids) < tok.vocab_size
