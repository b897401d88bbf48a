"""Per-stage checkpoints: exact resume, atomic writes, a ``latest`` pointer, early checks.

Layout (Megatron-LM's names)::

    SAVE/latest_checkpointed_iteration.txt   iteration of the last *complete* checkpoint
    SAVE/iter_0000010/metadata.json          run signature + byte size of every rank file
    SAVE/iter_0000010/stage00_dp0.pt         one file per (pipeline stage, data-parallel replica)

A rank file holds the stage's parameters (by their names in the unsplit model), its
optimizer state (moments, fp32 masters, update counter = the stage's weight version, which
for asynchronous schedules is its local update count), its dropout RNG state and its
weight-version drift histogram. The learning rate is a function of the update counter and
the data position is the iteration, so both continue exactly. Checkpoints are taken only
at segment ends, where every schedule is drained: no micro-batch is in flight and no
gradient accumulation window is open (checked), so there is no accumulation state to keep.
What a schedule's weight policy carries across a drain (2BW's stashed version, PipeMare's
delta) is saved with the stage (``weight_versions``).

Atomicity: every rank writes into ``iter_XXXXXXX.tmp/`` (each file via a temporary name and
``os.replace``); once all ranks are done, the coordinator writes ``metadata.json`` with the
files' sizes, renames the directory into place and only then replaces the pointer file.
A crash at any point leaves the previous pointer and its checkpoint untouched.

Loading is checked before any rank starts (:func:`check_resume`): the pointer, the
directory, the signature (model shape, stage count, schedule, ...) and every file's size,
each failure one line naming the file.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.pipeline.worker import StageWorker
from megatron.trainer.task import PretrainTask

POINTER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
FORMAT_VERSION = 1

# Flags that must match between the checkpoint and the run that loads it.
SIGNATURE_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "seq_length", "max_position_embeddings", "vocab_size", "normalization", "position_embedding_type",
    "pipeline_model_parallel_size", "num_model_chunks", "pipeline_layer_split", "data_parallel_size",
    "pipeline_schedule", "num_microbatches", "micro_batch_size", "bf16", "fp16",
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; one line naming the file."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def rank_file_name(stage: int, dp_rank: int) -> str:
    return f"stage{stage:02d}_dp{dp_rank}.pt"


def run_signature(task: PretrainTask, args: argparse.Namespace) -> dict[str, Any]:
    """What identifies a run's model and pipeline layout (checked on load)."""
    signature = {flag: getattr(args, flag, None) for flag in SIGNATURE_FLAGS}
    signature["task"] = task.name
    return signature


# ----------------------------------------------------------------------------- saving


def stage_state(task: PretrainTask, worker: StageWorker) -> dict[str, Any]:
    """Everything one stage needs to continue exactly; refuses an undrained pipeline."""
    in_flight = worker.in_flight()
    if in_flight:
        raise CheckpointError(f"stage {worker.stage}: cannot checkpoint with {in_flight} micro-batches in flight "
                              f"(checkpoints are taken at drained segment ends)")
    optimizer = worker.setup.optimizer
    if any(p.grad is not None and bool(p.grad.any()) for p in optimizer.parameters()):
        raise CheckpointError(f"stage {worker.stage}: cannot checkpoint with accumulated gradients not yet applied")
    return {
        "format": FORMAT_VERSION,
        "stage": worker.stage,
        "model": {name: p.detach().cpu().clone() for name, p in task.named_parameters(worker.setup.chunks)},
        "optimizer": optimizer.state_dict(),
        "rng": worker.rng_state(),
        "drift_histogram": dict(worker.drift_histogram),
        "weight_versions": worker.weights.state_dict(),  # 2BW's stash, PipeMare's delta
        **({} if worker.setup.loss_scaler is None else {"loss_scaler": worker.setup.loss_scaler.state_dict()}),
    }


def staging_dir(root: str | Path, iteration: int) -> Path:
    return Path(str(iteration_dir(root, iteration)) + ".tmp")


