"""GPT pipeline stages, SDPA core attention and mock data.

The central property: splitting the model into stages changes nothing numerically. A pipeline
composed by hand (detach at every boundary, backward chained through the input gradients, which
is exactly what the runtime does over P2P) must reproduce the unsplit model's loss and
gradients, parameter by parameter, matched by global name.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.trainer.data import MockGPTData
from megatron.trainer.models.gpt import (
    GPTModelArgs,
    GPTStage,
    build_gpt_stage,
    gpt_loss,
    split_layers,
)

pytestmark = pytest.mark.usefixtures("megatron_world1")

SEED = 1234
TINY = GPTModelArgs(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    max_position_embeddings=16,
    vocab_size=128,
)
# Same size, but the other code paths: RMSNorm, rotary embeddings, grouped-query attention.
TINY_ROPE_GQA = GPTModelArgs(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    seq_length=16,
    max_position_embeddings=16,
    vocab_size=128,
    normalization="RMSNorm",
    position_embedding_type="rope",
)


def build_pipeline(
    args: GPTModelArgs, counts: list[int], device: str = "cpu", seed: int = SEED
) -> list[GPTStage]:
    ranges = split_layers(args.num_layers, len(counts), counts)
    last = len(ranges) - 1
    return [
        build_gpt_stage(args, layers, i == 0, i == last, seed, torch.device(device))
        for i, layers in enumerate(ranges)
    ]


def run_pipeline(
    stages: list[GPTStage], batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward one micro-batch through hand-composed stages.

    Returns the loss and the gradients keyed by global parameter name.
    """
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []
    x: torch.Tensor | None = None
    for stage in stages:
        if x is not None:
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        out = stage(x, batch)
        outputs.append(out)
        x = out
    loss, _ = gpt_loss(outputs[-1], batch)
    loss.backward()
    for k in range(len(stages) - 2, -1, -1):
        grad = inputs[k + 1].grad
        assert grad is not None and grad.shape == outputs[k].shape
        outputs[k].backward(grad)
    grads = {
        name: p.grad.detach().clone()
        for stage in stages
        for name, p in stage.global_named_parameters()
    }
    return loss.detach(), grads


def global_params(stages: list[GPTStage]) -> dict[str, torch.Tensor]:
    return {name: p.detach() for s in stages for name, p in s.global_named_parameters()}


# --------------------------------------------------------------------------- split_layers


def test_split_layers_even():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(3, 1) == [range(0, 3)]


