"""Megatron-LM's model options (--swiglu, --disable-bias-linear, --normalization RMSNorm,
--group-query-attention, --kv-channels, --norm-epsilon, --rotary-base/--rotary-percent,
--position-embedding-type none, --untie-embeddings-and-output-weights) build the model they
name, for GPT and BERT, and a pipelined run with them equals a non-pipelined one.
"""
from __future__ import annotations

import pytest
import torch

from megatron.trainer.config.arguments import build_parser
from megatron.trainer.plan.parse import parse_run_plan
from megatron.trainer.tasks.bert import BertTask
from megatron.trainer.tasks.gpt import GPTTask
from tests.adam_bounds import assert_within_bounds, gpt_gradient_noise, trace_adam
from tests.async_helpers import emulate

pytestmark = pytest.mark.usefixtures("megatron_world1")

H, HEADS = 32, 4
BASE = ["--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", str(HEADS), "--seq-length", "16",
        "--vocab-size", "64", "--micro-batch-size", "1", "--device", "cpu", "--hidden-dropout", "0",
        "--attention-dropout", "0"]
# gpt_gradient_noise's dimensions for BASE at --global-batch-size 2: layers, hidden, the widest FFN
# (4 H without --swiglu, 2 x 64 with it), vocabulary, tokens per step.
_DIMS = (2, H, 4 * H, 64, 16 * 2)


def _build(task, *flags: str) -> dict[str, torch.nn.Module | torch.Tensor]:
    """The single stage's megatron-core model and its parameters by global name."""
    parser = build_parser()
    task.add_arguments(parser)
    config = parse_run_plan([*BASE, *flags], parser)
    (chunk,) = task.build_stage(config, 0, torch.device("cpu"))
    return {"model": chunk.model, **{name: p for name, p in chunk.global_named_parameters()}}


@pytest.mark.parametrize("task", [GPTTask(), BertTask()], ids=["gpt", "bert"])
def test_swiglu_doubles_fc1_and_gates_with_silu(task):
    block = "decoder" if task.name == "gpt" else "encoder"
    fc1, fc2 = f"{block}.layers.0.mlp.linear_fc1.weight", f"{block}.layers.0.mlp.linear_fc2.weight"
    assert _build(task)[fc1].shape == (4 * H, H)
    gated = _build(task, "--swiglu")
    ffn = int((4 * H * 2 / 3) / 64) * 64  # Megatron-LM's default ffn size under --swiglu
    assert gated[fc1].shape == (2 * ffn, H) and gated[fc2].shape == (H, ffn)
    assert _build(task, "--swiglu", "--ffn-hidden-size", "48")[fc1].shape == (2 * 48, H)
    config = gated["model"].config
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu


@pytest.mark.parametrize("task", [GPTTask(), BertTask()], ids=["gpt", "bert"])
def test_disable_bias_linear_removes_linear_biases(task):
    plain, nobias = _build(task), _build(task, "--disable-bias-linear")
    linear_bias = [n for n in plain if n.endswith("bias") and ("linear_" in n)]
    assert linear_bias  # the default has them
    assert not [n for n in nobias if n.endswith("bias") and "linear_" in n]
    assert [n for n in nobias if n.endswith("layernorm.bias")]  # norms keep theirs


@pytest.mark.parametrize("task", [GPTTask(), BertTask()], ids=["gpt", "bert"])
def test_rmsnorm_and_epsilon(task):
    model = _build(task, "--normalization", "RMSNorm", "--norm-epsilon", "1e-6")["model"]
    rms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert rms and all(m.eps == 1e-6 for m in rms)
    assert not [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]


