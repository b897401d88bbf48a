"""``--save`` and ``--load`` checked before training, not at the first save.

A ``--save`` that is a regular file, sits in a read-only directory or on a full disk used to
train until the first checkpoint and then end in a traceback, losing that work. Here, before
any rank starts:

* ``--save`` must be a directory we can create a file in, or a path whose nearest existing
  ancestor is one (the first save creates the rest; :mod:`megatron.trainer.checkpointing.writable`);
* the free space there must hold one checkpoint, estimated from the model config
  (:func:`estimate_checkpoint_bytes`: parameters plus AdamW moments and fp32 masters, one
  file per stage and data-parallel replica);
* ``--load`` must be a directory: a regular file is an error, and so is a missing path,
  except when ``--load`` equals ``--save`` (Megatron's "resume if there is anything, else
  start fresh" idiom, ``--load ckpt --save ckpt`` on the first run of a job).
"""
from __future__ import annotations

import os
import re
import shutil

from megatron.pipeline.schedules import schedule_class
from megatron.pipeline.schedules.v_shape.layout import VShapeSchedule
from megatron.trainer.checkpointing.writable import OutputPathError, check_output_flags, check_writable_directory
from megatron.trainer.config.run_plan import RunPlan


class CheckpointPathError(ValueError):
    """An unusable ``--save`` / ``--load`` path; one line for the user."""


def estimate_parameters(config: RunPlan) -> int:
    """Parameters of the whole model (all stages) from the flags: embeddings, the output layer
    unless tied to the embedding, per layer attention (QKV with query groups, projection), MLP
    and two norms."""
    model = config.model
    h, layers, vocab = model.hidden_size, model.num_layers, config.vocab.size
    ffn = model.ffn_hidden_size or 4 * h
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    kv = 2 * h * groups // heads
    attention = h * (h + kv) + (h + kv) + h * h + h
    mlp = 2 * h * ffn + ffn + h
    norms = 4 * h
    positions = model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute" else 0
    output = 0 if config.embeddings.tied else vocab * h
    return vocab * h + output + positions + layers * (attention + mlp + norms) + 2 * h


def _v_layout(config: RunPlan) -> bool:
    return issubclass(schedule_class(config.schedule.pipeline_schedule), VShapeSchedule)


def estimate_checkpoint_bytes(config: RunPlan) -> int:
    """Bytes of one checkpoint: per parameter its value (2 bytes in bf16/fp16, else 4), AdamW's
    two fp32 moments and, in half precision, the fp32 master copy; every data-parallel replica
    writes its own files."""
    half = config.precision.bf16 or config.precision.fp16
    per_parameter = (2 + 8 + 4) if half else (4 + 8)
    # tied over several stages: the output layer's stage saves its copy of the embedding too
    # (not on a V, whose stage 0 holds both ends as one parameter)
    copy = config.vocab.size * config.model.hidden_size if config.embeddings.tied and \
        config.parallel.pipeline_model_parallel_size > 1 and not _v_layout(config) else 0
    return (estimate_parameters(config) + copy) * per_parameter * config.parallel.data_parallel_size


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def check_save_path(config: RunPlan) -> None:
    save = config.checkpoint.save
    try:
        existing = check_writable_directory(save, "--save")
    except OutputPathError as exc:
        raise CheckpointPathError(str(exc)) from None
    need, free = estimate_checkpoint_bytes(config), shutil.disk_usage(existing).free
    if free < need:
        raise CheckpointPathError(
            f"--save {save}: {_gb(free)} free, one checkpoint needs about {_gb(need)} "
            f"({estimate_parameters(config):,} parameters with optimizer states)")


def check_load_path(config: RunPlan) -> None:
    load = config.checkpoint.load
    if os.path.isdir(load):
        return
    if os.path.lexists(load):
        raise CheckpointPathError(f"--load {load}: not a directory (pass the checkpoint directory, the one "
                                  f"holding latest_checkpointed_iteration.txt)")
    if config.checkpoint.save is not None and os.path.abspath(config.checkpoint.save) == os.path.abspath(load):
        return  # --load X --save X: nothing saved yet, start fresh
    raise CheckpointPathError(f"--load {load}: no such directory (to start fresh and resume later from the "
                              f"same place, pass the same path to --save)")


def check_checkpoint_paths(config: RunPlan) -> None:
    """Both checks, then the other output flags (``--log-json``, ``--tensorboard-dir``, ...);
    :class:`CheckpointPathError` for the first problem."""
    if config.checkpoint.load is not None:
        check_load_path(config)
    if config.checkpoint.save is not None:
        check_save_path(config)
    try:
        check_output_flags(config)
    except OutputPathError as exc:
        raise CheckpointPathError(str(exc)) from None


def rank_file_name(stage: int, dp_rank: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    """The file one rank writes into a checkpoint's iteration directory: one per (pipeline
    stage, data-parallel replica), and with tensor parallelism per TP rank too (``_tp<r>``;
    without it the name has no TP part, so checkpoints from before TP keep their names)."""
    return f"stage{stage:02d}_dp{dp_rank}{f'_tp{tp_rank}' if tp_size > 1 else ''}.pt"


_RANK_FILE = re.compile(r"stage(\d+)_dp(\d+)(?:_tp(\d+))?\.pt")


def rank_file_coordinates(name: str) -> tuple[int, int, int] | None:
    """(stage, data-parallel rank, tensor-parallel rank) of a :func:`rank_file_name`; None for
    another name."""
    match = _RANK_FILE.fullmatch(name)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)