def test_split_layers_explicit():
    assert split_layers(6, 3, [1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
    assert split_layers(4, 3, [0, 4, 0]) == [range(0, 0), range(0, 4), range(4, 4)]


@pytest.mark.parametrize(
    "num_layers, num_stages, explicit",
    [
        (6, 4, None),  # not divisible
        (4, 2, [1, 2]),  # wrong total
        (4, 2, [1, 1, 2]),  # wrong length
        (4, 2, [5, -1]),  # negative count
        (0, 1, None),
        (4, 0, None),
    ],
)
def test_split_layers_rejects(num_layers, num_stages, explicit):
    with pytest.raises(ValueError):
        split_layers(num_layers, num_stages, explicit)


# --------------------------------------------------------------------------- GPT stages


def test_stage_shapes_and_flags():
    stages = build_pipeline(TINY, [2, 2])
    batch = MockGPTData(TINY.seq_length, TINY.vocab_size, seed=0).micro_batch([0, 1])
    first, last = stages
    assert (first.is_first, first.is_last) == (True, False)
    assert (last.is_first, last.is_last) == (False, True)
    assert first.layers == range(0, 2) and last.layers == range(2, 4)
    hidden = first(None, batch)
    assert hidden.shape == first.activation_shape(2) == (16, 2, 32)
    assert hidden.is_contiguous() and hidden.dtype == torch.float32
    loss = last(hidden, batch)
    assert loss.shape == (2, 16) and loss.dtype == torch.float32
    # Freshly initialised (std 0.02): close to uniform over the vocabulary.
    assert abs(gpt_loss(loss, batch)[0].item() - math.log(TINY.vocab_size)) < 0.1
    names = {n for n, _ in last.global_named_parameters()}
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in names


def test_build_does_not_consume_global_rng():
    state = torch.get_rng_state()
    build_pipeline(TINY, [4])
    assert torch.equal(state, torch.get_rng_state())


def test_init_follows_megatron_rules():
    (stage,) = build_pipeline(TINY, [4])
    params = dict(stage.global_named_parameters())
    assert torch.all(params["decoder.layers.1.input_layernorm.weight"] == 1)
    assert torch.all(params["decoder.final_layernorm.bias"] == 0)
    assert torch.all(params["decoder.layers.3.mlp.linear_fc1.bias"] == 0)
    # Large tensors so the sample std is a good estimate.
    emb = params["embedding.word_embeddings.weight"]
    fc2 = torch.cat(
        [params[f"decoder.layers.{i}.mlp.linear_fc2.weight"].flatten() for i in range(4)]
    )
    assert emb.std().item() == pytest.approx(0.02, rel=0.1)
    assert fc2.std().item() == pytest.approx(0.02 / math.sqrt(2 * TINY.num_layers), rel=0.1)
    # Different parameters are not copies of one stream.
    a = params["decoder.layers.0.self_attention.linear_qkv.weight"]
    b = params["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert not torch.equal(a, b)


@pytest.mark.parametrize("args", [TINY, TINY_ROPE_GQA], ids=["learned-layernorm", "rope-rms-gqa"])
def test_split_matches_unsplit(args):
    batch = MockGPTData(args.seq_length, args.vocab_size, seed=7).micro_batch([3, 11])
    reference = build_pipeline(args, [args.num_layers])
    ref_params = global_params(reference)
    ref_loss, ref_grads = run_pipeline(reference, batch)
    assert len(ref_grads) == len(ref_params)

    for counts in ([2, 2], [1, 1, 1, 1], [0, 3, 1]):
        stages = build_pipeline(args, counts)
        params = global_params(stages)
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            assert torch.equal(value, ref_params[name]), f"{counts}: init differs for {name}"
        loss, grads = run_pipeline(stages, batch)
        # A split moves layers between modules, not arithmetic: every op sees the same shapes and
        # inputs in the same order, so the comparison is exact on any CPU's kernels.
        assert torch.equal(loss, ref_loss), counts
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), f"{counts} {name}"


def test_seed_changes_init():
    a = global_params(build_pipeline(TINY, [4], seed=1))
    b = global_params(build_pipeline(TINY, [4], seed=2))
    name = "embedding.word_embeddings.weight"
    assert not torch.equal(a[name], b[name])


def test_bf16_stages_on_cpu():
    """bf16 targets GPUs, but building and running it must not break on CPU."""
    args = GPTModelArgs(**{**TINY.__dict__, "bf16": True})
    stages = build_pipeline(args, [2, 2])
    assert all(p.dtype == torch.bfloat16 for s in stages for p in s.parameters())
    batch = MockGPTData(args.seq_length, args.vocab_size, seed=0).micro_batch([0, 1])
    hidden = stages[0](None, batch)
    assert hidden.dtype == torch.bfloat16 == stages[0].activation_dtype
    loss, grads = run_pipeline(stages, batch)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(args.vocab_size)) < 0.2
    assert all(torch.isfinite(g).all() for g in grads.values())


# --------------------------------------------------------------------------- SDPA attention


def _attention(num_heads: int, num_groups: int, mask_type, dropout: float = 0.0):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.trainer.models.sdpa_attention import SDPAAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8 * num_heads,
        num_attention_heads=num_heads,
        num_query_groups=num_groups,
        attention_dropout=dropout,
        use_cpu_initialization=True,
        cuda_graph_scope=[],
    )
    return SDPAAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self")


def _reference_attention(q, k, v, additive_mask):
    """softmax(Q K^T / sqrt(d) + mask) V, with Megatron's [s, b, n, d] layout and GQA mapping."""
    groups = q.size(2) // k.size(2)
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(q.size(-1))
    probs = torch.softmax(scores + additive_mask, dim=-1)
    context = torch.einsum("bnst,tbnd->sbnd", probs, v)
    return context.reshape(q.size(0), q.size(1), -1)


