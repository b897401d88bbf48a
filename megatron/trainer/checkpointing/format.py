"""The checkpoint format's names and its run signature (what saving and loading share)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from megatron.trainer.config.job_config import flag_values
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.config.megatron_compat_args import COMPAT_SIGNATURE_FLAGS
from megatron.trainer.models.tensor_parallel import stage_tp_group, tp_rank_and_size
from megatron.trainer.checkpointing.model_names import NamedModel
from megatron.trainer.tokenizer.factory import tokenizer_record

POINTER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
FORMAT_VERSION = 1

# Flags that must match between the checkpoint and the run that loads it.
SIGNATURE_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "seq_length", "max_position_embeddings", "vocab_size", "normalization", "position_embedding_type",
    "pipeline_model_parallel_size", "num_model_chunks", "pipeline_layer_split", "data_parallel_size",
    "pipeline_schedule", "num_microbatches", "micro_batch_size", "bf16", "fp16", "tensor_model_parallel_size",
    *COMPAT_SIGNATURE_FLAGS,
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; one line naming the file."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def run_signature(task: NamedModel, config: RunPlan) -> dict[str, Any]:
    """What identifies a run's model and pipeline layout (checked on load)."""
    # the flags, and what the run made of them: Megatron-LM's derived sizes, the padded
    # vocabulary, the run's layer split (None: even) and what runs of the tie (async: untied)
    flags = {**flag_values(config), "num_model_chunks": config.num_model_chunks,
             "num_microbatches": config.num_microbatches, "vocab_size": config.vocab.size,
             "pipeline_layer_split": config.layers.counts,
             "untie_embeddings_and_output_weights": not config.embeddings.tied}
    signature = {flag: flags.get(flag) for flag in SIGNATURE_FLAGS}
    signature["tensor_model_parallel_size"] = signature["tensor_model_parallel_size"] or 1
    signature["tokenizer_vocab_size"] = config.vocab.tokenizer_size  # which vocab rows are padding
    signature["task"] = task.name
    signature["tokenizer"] = tokenizer_record(config)  # for tools/export_hf.py and tools/generate.py
    return signature


def file_checksum(path: str | Path) -> str:
    """SHA-256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _read_metadata(directory: Path) -> dict[str, Any]:
    path = directory / METADATA
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata {path} is missing or corrupt: {exc}") from None
    if metadata.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format {metadata.get('format')}, this version reads {FORMAT_VERSION}")
    return metadata


def tensor_parallel_rank(chunks: list[torch.nn.Module]) -> tuple[int, int]:
    """(TP rank, TP size) of a stage's chunks (the TP group megatron built them with)."""
    model = getattr(chunks[0], "model", chunks[0]) if chunks else None
    return tp_rank_and_size(None if model is None else stage_tp_group(model))
