"""A Hugging Face ``transformers`` model directory as a Megatron-Async checkpoint.

The inverse of :mod:`megatron.trainer.hf.export`, so a model trained elsewhere (or exported
here and changed) fine-tunes with ``--load CKPT --finetune``. The same two architectures, by
the same rules read backwards, each refused with one line when the model computes something
ours does not (GPT-2's tanh GeLU ``gelu_new``, scaled rope, attention biases in a Llama, ...):

* the signature comes from the transformers config, with the layout asked for
  (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``) and ``imported_from``,
  which marks a weights-only checkpoint: no optimizer state, RNG or data position, so a load
  without ``--finetune`` is refused, and run settings the weights do not fix (sequence length,
  precision) are not recorded and not compared (:func:`~megatron.trainer.checkpointing.reshard.unchecked_flags`);
* the weights move by layout only, so import then export gives the same tensors bit for bit:
  q, k, v interleave into megatron's per-group rows, GPT-2's ``Conv1D`` weights transpose back,
  Llama's gate and up stack into SwiGLU's fc1;
* the files are what a run of that layout writes (one per stage and TP rank, each with its TP
  shards, the parameter index and checksums in ``metadata.json``), written through the
  checkpoint's own writer (:func:`~megatron.trainer.checkpointing.checkpoint.write_rank_file`,
  ``publish``), so a load reshards them to any other layout like a run's.

Which parameters a stage holds and how each shards over TP ranks follow megatron's layers
(:data:`COLUMN_PARALLEL`, :data:`ROW_PARALLEL`); ``tests/test_hf_import.py`` checks them against
a trained checkpoint's index.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from megatron.trainer.checkpointing import checkpoint as ckpt
from megatron.trainer.hf.export import _dims, _prefix
from megatron.trainer.models.stage import split_layers
from megatron.trainer.models.tensor_parallel import ShardLayout, take_shard

# Parameter-name endings megatron shards by rows (column-parallel linears, the vocab-parallel
# embedding and output layer) and by columns (row-parallel linears); the rest is replicated.
COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                   "word_embeddings.weight", "output_layer.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
EMBEDDING = "embedding.word_embeddings.weight"


class ImportHFError(ValueError):
    """A model directory that does not convert; one line."""


def signature_of(config: Any, tp: int, pp: int, tokens: int) -> dict[str, Any]:
    """The checkpoint signature of a transformers ``config`` at TP ``tp`` x PP ``pp``
    (``tokens``: the vocabulary, padded to a multiple of ``tp``), as a run's flags record it:
    ``None`` where the run's default gives the same model (no GQA, head dim h / heads, GPT-2's 4h FFN)."""
    kind = config.model_type
    if kind == "gpt2":
        refused = [what for what, bad in (
            (f"activation_function {config.activation_function} (ours is exact GeLU, 'gelu')",
             config.activation_function != "gelu"),
            ("scale_attn_by_inverse_layer_idx", config.scale_attn_by_inverse_layer_idx),
            ("reorder_and_upcast_attn", config.reorder_and_upcast_attn),
            ("scale_attn_weights False", not config.scale_attn_weights)) if bad]
        h, heads, ffn = config.n_embd, config.n_head, config.n_inner
        model = {"num_layers": config.n_layer, "hidden_size": h, "num_attention_heads": heads,
                 "ffn_hidden_size": None if ffn in (None, 4 * h) else ffn, "num_query_groups": None,
                 "kv_channels": None, "max_position_embeddings": config.n_positions, "normalization": "LayerNorm",
                 "position_embedding_type": "learned_absolute", "swiglu": False, "add_bias_linear": True,
                 "norm_epsilon": config.layer_norm_epsilon, "rotary_base": 10000}
    elif kind == "llama":
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        refused = [what for what, bad in (
            (f"hidden_act {config.hidden_act} (ours is SwiGLU, 'silu')", config.hidden_act != "silu"),
            (f"rope_type {rope.get('rope_type')}", rope.get("rope_type", "default") != "default"),
            (f"rope_theta {theta} (ours is an integer --rotary-base)", theta != int(theta)),
            ("attention_bias", config.attention_bias), ("mlp_bias", config.mlp_bias)) if bad]
        h, heads, groups = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        model = {"num_layers": config.num_hidden_layers, "hidden_size": h, "num_attention_heads": heads,
                 "ffn_hidden_size": config.intermediate_size, "num_query_groups": None if groups == heads else groups,
                 "kv_channels": None if head_dim * heads == h else head_dim,
                 "max_position_embeddings": config.max_position_embeddings, "normalization": "RMSNorm",
                 "position_embedding_type": "rope", "swiglu": True, "add_bias_linear": False,
                 "norm_epsilon": config.rms_norm_eps, "rotary_base": int(theta)}
    else:
        raise ImportHFError(f"no Megatron-Async model for a transformers {kind} model (GPT-2 and Llama import)")
    if refused:
        raise ImportHFError(f"transformers {kind} model with {refused[0]}: Megatron-Async computes another model")
    return {**model, "task": "gpt", "vocab_size": tokens, "tokenizer_vocab_size": None, "rotary_percent": 1.0,
            "untie_embeddings_and_output_weights": not config.tie_word_embeddings,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "num_model_chunks": 1,
            "pipeline_layer_split": None, "data_parallel_size": 1, "pipeline_schedule": None,
            "num_microbatches": None, "micro_batch_size": None}


def model_flags(sig: dict[str, Any]) -> list[str]:
    """The trainer flags that build the model of ``sig`` (what ``--load CKPT --finetune`` needs)."""
    flags = ["--num-layers", sig["num_layers"], "--hidden-size", sig["hidden_size"],
             "--num-attention-heads", sig["num_attention_heads"],
             "--max-position-embeddings", sig["max_position_embeddings"], "--vocab-size", sig["vocab_size"],
             "--position-embedding-type", sig["position_embedding_type"], "--normalization", sig["normalization"],
             "--norm-epsilon", sig["norm_epsilon"]]
    flags += ["--ffn-hidden-size", sig["ffn_hidden_size"]] if sig["ffn_hidden_size"] is not None else []
    flags += ["--group-query-attention", "--num-query-groups", sig["num_query_groups"]] \
        if sig["num_query_groups"] is not None else []
    flags += ["--kv-channels", sig["kv_channels"]] if sig["kv_channels"] is not None else []
    flags += ["--swiglu", "--disable-bias-linear", "--rotary-base", sig["rotary_base"]] if sig["swiglu"] else []
    flags += ["--untie-embeddings-and-output-weights"] if sig["untie_embeddings_and_output_weights"] else []
    return [str(f) for f in flags]


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int,
             head_dim: int) -> torch.Tensor:
    """(q, k, v) in head order -> megatron's per-group [q heads, k, v] rows (inverse of
    :func:`megatron.trainer.hf.export.split_qkv`)."""
    per, rest = heads // groups, q.shape[1:]
    blocks = torch.cat([q.reshape(groups, per, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                        v.reshape(groups, 1, head_dim, *rest)], dim=1)
    return blocks.reshape(groups * (per + 2) * head_dim, *rest)


def from_hf(sig: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full state (global names) of a transformers state dict (inverse of
    :func:`megatron.trainer.hf.export.to_hf`)."""
    arch = "gpt2" if sig["normalization"] == "LayerNorm" else "llama"
    heads, groups, head_dim, _ = _dims(sig)
    state: dict[str, torch.Tensor] = {}
    for i in range(sig["num_layers"]):
        p = {k[len(f"{_prefix(arch)}{i}."):]: v for k, v in weights.items() if k.startswith(f"{_prefix(arch)}{i}.")}
        state.update({f"decoder.layers.{i}.{k}": v for k, v in _layer(arch, p, heads, groups, head_dim).items()})
    if arch == "gpt2":
        state.update({EMBEDDING: weights["transformer.wte.weight"],
                      "embedding.position_embeddings.weight": weights["transformer.wpe.weight"],
                      "decoder.final_layernorm.weight": weights["transformer.ln_f.weight"],
                      "decoder.final_layernorm.bias": weights["transformer.ln_f.bias"]})
    else:
        state.update({EMBEDDING: weights["model.embed_tokens.weight"],
                      "decoder.final_layernorm.weight": weights["model.norm.weight"]})
    if sig["untie_embeddings_and_output_weights"]:
        state["output_layer.weight"] = weights["lm_head.weight"]
    return {k: v.contiguous() for k, v in state.items()}


