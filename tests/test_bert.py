"""BERT pretraining: pipeline stages of megatron-core's BertModel, padding masks, masked-LM data.

References that are not our stage code: megatron-core's own ``BertModel.forward`` for the
unsplit model, a hand-written softmax attention for the SDPA padding mask, and the one-stage
run for every pipeline split and schedule (fp32, no dropout, tolerances as in
tests/test_reference.py). Real data: a WordPiece tokenizer trained on the offline pydoc
corpus, ``tools/preprocess_data.py --split-sentences``, then a two-process run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy
import pytest
import torch

from megatron.trainer.tasks.bert import BertTask
from megatron.trainer.data.mock_bert import CLS, MASK, PAD, SEP, MockBertData
from megatron.trainer.models.bert import (
    BertModelArgs,
    BertStage,
    bert_loss,
    build_bert_stage,
)
from megatron.trainer.models.stage import split_layers

from async_helpers import emulate, eval_records, final_params, named_parameters, run_pretrain
from tests.adam_bounds import assert_within_bounds, gpt_gradient_noise, trace_adam

SEED = 1234
TINY = BertModelArgs(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                     max_position_embeddings=16, vocab_size=64)


def build_pipeline(args: BertModelArgs, counts: list[int]) -> list[BertStage]:
    ranges = split_layers(args.num_layers, len(counts), counts)
    return [build_bert_stage(args, layers, i == 0, i == len(ranges) - 1, SEED, "cpu")
            for i, layers in enumerate(ranges)]


def run_pipeline(stages: list[BertStage], batch: dict[str, torch.Tensor]):
    """Forward and backward through hand-composed stages, as the runtime does over P2P.
    Returns the last stage's output, the loss and the gradients by global name."""
    inputs, outputs, x = [], [], None
    for stage in stages:
        if x is not None:
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        x = stage(x, batch)
        outputs.append(x)
    loss, _ = bert_loss(outputs[-1], batch)
    loss.backward()
    for k in range(len(stages) - 2, -1, -1):
        outputs[k].backward(inputs[k + 1].grad)
    grads = {n: p.grad.detach().clone() for s in stages for n, p in s.global_named_parameters()}
    return outputs[-1], loss.detach(), grads


def mock_batch(indices=(0, 1, 2, 3), seq_length: int = 16, vocab: int = 64) -> dict[str, torch.Tensor]:
    return MockBertData(seq_length, vocab, seed=5).micro_batch(list(indices))


@pytest.fixture(autouse=True)
def _world(megatron_world1):
    yield


# -- model ----------------------------------------------------------------------------------

def test_single_stage_matches_megatron_bertmodel_forward():
    """Our stage runs BertModel's own pieces; megatron-core's forward is the reference."""
    (stage,) = build_pipeline(TINY, [4])
    batch = mock_batch()
    assert batch["padding_mask"].min() == 0  # some padding is exercised
    output = stage(None, batch)
    ref_loss, ref_binary = stage.model(batch["tokens"], batch["padding_mask"],
                                       tokentype_ids=batch["tokentype_ids"], lm_labels=batch["labels"])
    torch.testing.assert_close(output.lm_loss, ref_loss.float(), rtol=0, atol=0)
    torch.testing.assert_close(output.binary_logits, ref_binary.float(), rtol=0, atol=0)
    loss, tokens = bert_loss(output, batch)
    assert tokens == int(batch["loss_mask"].sum())
    # Fresh init: masked LM near uniform over the vocabulary, sentence order near ln 2.
    assert loss.item() == pytest.approx(math.log(64) + math.log(2), abs=0.15)
    names = {n for n, _ in stage.global_named_parameters()}
    assert {"embedding.tokentype_embeddings.weight", "lm_head.dense.weight", "binary_head.weight",
            "pooler.dense.weight", "encoder.final_layernorm.weight"} <= names


