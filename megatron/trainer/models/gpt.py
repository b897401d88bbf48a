"""A megatron-core ``GPTModel`` cut into pipeline stages for our own runtime.

Megatron's parallel state is initialised with pipeline size 1 (our runtime does the pipelining),
so each stage is a complete ``GPTModel`` whose ``TransformerConfig.num_layers`` is the number of
layers *of that stage*, with ``pre_process`` / ``post_process`` marking the first / last stage.
Parameters are then re-initialised from their *global* names so that every way of splitting the
model starts from the same weights: a 4-stage run is comparable, bit for bit in fp32, with a
1-stage run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.trainer.models.sequence_parallel import block_spec
from megatron.trainer.models.stage import (
    PipelineStage,
    TransformerArgs,
    build_stage,
    init_value,
    layer_spec,
    resolve_use_transformer_engine,
    split_layers,
)

__all__ = [
    "GPTModelArgs", "GPTStage", "build_gpt_stage", "gpt_loss",
    # shared with other model families, re-exported for GPT-facing callers
    "init_value", "resolve_use_transformer_engine", "split_layers",
]


@dataclass
class GPTModelArgs(TransformerArgs):
    """Architecture of the whole (unsplit) GPT model (see :class:`TransformerArgs`)."""


class GPTStage(PipelineStage):
    """One pipeline stage of a megatron-core ``GPTModel``.

    The runtime sees a uniform interface: ``forward(input_tensor, batch)`` where the first stage
    ignores ``input_tensor`` (it embeds ``batch["tokens"]``) and the last stage returns the
    per-token LM loss instead of hidden states.
    """

    block = "decoder"

    def forward(
        self, input_tensor: torch.Tensor | None, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Hidden states ``[s, b, h]`` (contiguous), or the per-token loss ``[b, s]`` in fp32 on
        the last stage."""
        if self.is_first:
            input_ids, position_ids = batch["tokens"], batch["position_ids"]
        else:
            if input_tensor is None:
                raise ValueError("a non-first stage needs the previous stage's hidden states")
            input_ids, position_ids = None, batch.get("position_ids")
            self.set_stage_input(input_tensor)
        try:
            output = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=batch.get("attention_mask"),
                labels=batch["labels"] if self.is_last else None,
            )
        finally:
            if not self.is_first:
                self.set_stage_input(None)
        if self.is_last:
            return output.float()
        return output.contiguous()


def build_gpt_stage(
    args: GPTModelArgs,
    layers: range,
    pre_process: bool,
    post_process: bool,
    seed: int,
    device: torch.device | str,
) -> GPTStage:
    """Build the stage owning global ``layers``; weights depend only on ``seed`` and names."""

    def make(config: TransformerConfig, use_te: bool) -> GPTModel:
        return GPTModel(
            config=config,
            transformer_layer_spec=block_spec(layer_spec(args, use_te), config),
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            # Tied: megatron's own sharing within a chunk; across stages our runtime sums the
            # copies' gradients (megatron.pipeline.runtime.tied_embeddings).
            share_embeddings_and_output_weights=args.tie_embeddings,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
        )

    wrap: Callable[[torch.nn.Module], GPTStage] = lambda model: GPTStage(args, layers, model)
    return build_stage(args, layers, seed, device, make, wrap)  # type: ignore[return-value]


def gpt_loss(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Megatron's per-micro-batch loss: ``sum(loss * mask) / sum(mask)`` and the token count."""
    loss_mask = batch["loss_mask"].to(device=output.device, dtype=torch.float32)
    num_tokens = int(loss_mask.sum().item())
    loss = (output.float() * loss_mask).sum() / max(num_tokens, 1)
    return loss, num_tokens
