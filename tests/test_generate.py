"""tools/generate.py: greedy tokens equal transformers' greedy ``generate`` on the exported model;
the run's tokenizer (recorded in the checkpoint, exported beside the model) encodes the prompt;
sampling is reproducible by seed.

Greedy equality needs the top two logits at each step to differ by more than the two
implementations' rounding (tests/test_hf_export.py's bound): each step asserts that margin
first, so an ill-conditioned tiny model fails as such, not as a wrong token.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_hf_export import GPT2, LLAMA, _tool, _train, logits_bound, our_logits

transformers = pytest.importorskip("transformers")

PROMPT, NEW = [3, 1, 4], 5  # 8 positions in all: the tiny model's --seq-length


def _generate(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert _tool("generate")(list(argv)) == 0
    return capsys.readouterr().out.strip()


def _assert_greedy_matches(ckpt: Path, hf: Path, prompt: list[int], ours: list[int], suppress: list[int]) -> None:
    """``ours`` (prompt excluded) is transformers' greedy continuation, each step well-conditioned."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    tokens = torch.tensor([prompt + ours])
    logits = our_logits(ckpt, tokens)[0, len(prompt) - 1:-1]
    logits[:, suppress] = float("-inf")
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) > 10 * logits_bound(model, logits[:, :suppress[0]] if suppress else logits)).all()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=len(ours), pad_token_id=0,
                                suppress_tokens=suppress or None)
    assert theirs[0, len(prompt):].tolist() == ours


@pytest.mark.parametrize("arch,flags", [("gpt2", GPT2), ("llama", LLAMA)])
def test_greedy_equals_transformers(megatron_world1, tmp_path: Path, arch: str, flags: list, capsys) -> None:
    ckpt = _train(tmp_path, 2, *flags)  # PP 2, tied
    assert _tool("export_hf")(["--load", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    out = _generate(capsys, "--load", str(ckpt), "--prompt-ids", ",".join(map(str, PROMPT)),
                    "--max-new-tokens", str(NEW), "--greedy", "--device", "cpu")
    ids = [int(i) for i in out.split(",")]
    assert ids[:len(PROMPT)] == PROMPT and len(ids) == len(PROMPT) + NEW
    _assert_greedy_matches(ckpt, tmp_path / "hf", PROMPT, ids[len(PROMPT):], [])


def _tiny_bpe(directory: Path) -> tuple[Path, Path]:
    """A byte-level BPE vocab.json (the 256 byte symbols, 3 merges, ``<|endoftext|>``) and merges.txt."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    directory.mkdir(parents=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return directory / "vocab.json", directory / "merges.txt"


def test_prompt_through_the_runs_tokenizer(megatron_world1, tmp_path: Path, capsys) -> None:
    """GPT2BPETokenizer run: the export writes transformers tokenizer files that encode as ours,
    ``--prompt`` text generates transformers' greedy continuation (padding ids never chosen)."""
    from megatron.trainer.tokenizer import build_tokenizer

    vocab, merges = _tiny_bpe(tmp_path / "tok")
    ckpt = _train(tmp_path, 2, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                  "--merge-file", str(merges), "--mock-data", "--make-vocab-size-divisible-by", "64")
    assert _tool("export_hf")(["--load", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    assert "tokenizer: GPT2BPETokenizer as transformers GPT2Tokenizer" in capsys.readouterr().out  # v5: no "Fast"
    ours = build_tokenizer("GPT2BPETokenizer", str(vocab), str(merges))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the hat the<|endoftext|> é"
    assert theirs.encode(text) == ours.tokenize(text)
    prompt = "the"
    out = _generate(capsys, "--load", str(ckpt), "--prompt", prompt, "--max-new-tokens", "4", "--device", "cpu")
    assert out.startswith(prompt)
    new = ours.tokenize(out)[len(ours.tokenize(prompt)):]
    padded = transformers.AutoConfig.from_pretrained(tmp_path / "hf").vocab_size
    _assert_greedy_matches(ckpt, tmp_path / "hf", ours.tokenize(prompt), new, list(range(ours.vocab_size, padded)))


def test_sampling_is_reproducible(megatron_world1, tmp_path: Path, capsys) -> None:
    ckpt = _train(tmp_path, 1)
    common = ["--load", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "6", "--device", "cpu"]
    first = _generate(capsys, *common, "--top-k", "8", "--top-p", "0.9", "--temperature", "2", "--seed", "7")
    assert first == _generate(capsys, *common, "--top-k", "8", "--top-p", "0.9", "--temperature", "2", "--seed", "7")
    assert _generate(capsys, *common, "--top-k", "1", "--seed", "3") == _generate(capsys, *common, "--greedy")


def test_next_token_filters() -> None:
    """top-k keeps the k largest, top-p the smallest prefix of mass >= p (the token crossing p included)."""
    from megatron.trainer.generation import Sampling, next_token

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(next_token(logits, Sampling(greedy=False, top_p=0.75), torch.Generator().manual_seed(s)))
             for s in range(200)}
    assert draws == {0, 1}
    draws = {int(next_token(logits, Sampling(greedy=False, top_k=3), torch.Generator().manual_seed(s)))
             for s in range(200)}
    assert draws == {0, 1, 2}


def test_refusals_are_one_line(megatron_world1, tmp_path: Path, capsys) -> None:
    assert _tool("generate")(["--load", str(tmp_path / "none"), "--prompt-ids", "1", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --load {tmp_path / 'none'}: no such directory"
    ckpt = _train(tmp_path, 1)
    for argv, start in ((["--prompt", "hi"], "error: --prompt needs the run's tokenizer"),
                        (["--prompt-ids", "1", "--max-new-tokens", "9"], "error: 1 prompt + 9 new tokens exceed"),
                        (["--prompt-ids", "99"], "error: --prompt-ids outside")):
        argv = ["--load", str(ckpt), "--max-new-tokens", "1", *argv]
        assert _tool("generate")(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start), err
