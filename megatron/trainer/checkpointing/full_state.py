"""A checkpoint's whole model in one process: every parameter at its full (unsharded) shape,
from a checkpoint of any pipeline split, tensor-parallel size or schedule.

For tools that use a trained model outside a run (export to Hugging Face, generation). It reads
the tensor-parallel rank files of data-parallel replica 0 and joins each parameter's shards with
the same :func:`~megatron.trainer.checkpointing.shards.plan_region` the resharding loader uses,
here for one rank of size one. A tied embedding's copy on the output layer's stage carries the
embedding's name (bitwise equal to it); the first stage's is kept.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron.trainer.checkpointing.checkpoint import CheckpointError, _read_metadata, find_resume_point
from megatron.trainer.checkpointing.paths import rank_file_coordinates
from megatron.trainer.checkpointing.reshard import saved_signature
from megatron.trainer.checkpointing.shards import plan_region


def read_full_state(root: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], int]:
    """(the checkpoint's signature, its parameters by global name, its iteration)."""
    point = find_resume_point(root)
    if point is None:
        raise CheckpointError(f"{root}: no checkpoint (no latest_checkpointed_iteration.txt)")
    metadata = _read_metadata(point.directory)
    holders: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    ordered = sorted(metadata["index"].items(), key=lambda kv: rank_file_coordinates(kv[0]) or (0, 0, 0))
    for file, entry in ordered:
        if (rank_file_coordinates(file) or (0, 0, 0))[1] != 0:
            continue  # another data-parallel replica: the same weights
        stage = entry["stage"]
        for name, param in entry["params"].items():
            if name not in holders or holders[name][0][1]["_stage"] == stage:  # the first stage's copies
                holders.setdefault(name, []).append((file, {**param, "_stage": stage}))
    files: dict[str, dict[str, torch.Tensor]] = {}
    state = {}
    for name, held in holders.items():
        shape = tuple(held[0][1]["global_shape"])
        region = plan_region(name, held, None, 0, 1, shape, (shape[0], shape[0]))
        saved = {}
        for file in region.files:
            if file not in files:
                files[file] = torch.load(point.directory / file, map_location="cpu", weights_only=False)["model"]
            saved[file] = files[file][name]
        dtype = saved[region.files[0]].dtype
        state[name] = region.assemble(torch.zeros(shape, dtype=dtype), saved)
    return saved_signature(metadata), state, point.iteration
