"""Text generation from a checkpoint of any layout, in one process (``tools/generate.py``).

The checkpoint's whole model is read at full shape (:func:`~megatron.trainer.checkpointing.full_state.read_full_state`
joins every stage's and TP rank's files), so whatever split, TP size or schedule trained it,
generation builds one stage holding every layer (the emulator's stage model, pre- and
post-processing in one megatron-core ``GPTModel``) on the CPU or one GPU. No pipeline runtime,
no process group beyond megatron's trivial world of one.

Each new token recomputes the whole sequence (no KV cache): megatron-core's inference path
(0.16: ``StaticInferenceContext`` passed as ``inference_context``) allocates each layer's KV
cache with ``device=torch.cuda.current_device()`` (``Attention._allocate_memory``), so on the
CPU the first forward fails ("Torch not compiled with CUDA enabled"); one code path for both
devices keeps CPU and GPU outputs the same computation. Recomputing costs O(n^2) token
positions for n tokens, which suits the checks and short samples this tool is for, and the
logits are exactly the training forward's.

Sampling is greedy (``argmax``, the first maximum as ``torch.argmax`` and transformers' greedy
search pick) or temperature, top-k then top-p (nucleus) filtering and a draw from a seeded
generator, so a seed reproduces a sample. Ids past the tokenizer's vocabulary (Megatron's
padding rows) are never chosen when the run had a tokenizer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Signature entries that build the model (as :class:`~megatron.trainer.models.gpt.GPTModelArgs` fields).
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "vocab_size",
                "ffn_hidden_size", "num_query_groups", "normalization", "position_embedding_type", "swiglu",
                "add_bias_linear", "norm_epsilon", "kv_channels", "rotary_base", "rotary_percent")


class GenerationError(ValueError):
    """A request that cannot be generated; one line."""


def ensure_megatron_world() -> None:
    """megatron-core's layers look up their (trivial) TP group when built: a gloo world of one
    with an in-memory store (no port) and megatron's parallel state at TP = PP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def full_model(sig: dict[str, Any], state: dict[str, torch.Tensor],
               device: torch.device | str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The checkpoint's GPT as one stage: ``tokens [b, s] -> logits [b, s, vocab]`` (eval mode,
    weights of ``state`` copied in by global name)."""
    from megatron.trainer.models.gpt import GPTModelArgs, build_gpt_stage

    if sig.get("task") != "gpt":
        raise GenerationError(f"only GPT checkpoints generate text (this one is {sig.get('task')})")
    ensure_megatron_world()
    fields = {k: sig[k] for k in MODEL_FIELDS if k in sig}
    args = GPTModelArgs(**fields, seq_length=sig.get("seq_length") or sig["max_position_embeddings"],
                        tie_embeddings=not sig.get("untie_embeddings_and_output_weights", True))
    stage = build_gpt_stage(args, range(sig["num_layers"]), True, True, 0, device)
    stage.eval()
    with torch.no_grad():
        for name, p in stage.global_named_parameters():
            p.copy_(state[name])

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(device)
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        with torch.no_grad():
            return stage.model(input_ids=tokens, position_ids=positions, attention_mask=None)

    return logits


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy, or temperature / top-k / top-p with a seed."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0      # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0

    def check(self) -> None:
        if self.temperature <= 0:
            raise GenerationError(f"--temperature must be > 0, got {self.temperature} (use --greedy for argmax)")
        if self.top_k < 0:
            raise GenerationError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"--top-p must be in (0, 1], got {self.top_p}")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The next id per row of ``logits [b, vocab]`` (fp32, on the CPU: the seeded generator's device)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    scores = logits / sampling.temperature
    if sampling.top_k:
        kth = scores.topk(min(sampling.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = scores.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)  # mass above each id
        drop = (before >= sampling.top_p).scatter(-1, order, before >= sampling.top_p)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(logits_of: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], new_tokens: int,
             sampling: Sampling, max_length: int, usable: int | None = None) -> list[int]:
    """``new_tokens`` ids after ``prompt`` (full recompute per token, see the module docstring).
    ``max_length``: the model's positions; ``usable``: ids below it may be chosen (None: all)."""
    sampling.check()
    if not prompt:
        raise GenerationError("the prompt is empty (give at least one token)")
    if len(prompt) + new_tokens > max_length:
        raise GenerationError(f"{len(prompt)} prompt + {new_tokens} new tokens exceed the model's "
                              f"{max_length} positions (--max-position-embeddings)")
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens = torch.tensor([prompt], dtype=torch.long)
    out: list[int] = []
    for _ in range(new_tokens):
        logits = logits_of(tokens)[:, -1].float().cpu()
        if usable is not None and usable < logits.shape[-1]:
            logits[:, usable:] = float("-inf")
        token = next_token(logits, sampling, generator)
        out.append(int(token[0]))
        tokens = torch.cat([tokens, token[:, None]], dim=1)
    return out