def _qkv(s=6, b=3, heads=4, groups=2, d=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, d, generator=g)
    k = torch.randn(s, b, groups, d, generator=g)
    v = torch.randn(s, b, groups, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_sdpa_causal_matches_reference(groups):
    from megatron.core.transformer.enums import AttnMaskType

    attn = _attention(4, groups, AttnMaskType.causal)
    q, k, v = _qkv(groups=groups)
    out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    causal = torch.triu(torch.full((6, 6), float("-inf")), diagonal=1)
    assert out.shape == (6, 3, 32)
    torch.testing.assert_close(out, _reference_attention(q, k, v, causal), rtol=1e-5, atol=1e-6)
    # attn_mask_type defaults to the constructor's.
    torch.testing.assert_close(attn(q, k, v, None), out)


def test_sdpa_padding_mask_matches_reference():
    from megatron.core.transformer.enums import AttnMaskType

    attn = _attention(4, 2, AttnMaskType.padding)
    q, k, v = _qkv()
    # BERT-style: sample b has valid[b] real tokens; mask is True where query or key is padding.
    valid = torch.tensor([6, 4, 2])
    real = torch.arange(6)[None, :] < valid[:, None]  # [b, s]
    mask = ~(real[:, None, :, None] & real[:, None, None, :])  # [b, 1, s, s], True = masked out
    out = attn(q, k, v, mask, attn_mask_type=AttnMaskType.padding)
    additive = mask.float() * -10000.0
    torch.testing.assert_close(out, _reference_attention(q, k, v, additive), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()
    # On real query rows this is also Megatron's masked_fill(-10000) softmax, i.e. keys that
    # are padding get exactly zero weight: perturbing them leaves those rows unchanged.
    v2 = v.clone()
    v2[4:, 1] += 100.0
    out2 = attn(q, k, v2, mask)
    torch.testing.assert_close(out2[:4, 1], out[:4, 1])


def test_sdpa_mask_overrides_causal_type():
    """Megatron uses a given mask as is, even for a causal layer (the mask carries causality)."""
    from megatron.core.transformer.enums import AttnMaskType

    attn = _attention(4, 4, AttnMaskType.causal)
    q, k, v = _qkv(groups=4)
    no_mask = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    out = attn(q, k, v, no_mask)
    expected = _reference_attention(q, k, v, torch.zeros(6, 6))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_sdpa_dropout_only_in_training():
    from megatron.core.transformer.enums import AttnMaskType

    attn = _attention(4, 4, AttnMaskType.causal, dropout=0.5)
    q, k, v = _qkv(groups=4)
    attn.eval()
    causal = torch.triu(torch.full((6, 6), float("-inf")), diagonal=1)
    expected = _reference_attention(q, k, v, causal)
    torch.testing.assert_close(attn(q, k, v, None), expected, rtol=1e-5, atol=1e-6)
    attn.train()
    assert not torch.allclose(attn(q, k, v, None), expected)


def test_rope_is_device_agnostic_and_stays_fp32():
    from megatron.trainer.models.rope import DeviceAgnosticRotaryEmbedding

    rope = DeviceAgnosticRotaryEmbedding(8, 1.0, use_cpu_initialization=True)
    emb = rope(5)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    angles = torch.arange(5, dtype=torch.float32)[:, None] * inv_freq
    assert emb.shape == (5, 1, 1, 8)
    torch.testing.assert_close(emb[:, 0, 0], torch.cat((angles, angles), dim=-1))
    rope.bfloat16()
    assert rope.inv_freq.dtype == torch.float32  # megatron keeps rotary frequencies in fp32
    rope.to("meta")
    assert rope.inv_freq.device.type == "meta" and rope(5).device.type == "meta"
    interleaved = DeviceAgnosticRotaryEmbedding(
        8, 1.0, rotary_interleaved=True, use_cpu_initialization=True
    )
    expected = torch.stack((angles, angles), dim=-1).reshape(5, 8)
    torch.testing.assert_close(interleaved(5)[:, 0, 0], expected)


def test_transformer_engine_auto_off_without_cuda():
    from megatron.trainer.models.gpt import resolve_use_transformer_engine

    assert resolve_use_transformer_engine(False) is False
    if not torch.cuda.is_available():
        assert resolve_use_transformer_engine(None) is False


def test_gpt_stage_uses_sdpa_on_cpu():
    from megatron.trainer.models.sdpa_attention import SDPAAttention

    (stage,) = build_pipeline(TINY, [4])
    kinds = {type(m) for m in stage.modules()}
    assert SDPAAttention in kinds


# --------------------------------------------------------------------------- mock data


def test_mock_data_is_deterministic():
    a = MockGPTData(16, 128, seed=5)
    b = MockGPTData(16, 128, seed=5)
    c = MockGPTData(16, 128, seed=6)
    for index in (0, 1, 999):
        sa, sb = a.sample(index), b.sample(index)
        assert all(torch.equal(sa[key], sb[key]) for key in sa)
    assert not torch.equal(a.micro_batch(range(8))["tokens"], c.micro_batch(range(8))["tokens"])
    assert not torch.equal(a.sample(0)["tokens"], a.sample(1)["tokens"])
    # Micro-batches are stacks of samples, whatever the order they are requested in.
    mb = a.micro_batch([7, 3])
    assert torch.equal(mb["tokens"][1], a.sample(3)["tokens"])


def test_mock_data_format():
    data = MockGPTData(16, 128, seed=0)
    mb = data.micro_batch([0, 1, 2])
    assert set(mb) == {"tokens", "labels", "loss_mask", "position_ids"}
    for key in ("tokens", "labels", "position_ids"):
        assert mb[key].shape == (3, 16) and mb[key].dtype == torch.int64
    assert mb["loss_mask"].shape == (3, 16) and mb["loss_mask"].dtype == torch.float32
    assert torch.equal(mb["tokens"][:, 1:], mb["labels"][:, :-1])  # labels are shifted tokens
    assert int(mb["tokens"].min()) >= 0 and int(mb["tokens"].max()) < 128
    assert torch.equal(mb["position_ids"][2], torch.arange(16))


def test_loss_falls_on_mock_data():
    args = GPTModelArgs(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        max_position_embeddings=16,
        vocab_size=64,
    )
    stages = build_pipeline(args, [1, 1])
    data = MockGPTData(args.seq_length, args.vocab_size, seed=3)
    params = [p for s in stages for p in s.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for step in range(50):
        batch = data.micro_batch(range(step * 8, step * 8 + 8))
        optimizer.zero_grad()
        loss, _ = run_pipeline(stages, batch)
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 0.9 * math.log(args.vocab_size)
    # Starts at ln(64) ~ 4.16 and ends near 2.1 after 50 steps; a wide margin keeps this robust
    # to kernel-level numeric differences across torch builds.
    assert last < first - 1.0, losses


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_bf16_stage_on_cuda():
    args = GPTModelArgs(**{**TINY.__dict__, "bf16": True})
    stages = build_pipeline(args, [2, 2], device="cuda")
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for s in stages for p in s.parameters())
    cpu_batch = MockGPTData(args.seq_length, args.vocab_size, 0).micro_batch([0, 1])
    batch = {k: v.cuda() for k, v in cpu_batch.items()}
    hidden = stages[0](None, batch)
    assert hidden.is_cuda and hidden.dtype == torch.bfloat16 and hidden.shape == (16, 2, 32)
    loss, grads = run_pipeline(stages, batch)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(args.vocab_size)) < 0.2
    assert all(g.is_cuda and torch.isfinite(g).all() for g in grads.values())


def test_attention_dropout_masks_differ_per_tensor_parallel_rank():
    """At TP > 1 each rank holds other heads, so (as Megatron's model-parallel RNG) their
    attention-dropout masks must differ; the stage stream must still advance identically on
    every TP rank (the replicated region's dropout stays equal), and a rank's masks repeat when
    the stream is restored (resume, recompute)."""
    from megatron.core.transformer.enums import AttnMaskType

    attn = _attention(4, 4, AttnMaskType.causal, dropout=0.5)
    attn.train()
    q, k, v = _qkv(groups=4)

    def run(rank):
        attn.tp_rank = rank
        torch.manual_seed(1234)
        out = attn(q, k, v, None)
        return out, torch.get_rng_state()

    out0, after0 = run(0)
    out1, after1 = run(1)
    again1, _ = run(1)
    shared, after_shared = run(None)  # TP = 1: the stage stream itself
    assert not torch.equal(out0, out1)
    assert torch.equal(out1, again1)
    assert torch.equal(after0, after1)  # the stage stream advanced alike on both ranks
    assert not torch.equal(after0, after_shared)  # one draw seeds the rank's stream ...
    torch.manual_seed(1234)
    torch.randint(0, 2**62, (1,))
    assert torch.equal(torch.get_rng_state(), after0)  # ... and nothing else moves it