def _layer(arch: str, p: dict[str, torch.Tensor], heads: int, groups: int, head_dim: int) -> dict[str, torch.Tensor]:
    if arch == "llama":
        return {"input_layernorm.weight": p["input_layernorm.weight"],
                "self_attention.linear_qkv.weight": join_qkv(p["self_attn.q_proj.weight"], p["self_attn.k_proj.weight"],
                                                             p["self_attn.v_proj.weight"], heads, groups, head_dim),
                "self_attention.linear_proj.weight": p["self_attn.o_proj.weight"],
                "pre_mlp_layernorm.weight": p["post_attention_layernorm.weight"],
                "mlp.linear_fc1.weight": torch.cat([p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]]),
                "mlp.linear_fc2.weight": p["mlp.down_proj.weight"]}
    width = heads * head_dim
    qkv, qkv_bias = p["attn.c_attn.weight"].t(), p["attn.c_attn.bias"]
    return {"input_layernorm.weight": p["ln_1.weight"], "input_layernorm.bias": p["ln_1.bias"],
            "self_attention.linear_qkv.weight": join_qkv(*qkv.split(width), heads, groups, head_dim),
            "self_attention.linear_qkv.bias": join_qkv(*qkv_bias.split(width), heads, groups, head_dim),
            "self_attention.linear_proj.weight": p["attn.c_proj.weight"].t(),
            "self_attention.linear_proj.bias": p["attn.c_proj.bias"],
            "pre_mlp_layernorm.weight": p["ln_2.weight"], "pre_mlp_layernorm.bias": p["ln_2.bias"],
            "mlp.linear_fc1.weight": p["mlp.c_fc.weight"].t(), "mlp.linear_fc1.bias": p["mlp.c_fc.bias"],
            "mlp.linear_fc2.weight": p["mlp.c_proj.weight"].t(), "mlp.linear_fc2.bias": p["mlp.c_proj.bias"]}


