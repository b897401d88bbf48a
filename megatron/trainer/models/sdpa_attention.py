"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` is CUDA-bound (its score buffer comes from a global
memory buffer on ``torch.cuda.current_device()``, its dropout forks the CUDA RNG tracker, and its
default causal mask is built on ``"cuda"``). This module is a drop-in replacement for the
``core_attention`` slot of megatron-core's layer specs: same constructor keywords, same forward
arguments, same maths (scale, GQA head mapping, Megatron's bool mask convention), but it runs on
any device and lets PyTorch pick a fused kernel (flash / memory-efficient) where one exists.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

# Megatron masks scores with -10000 (``attention_mask_func``) rather than -inf, so a query row
# whose keys are all masked (BERT padding rows) yields finite probabilities instead of NaN.
# We use the same finite constant for the same reason.
MASKED_SCORE = -10000.0

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


def _tp_rank_and_size(pg_collection: Any) -> tuple[int, int]:
    """This process's tensor-parallel rank and the TP width ((0, 1) without a TP group), without
    requiring megatron's parallel state for standalone use."""
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp.rank(), pg_collection.tp.size()
    if parallel_state.model_parallel_is_initialized():
        return (parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_world_size())
    return 0, 1


@contextlib.contextmanager
def tensor_parallel_dropout_stream(device: torch.device, tp_rank: int) -> Iterator[None]:
    """Draw dropout masks from a stream of this TP rank's own, as Megatron's model-parallel RNG
    does for attention dropout: each TP rank holds other heads, and heads must not share masks.

    Why derived from the current stream rather than a second seeded generator: one value is
    drawn from the device's current generator (the stage's stream, advanced identically on
    every TP rank, so the replicated region's dropout stays equal across TP ranks) and seeds
    ``value + tp_rank`` for the duration. Everything that restores the stage stream (resume,
    recompute's RNG restore, the emulator's per-stage isolation) therefore repeats these masks
    too, with no extra state to checkpoint.
    """
    base = int(torch.randint(0, 2**62, (1,), device=device).item())
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index]):
            torch.cuda.default_generators[index].manual_seed(base + tp_rank)
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(base + tp_rank)
            yield


def megatron_mask_to_sdpa(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Convert a Megatron attention mask to an additive SDPA mask.

    Megatron's masks are bool with True = "masked out"; SDPA's bool masks mean the opposite and,
    worse, turn fully masked rows into NaN. An additive float mask with Megatron's finite
    constant reproduces Megatron's numerics exactly for every row that has an unmasked key.
    Float masks are taken to be additive already and are only cast.
    """
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, MASKED_SCORE
        )
    return mask.to(dtype)


class SDPAAttention(MegatronModule):
    """Device-agnostic core attention with ``DotProductAttention``'s interface.

    Inputs are ``[s, b, heads, head_dim]`` (keys/values may have fewer heads: GQA);
    output is ``[s, b, heads * head_dim]``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPAAttention does not support context parallelism")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"softmax_type={config.softmax_type!r} is not supported")
        window = is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        )
        if window:
            raise NotImplementedError("sliding-window attention is not supported")

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        tp_rank, tp = _tp_rank_and_size(pg_collection)
        # Attention dropout at TP > 1 draws per-TP-rank masks (tensor_parallel_dropout_stream).
        self.tp_rank = tp_rank if tp > 1 else None
        self.num_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = config.num_query_groups // tp
        if self.num_heads_per_partition % self.num_query_groups_per_partition:
            raise ValueError("attention heads must be a multiple of query groups")
        self.head_dim = config.kv_channels
        # Megatron's query-key layer scaling divides the scores by layer_number and multiplies
        # them back inside the softmax; the net scale is the plain one, so we ignore it.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Attend ``query`` to ``key``/``value``; mask semantics follow Megatron's torch softmax.

        A given mask is used as is (Megatron assumes it already contains any causal part);
        without a mask, causal mask types get SDPA's ``is_causal`` (top-left aligned, which is
        Megatron's ``triu(ones, 1)``) and other types attend everywhere.
        """
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences are not supported by SDPAAttention")
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPAAttention")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type

        groups = query.size(2) // key.size(2)
        if groups > 1:
            # Query head i reads key/value group i // groups, as in Megatron's repeat_interleave.
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)

        # [s, b, n, d] -> [b, n, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)

        sq, sk = q.size(2), k.size(2)
        is_causal = attention_mask is None and mask_type in _CAUSAL_TYPES and sq > 1
        if is_causal and sq != sk:
            raise ValueError("causal attention without a mask needs equal query/key lengths")
        attn_mask = (
            None if attention_mask is None else megatron_mask_to_sdpa(attention_mask, q.dtype)
        )

        dropout_p = self.dropout_p if self.training else 0.0
        per_rank = dropout_p > 0 and self.tp_rank is not None
        with tensor_parallel_dropout_stream(q.device, self.tp_rank) if per_rank else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
            )
        # [b, n, s, d] -> [s, b, n * d]
        b, n, s, d = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, n * d)