def prepare_staging(root: str | Path, iteration: int) -> Path:
    """Coordinator, before any rank writes: an empty staging directory (a crashed save's leftovers go)."""
    staging = staging_dir(root, iteration)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def write_rank_file(root: str | Path, iteration: int, stage: int, dp_rank: int, state: dict[str, Any]) -> None:
    """Write one rank's state into the staging directory (temporary name, then rename)."""
    path = staging_dir(root, iteration) / rank_file_name(stage, dp_rank)
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def publish(root: str | Path, iteration: int, signature: dict[str, Any], num_stages: int, dp_size: int) -> Path:
    """Coordinator, after every rank wrote: metadata, rename into place, then the pointer."""
    staging, final = staging_dir(root, iteration), iteration_dir(root, iteration)
    files = {}
    for stage in range(num_stages):
        for dp in range(dp_size):
            name = rank_file_name(stage, dp)
            if not (staging / name).is_file():
                raise CheckpointError(f"checkpoint {staging}: {name} was not written")
            files[name] = (staging / name).stat().st_size
    metadata = {"format": FORMAT_VERSION, "iteration": iteration, "signature": signature, "files": files}
    (staging / METADATA).write_text(json.dumps(metadata, indent=1, sort_keys=True))
    if final.exists():  # saving the same iteration again: the old copy goes only now
        trash = Path(str(final) + ".old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)
    pointer = Path(root) / POINTER
    partial = pointer.with_suffix(".partial")
    partial.write_text(f"{iteration}\n")
    os.replace(partial, pointer)
    return final


# ---------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class ResumePoint:
    iteration: int
    directory: Path


def find_resume_point(root: str | Path) -> ResumePoint | None:
    """The latest complete checkpoint under ``root``; None if nothing was saved there yet."""
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load {root}: {pointer} holds {text[:40]!r}, not an iteration number")
    iteration = int(text)
    directory = iteration_dir(root, iteration)
    if not directory.is_dir():
        raise CheckpointError(f"--load {root}: {pointer} names iteration {iteration} but {directory} is missing")
    return ResumePoint(iteration, directory)


def _read_metadata(directory: Path) -> dict[str, Any]:
    path = directory / METADATA
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata {path} is missing or corrupt: {exc}") from None
    if metadata.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format {metadata.get('format')}, this version reads {FORMAT_VERSION}")
    return metadata


def check_resume(task: PretrainTask, args: argparse.Namespace) -> ResumePoint | None:
    """Validate ``--load`` before any rank starts; return where to resume (None: start fresh).

    Different model shape, stage count, schedule or batch layout, a missing or truncated rank
    file: each is a one-line :class:`CheckpointError` naming the file.
    """
    if args.load is None:
        return None
    point = find_resume_point(args.load)
    if point is None:
        return None
    metadata = _read_metadata(point.directory)
    path = point.directory / METADATA
    saved, ours = metadata["signature"], run_signature(task, args)
    for key in ours:
        if saved.get(key) != ours[key]:
            flag = "model type" if key == "task" else "--" + key.replace("_", "-")
            raise CheckpointError(f"checkpoint {path} was saved with {flag} {saved.get(key)}, "
                                  f"this run has {ours[key]}")
    for name, size in metadata["files"].items():
        file = point.directory / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {file} is truncated or corrupt "
                                  f"({file.stat().st_size} bytes, {size} when saved)")
    if point.iteration >= args.train_iters:
        raise CheckpointError(f"checkpoint {point.directory} is at iteration {point.iteration}, "
                              f"not before --train-iters {args.train_iters}: nothing left to train")
    return point


def load_stage_state(task: PretrainTask, worker: StageWorker, point: ResumePoint, dp_rank: int) -> None:
    """Restore one stage from its rank file (parameters, optimizer, RNG, drift histogram)."""
    path = point.directory / rank_file_name(worker.stage, dp_rank)
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise CheckpointError(f"checkpoint file {path} is truncated or corrupt: {type(exc).__name__}: {exc}") from None
    params = dict(task.named_parameters(worker.setup.chunks))
    saved = state.get("model", {})
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise CheckpointError(f"checkpoint file {path} does not match this stage's model "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for name, p in params.items():
            if saved[name].shape != p.shape:
                raise CheckpointError(f"checkpoint file {path}: {name} has shape {tuple(saved[name].shape)}, "
                                      f"the model has {tuple(p.shape)}")
            p.data.copy_(saved[name])
    try:
        worker.setup.optimizer.load_state_dict(state["optimizer"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path}: optimizer state does not fit: {exc}") from None
    worker.set_rng_state(state["rng"])
    worker.drift_histogram.clear()
    worker.drift_histogram.update(state.get("drift_histogram", {}))
    worker.weights.load_state_dict(state.get("weight_versions", {}))
    if worker.setup.loss_scaler is not None and "loss_scaler" in state:  # fp16: resume the scale
        worker.setup.loss_scaler.load_state_dict(state["loss_scaler"])