def shard_layout_of(name: str, swiglu: bool) -> ShardLayout | None:
    """How megatron shards the parameter ``name`` over TP ranks (None: replicated)."""
    if name.endswith(COLUMN_PARALLEL):
        return ShardLayout(0, 2 if swiglu and name.endswith("linear_fc1.weight") else 1)
    if name.endswith(ROW_PARALLEL):
        return ShardLayout(1, 1)
    return None


def stage_names(sig: dict[str, Any], state: dict[str, torch.Tensor], stage: int, stages: int) -> list[str]:
    """The global names stage ``stage`` of ``stages`` holds: its layers, the embeddings on the
    first, the final norm and output layer on the last (a tied one: its copy of the embedding)."""
    layers = split_layers(sig["num_layers"], stages)[stage]
    prefixes = tuple(f"decoder.layers.{i}." for i in layers)
    names = [n for n in state if n.startswith(prefixes)]
    if stage == 0:
        names += [n for n in state if n.startswith("embedding.")]
    if stage == stages - 1:
        names += [n for n in state if n.startswith(("decoder.final_layernorm.", "output_layer."))]
        names += [EMBEDDING] if EMBEDDING not in names and not sig["untie_embeddings_and_output_weights"] else []
    return names


def pad_vocabulary(state: dict[str, torch.Tensor], tokens: int) -> None:
    """Zero rows appended to the embedding and output layer up to ``tokens`` (a vocabulary that
    splits over the TP ranks); the logits of those ids are then 0, never trained toward."""
    for name in (EMBEDDING, "output_layer.weight"):
        if name in state and state[name].shape[0] < tokens:
            extra = state[name].new_zeros(tokens - state[name].shape[0], *state[name].shape[1:])
            state[name] = torch.cat([state[name], extra])


def write_checkpoint(sig: dict[str, Any], state: dict[str, torch.Tensor], root: str | Path) -> Path:
    """``state`` as iteration 0 of a checkpoint at ``root`` in the layout ``sig`` names; the
    iteration directory written."""
    tp, pp = sig["tensor_model_parallel_size"], sig["pipeline_model_parallel_size"]
    ckpt.prepare_staging(root, 0)
    for stage in range(pp):
        names = stage_names(sig, state, stage, pp)
        layouts = {n: shard_layout_of(n, sig["swiglu"]) for n in names}
        for rank in range(tp):
            model = {n: take_shard(state[n], layouts[n], rank, tp).clone() for n in names}
            ckpt.write_rank_file(root, 0, stage, 0, {
                "format": ckpt.FORMAT_VERSION, "stage": stage, "model": model,
                "tensor_parallel": {"rank": rank, "size": tp,
                                    "layouts": {n: list(lay) for n, lay in layouts.items() if lay is not None}}})
    return ckpt.publish(root, 0, sig, pp, 1)


def import_hf(source: str | Path, root: str | Path, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """Convert the model directory ``source`` into a checkpoint at ``root`` (TP ``tp``, PP
    ``pp``); return its signature. :class:`ImportHFError` for a model that does not convert."""
    import transformers

    from megatron.trainer.hf.tokenizer import import_tokenizer
    from megatron.trainer.tokenizer.factory import tokenizer_from_record

    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ImportHFError(f"{source}: not a transformers model directory ({str(exc).splitlines()[0]})") from None
    tokens = math.ceil(config.vocab_size / tp) * tp
    sig = signature_of(config, tp, pp, tokens)
    heads, groups, _, _ = _dims(sig)
    for what, count in (("attention heads", heads), ("query groups", groups)):
        if count % tp:
            raise ImportHFError(f"{count} {what} do not split over --tensor-model-parallel-size {tp}")
    if sig["num_layers"] % pp:
        raise ImportHFError(f"{sig['num_layers']} layers do not split evenly over --pipeline-model-parallel-size {pp}")
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    state = from_hf(sig, model.state_dict())
    pad_vocabulary(state, tokens)
    record = import_tokenizer(source, root)
    sig.update(tokenizer=record, imported_from=f"Hugging Face {Path(source).resolve()}",
               tokenizer_vocab_size=None if record is None else tokenizer_from_record(record).vocab_size)
    write_checkpoint(sig, state, root)
    return sig