@pytest.mark.parametrize("binary_head", [True, False], ids=["sop", "no-binary-head"])
def test_split_matches_unsplit(binary_head: bool):
    args = BertModelArgs(**{**TINY.__dict__, "add_binary_head": binary_head})
    batch = mock_batch()
    if not binary_head:
        batch = MockBertData(16, 64, seed=5, binary_head=False).micro_batch([0, 1, 2, 3])
    reference = build_pipeline(args, [4])
    ref_params = {n: p.detach().clone() for s in reference for n, p in s.global_named_parameters()}
    _, ref_loss, ref_grads = run_pipeline(reference, batch)
    assert ("binary_head.weight" in ref_params) == binary_head
    for counts in ([2, 2], [1, 1, 1, 1], [0, 3, 1]):
        stages = build_pipeline(args, counts)
        params = {n: p.detach() for s in stages for n, p in s.global_named_parameters()}
        assert params.keys() == ref_params.keys()
        assert all(torch.equal(params[n], ref_params[n]) for n in params), counts
        _, loss, grads = run_pipeline(stages, batch)
        # A split moves layers between modules, not arithmetic: every op sees the same shapes and
        # inputs in the same order, so the comparison is exact on any CPU's kernels.
        assert torch.equal(loss, ref_loss), counts
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), f"{counts} {name}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_bert_stages(device: str):
    """bf16 targets GPUs; the same stages must build and train on CPU too."""
    args = BertModelArgs(**{**TINY.__dict__, "bf16": True})
    ranges = split_layers(4, 2)
    stages = [build_bert_stage(args, r, i == 0, i == 1, SEED, device) for i, r in enumerate(ranges)]
    assert all(p.dtype == torch.bfloat16 and p.device.type == device for s in stages for p in s.parameters())
    batch = {k: v.to(device) for k, v in mock_batch().items()}
    hidden = stages[0](None, batch)
    assert hidden.dtype == torch.bfloat16 and hidden.shape == (16, 4, 32)
    _, loss, grads = run_pipeline(stages, batch)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(math.log(64) + math.log(2), abs=0.3)
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_padding_never_reaches_real_tokens_on_any_stage():
    """Three stages: padded positions (tokens and token types) may hold anything without
    changing a real position's loss or the sentence-order logits; dropping the mask does
    change them, so the mask is what keeps them apart -- on the middle stage too."""
    stages = build_pipeline(TINY, [1, 2, 1])
    batch = mock_batch()
    pad = batch["padding_mask"] == 0
    scrambled = dict(batch, tokens=batch["tokens"].masked_fill(pad, 17),
                     tokentype_ids=batch["tokentype_ids"].masked_fill(pad, 1))
    with torch.no_grad():
        out, _, _ = run_forward(stages, batch)
        other, _, _ = run_forward(stages, scrambled)
        unmasked, _, _ = run_forward(stages, dict(scrambled, padding_mask=torch.ones_like(pad, dtype=torch.int64)))
    real = ~pad
    torch.testing.assert_close(other.lm_loss[real], out.lm_loss[real], rtol=0, atol=0)
    torch.testing.assert_close(other.binary_logits, out.binary_logits, rtol=0, atol=0)
    assert not torch.allclose(unmasked.lm_loss[real], out.lm_loss[real])
    # Only the middle stage without its mask: real positions change as well.
    middle_unmasked = [stages[0], _without_mask(stages[1]), stages[2]]
    with torch.no_grad():
        leaky, _, _ = run_forward(middle_unmasked, scrambled)
    assert not torch.allclose(leaky.lm_loss[real], out.lm_loss[real])


def run_forward(stages, batch):
    x = None
    for stage in stages:
        x = stage(x, batch)
    return x, None, None


def _without_mask(stage: BertStage):
    def forward(x, batch):
        return stage(x, dict(batch, padding_mask=torch.ones_like(batch["padding_mask"])))
    return forward


