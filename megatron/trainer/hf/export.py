"""A Megatron-Async GPT checkpoint as a Hugging Face ``transformers`` model directory.

Two architectures, chosen by what the run trained (anything else is refused with one line):

* GPT-2 (``GPT2LMHeadModel``): learned absolute positions, LayerNorm, GeLU (exact: HF's
  ``activation_function="gelu"``, not GPT-2's tanh approximation), biases, no GQA;
* Llama (``LlamaForCausalLM``): RoPE (whole head, rotate-half as megatron's default), RMSNorm,
  SwiGLU, no biases, GQA allowed.

Weights move by layout only (no arithmetic), so an export is exact: megatron's fused QKV holds,
per query group, that group's query heads then its key head then its value head; HF wants q, k,
v apart (Llama) or q, k, v each whole and concatenated (GPT-2's ``c_attn``), and GPT-2's
``Conv1D`` stores weights as (in, out), the transpose of a linear's. SwiGLU's fc1 is [gate; up].
The output layer is tied (``tie_word_embeddings``) exactly when the run was.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class ExportError(ValueError):
    """A model with no transformers equivalent here; one line."""


def architecture(sig: dict[str, Any]) -> str:
    """``gpt2`` or ``llama`` for the checkpoint's model (its signature), else :class:`ExportError`."""
    if sig.get("task") != "gpt":
        raise ExportError(f"only GPT checkpoints export to Hugging Face (this one is {sig.get('task')})")
    gpt2 = (sig["position_embedding_type"] == "learned_absolute", sig["normalization"] == "LayerNorm",
             not sig.get("swiglu"), sig.get("add_bias_linear", True), sig.get("num_query_groups") in (None, sig["num_attention_heads"]),
             sig.get("kv_channels") in (None, sig["hidden_size"] // sig["num_attention_heads"]))
    if all(gpt2):
        return "gpt2"
    llama = (sig["position_embedding_type"] == "rope", sig["normalization"] == "RMSNorm", sig.get("swiglu"),
             not sig.get("add_bias_linear", True), sig.get("rotary_percent", 1.0) == 1.0)
    if all(llama):
        return "llama"
    raise ExportError("no transformers architecture for this model: GPT-2 needs learned_absolute positions, LayerNorm, "
                      "GeLU and biases; Llama needs rope, RMSNorm, --swiglu and --disable-bias-linear")


def _dims(sig: dict[str, Any]) -> tuple[int, int, int, int]:
    heads = sig["num_attention_heads"]
    groups = sig.get("num_query_groups") or heads
    head_dim = sig.get("kv_channels") or sig["hidden_size"] // heads
    return heads, groups, head_dim, sig.get("ffn_hidden_size") or 4 * sig["hidden_size"]


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Megatron's per-group [q heads, k, v] rows -> (q, k, v), each in head order."""
    per = heads // groups
    blocks = qkv.reshape(groups, per + 2, head_dim, *qkv.shape[1:])
    q, k, v = blocks[:, :per], blocks[:, per], blocks[:, per + 1]
    return (q.reshape(heads * head_dim, *qkv.shape[1:]), k.reshape(groups * head_dim, *qkv.shape[1:]),
            v.reshape(groups * head_dim, *qkv.shape[1:]))


def hf_config(sig: dict[str, Any], arch: str, tokens: int) -> Any:
    """The transformers config of the checkpoint's model (``tokens``: the padded vocabulary)."""
    import transformers

    heads, groups, head_dim, ffn = _dims(sig)
    tied = not sig.get("untie_embeddings_and_output_weights", True)
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=tokens, n_positions=sig["max_position_embeddings"], n_embd=sig["hidden_size"],
            n_layer=sig["num_layers"], n_head=heads, n_inner=ffn, activation_function="gelu",
            layer_norm_epsilon=sig.get("norm_epsilon", 1e-5), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None)  # GPT-2's 50256: not our vocabulary
    return transformers.LlamaConfig(
        vocab_size=tokens, hidden_size=sig["hidden_size"], intermediate_size=ffn, num_hidden_layers=sig["num_layers"],
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
        max_position_embeddings=sig["max_position_embeddings"], rms_norm_eps=sig.get("norm_epsilon", 1e-5),
        rope_theta=float(sig.get("rotary_base", 10000)), attention_bias=False, mlp_bias=False,
        tie_word_embeddings=tied)


def to_hf(sig: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
    """(architecture, the transformers state dict) of a full Megatron-Async state."""
    arch = architecture(sig)
    heads, groups, head_dim, ffn = _dims(sig)
    out: dict[str, torch.Tensor] = {}
    tied = not sig.get("untie_embeddings_and_output_weights", True)
    for i in range(sig["num_layers"]):
        layer = {k[len(f"decoder.layers.{i}."):]: v for k, v in state.items() if k.startswith(f"decoder.layers.{i}.")}
        out.update({f"{_prefix(arch)}{i}.{k}": v for k, v in _layer(arch, layer, heads, groups, head_dim).items()})
    if arch == "gpt2":
        out["transformer.wte.weight"] = state["embedding.word_embeddings.weight"]
        out["transformer.wpe.weight"] = state["embedding.position_embeddings.weight"]
        out["transformer.ln_f.weight"] = state["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = state["decoder.final_layernorm.bias"]
    else:
        out["model.embed_tokens.weight"] = state["embedding.word_embeddings.weight"]
        out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = state["embedding.word_embeddings.weight" if tied else "output_layer.weight"]
    return arch, {k: v.contiguous() for k, v in out.items()}


def _prefix(arch: str) -> str:
    return "transformer.h." if arch == "gpt2" else "model.layers."


def _layer(arch: str, p: dict[str, torch.Tensor], heads: int, groups: int, head_dim: int) -> dict[str, torch.Tensor]:
    q, k, v = split_qkv(p["self_attention.linear_qkv.weight"], heads, groups, head_dim)
    if arch == "llama":
        gate, up = p["mlp.linear_fc1.weight"].chunk(2, dim=0)
        return {"input_layernorm.weight": p["input_layernorm.weight"], "self_attn.q_proj.weight": q,
                "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
                "self_attn.o_proj.weight": p["self_attention.linear_proj.weight"],
                "post_attention_layernorm.weight": p["pre_mlp_layernorm.weight"], "mlp.gate_proj.weight": gate,
                "mlp.up_proj.weight": up, "mlp.down_proj.weight": p["mlp.linear_fc2.weight"]}
    qb, kb, vb = split_qkv(p["self_attention.linear_qkv.bias"], heads, groups, head_dim)
    return {"ln_1.weight": p["input_layernorm.weight"], "ln_1.bias": p["input_layernorm.bias"],
            "attn.c_attn.weight": torch.cat([q, k, v]).t(), "attn.c_attn.bias": torch.cat([qb, kb, vb]),
            "attn.c_proj.weight": p["self_attention.linear_proj.weight"].t(),
            "attn.c_proj.bias": p["self_attention.linear_proj.bias"],
            "ln_2.weight": p["pre_mlp_layernorm.weight"], "ln_2.bias": p["pre_mlp_layernorm.bias"],
            "mlp.c_fc.weight": p["mlp.linear_fc1.weight"].t(), "mlp.c_fc.bias": p["mlp.linear_fc1.bias"],
            "mlp.c_proj.weight": p["mlp.linear_fc2.weight"].t(), "mlp.c_proj.bias": p["mlp.linear_fc2.bias"]}


def export(sig: dict[str, Any], state: dict[str, torch.Tensor], output: str) -> str:
    """Write ``output`` (config and safetensors weights); return the architecture."""
    import transformers

    arch, weights = to_hf(sig, state)
    config = hf_config(sig, arch, state["embedding.word_embeddings.weight"].shape[0])
    cls = transformers.GPT2LMHeadModel if arch == "gpt2" else transformers.LlamaForCausalLM
    model = cls(config)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)
               and not m.endswith(("attn.bias", "attn.masked_bias"))]
    if missing or unexpected:
        raise ExportError(f"transformers {arch} model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.save_pretrained(output)
    check_loadable(cls, model, output)
    return arch


def check_output_dir(output: str) -> None:
    """Refuse an output path that cannot become a model directory (one line), before any work:
    transformers only logs such a path ("should be a directory, not a file") and writes nothing."""
    path = Path(output)
    if path.exists() and not path.is_dir():
        raise ExportError(f"--output {output} is a file; give a directory (new or existing) for the model")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ExportError(f"--output {output}: {parent} is a file, not a directory")
            break


def check_loadable(cls: Any, model: Any, output: str) -> None:
    """Load ``output`` back with transformers and compare every tensor with what was written, so
    the tool says "exported" only of a directory that really holds the model."""
    try:
        loaded = cls.from_pretrained(output)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{output} does not hold a loadable transformers model after the export: {exc}") from exc
    written, read = model.state_dict(), loaded.state_dict()
    differ = [k for k, v in written.items() if k not in read or not torch.equal(v, read[k])]
    if differ:
        raise ExportError(f"{output}: the model read back differs from the one written ({differ[:3]})")
