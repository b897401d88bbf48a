"""A megatron-core ``BertModel`` cut into pipeline stages for our own runtime.

Each stage is a ``BertModel`` built with its own layer count and ``pre_process`` /
``post_process`` (embeddings on the first virtual stage; final norm, masked-LM head and the
optional sentence-order head on the last), initialised from global parameter names exactly as
GPT stages are (:mod:`.stage`), so any split starts bit-identical.

The stage runs the model's own pieces rather than ``BertModel.forward``: that forward asks
megatron's parallel state whether it is the first pipeline stage (always yes here, megatron
sees one stage) and would then derive position ids from the absent token ids of a later stage.

BERT attends bidirectionally under a padding mask, which every layer applies, so every stage
-- the middle ones included -- reads ``padding_mask`` from the micro-batch
(``middle_batch_keys``). The mask is Megatron's ``[b, 1, 1, s]`` bool "True = masked out"
(what ``BertModel`` builds for Transformer Engine >= 1.10), honoured by our SDPA attention on
any device: padded keys get no weight, so padding never changes a real token's output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.trainer.models.sdpa_attention import SDPAAttention
from megatron.trainer.models.stage import (
    PipelineStage,
    TransformerArgs,
    build_stage,
    layer_spec,
)

BERT_BATCH_MASK = "padding_mask"


@dataclass
class BertModelArgs(TransformerArgs):
    """Architecture of the whole (unsplit) BERT model."""

    # Megatron-LM's --bert-no-binary-head turns this off (and with it token types).
    add_binary_head: bool = True


class BertOutput(NamedTuple):
    """What the last BERT stage returns: per-token masked-LM loss ``[b, s]`` (fp32, every
    position; the loss mask picks the masked ones) and sentence-order logits ``[b, 2]``."""

    lm_loss: torch.Tensor
    binary_logits: torch.Tensor | None


class _StageBertModel(BertModel):
    """``BertModel`` whose attention-mask layout check also knows our SDPA core attention.

    megatron-core decides the mask layout from the Transformer Engine version whenever the
    core attention is not its own local one, which fails without TE. SDPA broadcasts a
    ``[b, 1, 1, s]`` mask, the layout megatron uses with current TE, so we take that.
    """

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        spec = self.transformer_layer_spec.submodules.self_attention.submodules
        if spec.core_attention is SDPAAttention:
            return "b11s"
        return super()._sanity_check_attention_and_get_attn_mask_dimension()


class BertStage(PipelineStage):
    """One pipeline stage of a megatron-core ``BertModel``: ``forward(input_tensor, batch)``
    returns hidden states ``[s, b, h]``, or a :class:`BertOutput` on the last stage."""

    block = "encoder"

    def __init__(self, args: BertModelArgs, layers: range, model: BertModel) -> None:
        super().__init__(args, layers, model)
        self.middle_batch_keys = (BERT_BATCH_MASK,)

    def _embed(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = batch["tokens"]
        token_types = batch.get("tokentype_ids") if self.model.add_binary_head else None
        return self.model.embedding(
            input_ids=tokens, position_ids=self.model.bert_position_ids(tokens),
            tokentype_ids=token_types,
        )

    def _heads(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> BertOutput:
        model = self.model
        binary_logits = None
        if model.binary_head is not None:
            binary_logits = model.binary_head(model.pooler(hidden, 0)).float()
        # Tied: the embedding's weight (PP = 1) or its copy; untied: None, the layer's own.
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(model.lm_head(hidden_states=hidden), weight=weight)
        lm_loss = model.compute_language_model_loss(batch["labels"], logits)
        return BertOutput(lm_loss.float(), binary_logits)

    def forward(
        self, input_tensor: torch.Tensor | None, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor | BertOutput:
        """Embeddings (first stage), this stage's layers under the padding mask, heads (last)."""
        mask = self.model.bert_extended_attention_mask(batch[BERT_BATCH_MASK])
        if self.is_first:
            hidden = self._embed(batch)
        else:
            if input_tensor is None:
                raise ValueError("a non-first stage needs the previous stage's hidden states")
            hidden = None
            self.set_stage_input(input_tensor)
        rotary = None
        if self.model.position_embedding_type == "rope":
            seq_length = (hidden if hidden is not None else input_tensor).size(0)
            rotary = self.model.rotary_pos_emb(seq_length)
        try:
            hidden = self.model.encoder(hidden_states=hidden, attention_mask=mask,
                                        rotary_pos_emb=rotary)
        finally:
            if not self.is_first:
                self.set_stage_input(None)
        if self.is_last:
            return self._heads(hidden, batch)
        return hidden.contiguous()


def build_bert_stage(
    args: BertModelArgs,
    layers: range,
    pre_process: bool,
    post_process: bool,
    seed: int,
    device: torch.device | str,
) -> BertStage:
    """Build the BERT stage owning global ``layers``; weights depend only on seed and names."""

    def make(config: TransformerConfig, use_te: bool) -> BertModel:
        return _StageBertModel(
            config=config,
            num_tokentypes=2 if args.add_binary_head else 0,
            transformer_layer_spec=layer_spec(args, use_te, AttnMaskType.padding),
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=args.tie_embeddings,  # as GPT
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,  # BertModel has no rotary base (10000)
            add_binary_head=args.add_binary_head,
        )

    wrap: Callable[[torch.nn.Module], BertStage] = lambda model: BertStage(args, layers, model)
    return build_stage(args, layers, seed, device, make, wrap)  # type: ignore[return-value]


def bert_loss(output: BertOutput, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Megatron's BERT loss: masked-LM cross-entropy averaged over the masked tokens, plus the
    sentence-order cross-entropy over the micro-batch when the binary head is on; and the
    number of masked tokens."""
    lm_loss = output[0]
    loss_mask = batch["loss_mask"].to(device=lm_loss.device, dtype=torch.float32)
    num_tokens = int(loss_mask.sum().item())
    loss = (lm_loss * loss_mask).sum() / max(num_tokens, 1)
    order_loss = sentence_order_loss(output, batch)
    if order_loss is not None:
        loss = loss + order_loss
    return loss, num_tokens


def sentence_order_loss(output: BertOutput, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The sentence-order cross-entropy of the micro-batch; None without the binary head.
    Part of :func:`bert_loss`, and logged on its own as Megatron-LM's "sop loss"."""
    binary_logits = output[1]
    if binary_logits is None:
        return None
    order = batch["sentence_order"].to(device=binary_logits.device).view(-1)
    return torch.nn.functional.cross_entropy(binary_logits.view(-1, 2), order, ignore_index=-1)