def test_sdpa_honours_bert_key_padding_mask():
    """The ``[b, 1, 1, s]`` bool mask (True = masked out) against a hand-written softmax."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.trainer.models.sdpa_attention import SDPAAttention

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0,
                               use_cpu_initialization=True, cuda_graph_scope=[])
    attn = SDPAAttention(config, 1, AttnMaskType.padding, "self")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 2, 8, generator=g) for _ in range(3))
    real = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    mask = (real < 0.5)[:, None, None, :]
    out = attn(q, k, v, mask)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(8) + mask.float() * -10000.0
    expected = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(5, 2, 16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    v2 = v.clone()
    v2[3:, 0] += 100.0  # padded keys of sample 0
    torch.testing.assert_close(attn(q, k, v2, mask)[:, 0], out[:, 0], rtol=0, atol=0)


# -- mock data ------------------------------------------------------------------------------

def test_mock_bert_data_is_deterministic_and_bert_shaped():
    data = MockBertData(16, 64, seed=3)
    a, b = data.micro_batch(range(32)), MockBertData(16, 64, seed=3).micro_batch(range(32))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tokens"], MockBertData(16, 64, seed=4).micro_batch(range(32))["tokens"])
    lengths = a["padding_mask"].sum(1)
    for i in range(32):
        n = int(lengths[i])
        assert torch.equal(a["padding_mask"][i], (torch.arange(16) < n).long())  # padding at the end
        tokens = a["tokens"][i]
        assert tokens[0] == CLS and tokens[n - 1] == SEP and (tokens[n:] == PAD).all()
        assert (tokens[:n] == SEP).sum() == 2
        masked = a["loss_mask"][i] > 0
        assert masked.any() and (tokens[masked] == MASK).all() and (a["labels"][i][masked] >= 4).all()
        assert (a["labels"][i][~masked] == 0).all()
    assert 0 < int(a["sentence_order"].sum()) < 32  # both orders occur
    assert set(a) == {"tokens", "labels", "loss_mask", "padding_mask", "tokentype_ids", "sentence_order"}


# -- through the trainer (emulator) ---------------------------------------------------------

def _bert_flags(num_stages: int, schedule: str, tmp: Path, *extra: str) -> list[str]:
    return [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "3", "--lr", "5e-3", "--lr-warmup-iters", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-threads", "1", "--log-interval", "1",
        "--pipeline-executor", "emulator", "--pipeline-model-parallel-size", str(num_stages),
        "--pipeline-schedule", schedule, "--log-json", str(tmp / "log.jsonl"), *extra,
    ]


def _train(num_stages: int, schedule: str, tmp: Path, *extra: str):
    tmp.mkdir(parents=True, exist_ok=True)
    workers = emulate(_bert_flags(num_stages, schedule, tmp, *extra), BertTask())
    losses = [json.loads(line)["loss"] for line in (tmp / "log.jsonl").read_text().splitlines()]
    return workers, losses, final_params(workers)


# tests/adam_bounds.py's rho for _bert_flags' model: 4 layers, hidden 32, FFN 128, vocabulary 64,
# 16 x 8 tokens per step.
RHO = gpt_gradient_noise(4, 32, 128, 64, 16 * 8)


def _assert_same_training(losses, params, ref_losses, ref_params, bounds, what: str) -> None:
    """Pipelining only moves the gradient-norm sum (per stage): losses within ``RHO`` relative, every
    parameter element within the bound derived from the one-stage run's Adam steps."""
    assert len(losses) == len(ref_losses) and all(map(math.isfinite, losses)), what
    numpy.testing.assert_allclose(losses, ref_losses, rtol=RHO, err_msg=what)
    assert_within_bounds(params, ref_params, bounds, context=f"{what} ")


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory):
    """The N = 1 run every split and schedule is compared with, and its derived per-element bounds."""
    with trace_adam() as trace:
        workers, losses, params = _train(1, "1f1b", tmp_path_factory.mktemp("bert1"))
    bounds = {name: trace.bound(name, p, RHO) for w in workers for name, p in named_parameters(w)}
    initial = {n: p.detach().clone() for s in build_pipeline(TINY, [4]) for n, p in s.global_named_parameters()}
    moved = [n for n, p in params.items() if not torch.allclose(p, initial[n], rtol=0, atol=1e-4)]
    assert len(moved) > 0.9 * len(params)  # training moved the weights: comparisons are not vacuous
    return losses, params, bounds


@pytest.mark.parametrize("num_stages", [2, 4])
def test_pipelined_bert_trains_like_one_stage(one_stage, tmp_path: Path, num_stages: int):
    workers, losses, params = _train(num_stages, "1f1b", tmp_path)
    _assert_same_training(losses, params, *one_stage, what=f"N={num_stages}")
    if num_stages == 4:
        from megatron.pipeline.ir import Op, OpKind

        # The worker hands a middle stage the padding mask, and nothing else.
        op = Op(OpKind.F, stage=1, microbatch=0)
        assert set(workers[1]._batch(op)) == {"padding_mask"}
        assert "tokens" in workers[0]._batch(Op(OpKind.F, stage=0, microbatch=0))