@pytest.mark.parametrize("task", [GPTTask(), BertTask()], ids=["gpt", "bert"])
def test_gqa_and_kv_channels_shape_qkv(task):
    block = "decoder" if task.name == "gpt" else "encoder"
    qkv = f"{block}.layers.0.self_attention.linear_qkv.weight"
    assert _build(task)[qkv].shape == (3 * H, H)
    # Megatron's --group-query-attention without --num-query-groups: one group.
    assert _build(task, "--group-query-attention")[qkv].shape == ((HEADS + 2) * H // HEADS, H)
    assert _build(task, "--group-query-attention", "--num-query-groups", "2")[qkv].shape == ((HEADS + 4) * 8, H)
    kv = _build(task, "--kv-channels", "16")
    assert kv[qkv].shape == (3 * HEADS * 16, H)
    assert kv[f"{block}.layers.0.self_attention.linear_proj.weight"].shape == (H, HEADS * 16)


def test_rope_base_and_percent_reach_the_rotary_embedding():
    rope = _build(GPTTask(), "--position-embedding-type", "rope", "--rotary-base", "500000",
                  "--rotary-percent", "0.5")["model"].rotary_pos_emb
    head = H // HEADS
    dim = int(head * 0.5)
    expected = 1.0 / (500000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    torch.testing.assert_close(rope.inv_freq.cpu(), expected)


def test_position_embedding_none_has_no_position_parameters():
    params = _build(GPTTask(), "--position-embedding-type", "none")
    assert "embedding.position_embeddings.weight" not in params
    assert "embedding.position_embeddings.weight" in _build(GPTTask())


def test_untied_output_layer_is_its_own_weight():
    params = _build(GPTTask(), "--untie-embeddings-and-output-weights")
    out, emb = params["output_layer.weight"], params["embedding.word_embeddings.weight"]
    assert out.shape == emb.shape and out.data_ptr() != emb.data_ptr() and not torch.equal(out, emb)


@pytest.mark.parametrize("task", [GPTTask(), BertTask()], ids=["gpt", "bert"])
def test_tied_by_default_one_stage_has_one_weight(task):
    """Megatron-LM's default: the output layer reads the embedding's weight (no parameter of its own)."""
    tied = _build(task)
    assert "output_layer.weight" not in tied and tied["model"].output_layer.weight is None
    assert tied["model"].shared_embedding_or_output_weight() is tied["embedding.word_embeddings.weight"]
    untied = _build(task, "--untie-embeddings-and-output-weights")
    assert set(untied) - set(tied) == {"output_layer.weight"}


ALL_OPTIONS = ["--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--group-query-attention",
               "--num-query-groups", "1", "--position-embedding-type", "rope", "--rotary-base", "1000",
               "--rotary-percent", "0.5", "--norm-epsilon", "1e-6", "--kv-channels", "16",
               "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("task,options", [
    (GPTTask(), ALL_OPTIONS),
    (BertTask(), [o for o in ALL_OPTIONS if o not in ("--rotary-base", "1000")]),
], ids=["gpt", "bert"])
def test_pipelined_run_equals_unpipelined_with_options(task, options):
    """1F1B over 2 stages reproduces 1 stage: final parameters, all options on, each element within
    the bound tests/adam_bounds.py derives from the one-stage run's Adam steps (the stages sum the
    gradient norm in another order)."""
    def run(stages: int) -> tuple[dict[str, torch.Tensor], list]:
        argv = [*BASE, "--pipeline-model-parallel-size", str(stages), "--pipeline-executor", "emulator",
                "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-2", "--log-interval", "1",
                "--num-threads", "1", *options]
        workers = emulate(argv, task)
        named = [(n, p) for w in workers for n, p in task.named_parameters(w.setup.chunks)]
        return {n: p.detach().clone() for n, p in named}, named

    with trace_adam() as trace:
        one, named = run(1)
    two, _ = run(2)
    rho = gpt_gradient_noise(*_DIMS)
    assert_within_bounds(two, one, {n: trace.bound(n, p, rho) for n, p in named})
    initial = _build(task, *options)
    moved = 0
    for name, value in one.items():
        moved += not torch.equal(value, initial[name])
    assert moved == len(one)  # training changed every tensor: the comparison is not vacuous


@pytest.mark.parametrize("backend", ["local", "unfused"])
def test_local_attention_backends_run_our_sdpa_attention(backend):
    """Megatron's unfused/local maths is what our SDPA core attention computes: same model."""
    from megatron.trainer.models.sdpa_attention import SDPAAttention

    auto, chosen = _build(GPTTask()), _build(GPTTask(), "--attention-backend", backend)
    attention = [type(m) for m in chosen["model"].modules() if "Attention" in type(m).__name__]
    assert SDPAAttention in attention
    assert all(torch.equal(auto[n], p) for n, p in chosen.items() if n != "model")