@pytest.mark.parametrize("schedule, extra, sync", [
    ("zb-h1", (), True),
    ("interleaved-1f1b", ("--num-layers-per-virtual-pipeline-stage", "1"), True),
    ("gpipe", (), True),
    ("paci", (), False),
])
def test_bert_schedule_sweep(one_stage, tmp_path: Path, schedule: str, extra: tuple[str, ...], sync: bool):
    """Two stages under every schedule family: synchronous ones train exactly like 1F1B (the
    one-stage run), asynchronous ones finish with finite losses."""
    _, losses, params = _train(2, schedule, tmp_path, *extra)
    if sync:
        _assert_same_training(losses, params, *one_stage, what=schedule)
    else:
        assert len(losses) == 3 and all(map(math.isfinite, losses))
        assert all(torch.isfinite(p).all() for p in params.values())


def test_no_binary_head_flag_and_middle_batch_keys_for_gpt(tmp_path: Path):
    workers, losses, params = _train(3, "1f1b", tmp_path, "--bert-no-binary-head", "--num-layers", "3")
    assert all(map(math.isfinite, losses))
    assert not any(n.startswith(("binary_head", "pooler", "embedding.tokentype")) for n in params)
    # GPT: a middle stage reads no data, unless --reset-attention-mask makes every layer need it.
    from megatron.pipeline.ir import Op, OpKind

    from async_helpers import tiny_args

    op = Op(OpKind.F, stage=1, microbatch=0)
    gpt = emulate(tiny_args(3, "1f1b", 1, 1, "--pipeline-executor", "emulator"))
    assert gpt[1]._batch(op) == {}
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.gpt import GPTTask

    # a --data-path flag (mock data has no documents); fine at N > 2
    config = parse_run_plan(tiny_args(3, "1f1b", 1, 1)).replace_in("data", reset_attention_mask=True)
    (middle,) = GPTTask().build_stage(config, 1, torch.device("cpu"))
    assert middle.middle_batch_keys == ("attention_mask",)


def test_bert_flag_errors(capsys, monkeypatch):
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_args

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    parser = build_parser()
    BertTask().add_arguments(parser)
    for argv, needle in ((["--mask-prob", "1.5"], "--mask-prob"), (["--seq-length", "4"], "--seq-length"),
                         (["--vocab-size", "5"], "--vocab-size")):
        with pytest.raises(SystemExit):
            parse_args(argv, parser)
        assert needle in capsys.readouterr().err


# -- real corpus, two processes -------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_corpus(tmp_path_factory):
    """A WordPiece vocabulary trained on part of the pydoc corpus, and that part preprocessed
    into sentences (BERT samples are sentence runs)."""
    from megatron.trainer.data.corpus import pydoc_corpus, write_jsonl
    from tools.preprocess_data import main as preprocess
    from tools.train_tokenizer import main as train_tokenizer

    root = tmp_path_factory.mktemp("bert_data")
    docs = root / "docs.jsonl"
    write_jsonl(pydoc_corpus("topic")[:16], docs)
    for kind in ([], ["--wordpiece", "--wordpiece-vocab-size", "400"]):  # BPE, then WordPiece beside it
        assert train_tokenizer(["--input", str(docs), "--output-dir", str(root / "tok"), "--vocab-size", "600",
                                *kind]) == 0
    vocab = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(root / "tok" / "wordpiece-vocab.txt")]
    assert preprocess(["--input", str(docs), "--output-prefix", str(root / "docs"), *vocab,
                       "--split-sentences", "--workers", "1"]) == 0
    return root, [*vocab, "--data-path", str(root / "docs_text_sentence"), "--data-cache-path", str(root / "cache")]


@pytest.mark.slow
def test_bert_two_process_training_on_preprocessed_corpus(bert_corpus, tmp_path: Path):
    root, data = bert_corpus
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "64",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "12", "--lr", "1e-2",
            "--lr-warmup-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-threads", "1",
            "--log-interval", "1", "--pipeline-model-parallel-size", "2", "--split", "80,20,0", *data,
            "--eval-interval", "12", "--eval-iters", "1"]
    records, params = run_pretrain(argv, tmp_path, script="pretrain_bert.py")
    losses = [r["loss"] for r in records]
    assert len(losses) == 12 and all(map(math.isfinite, losses))
    # Masked-LM validation through the pipeline on the held-out split (there is no test split).
    evals = eval_records(tmp_path)
    assert [(r["iteration"], r["eval_split"]) for r in evals] == [(12, "valid")]
    assert math.isfinite(evals[0]["eval_loss"]) and evals[0]["eval_tokens"] > 0
    padded_vocab = params["embedding.word_embeddings.weight"].shape[0]
    assert padded_vocab == 512  # 400 WordPiece tokens + [BOS]/[EOS], padded to 128
    # Starts near uniform masked LM + coin-flip sentence order, and learns.
    assert losses[0] == pytest.approx(math.log(padded_vocab) + math.log(2), abs=0.4)
    assert numpy.mean(losses[-3:]) < losses[0] - 0.3, losses


def _corpus_argv(root: Path, tmp: Path, *tokenizer: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "64",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-2",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-threads", "1", "--log-interval", "1",
            "--pipeline-executor", "emulator", "--pipeline-model-parallel-size", "2", "--split", "98,2,0",
            "--data-path", str(root / "docs_text_sentence"), "--data-cache-path", str(root / "cache"),
            "--log-json", str(tmp / "log.jsonl"), *tokenizer]


def test_bert_trains_with_hugging_face_wordpiece_tokenizer(bert_corpus, tmp_path: Path, monkeypatch):
    """tools/train_tokenizer.py --wordpiece also writes a tokenizer.json naming BERT's special
    tokens; it encodes like wordpiece-vocab.txt and drives BERT's masked-LM dataset."""
    from megatron.trainer.tokenizer import build_tokenizer

    root, _ = bert_corpus
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(root / "tok" / "wordpiece"))
    wp = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(root / "tok" / "wordpiece-vocab.txt"))
    text = "The assignment statement binds names to objects."
    assert hf.tokenize(text) == wp.tokenize(text)
    assert (hf.cls, hf.sep, hf.mask, hf.pad) == (wp.cls, wp.sep, wp.mask, wp.pad)
    emulate(_corpus_argv(root, tmp_path, "--tokenizer-type", "HuggingFaceTokenizer",
                         "--tokenizer-model", str(root / "tok" / "wordpiece")), BertTask())
    losses = [json.loads(line)["loss"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(map(math.isfinite, losses))


def test_bert_data_errors_are_one_line(bert_corpus, tmp_path: Path, capsys, monkeypatch):
    """A tokenizer without BERT's special tokens, and unsplit documents (one sentence each)
    with the sentence-order head, fail before any rank starts."""
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_args
    from tools.preprocess_data import main as preprocess

    root, _ = bert_corpus
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)

    def error(argv: list[str]) -> str:
        parser = build_parser()
        BertTask().add_arguments(parser)
        with pytest.raises(SystemExit):
            parse_args(argv, parser)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    bpe = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok")]
    assert "BERT needs [CLS], [SEP], [MASK] and [PAD]" in error(_corpus_argv(root, tmp_path, *bpe))
    vocab = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(root / "tok" / "wordpiece-vocab.txt")]
    src = tmp_path / "one.jsonl"
    src.write_text("".join(json.dumps({"text": f"Document {i} has one sentence only."}) + "\n" for i in range(40)))
    assert preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "one"), *vocab]) == 0
    argv = _corpus_argv(root, tmp_path, *vocab)
    argv[argv.index("--data-path") + 1] = str(tmp_path / "one_text_document")
    assert "two or more sentences" in error(argv)


def test_evaluation_without_validation_documents_is_refused_up_front(bert_corpus, capsys, monkeypatch):
    """BERT samples need multi-sentence documents; a 2% validation share of 16 documents has
    none, so --eval-interval must fail before any rank starts (not skip evaluation silently)."""
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_args

    root, data = bert_corpus
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    parser = build_parser()
    BertTask().add_arguments(parser)
    base = ["--seq-length", "64", "--split", "98,2,0", *data]
    parse_args(base, parser)  # fine without evaluation
    with pytest.raises(SystemExit):
        parse_args([*base, "--eval-interval", "5"], parser)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no document of the validation split" in err[0]
