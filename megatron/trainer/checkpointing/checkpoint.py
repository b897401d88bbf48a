"""Per-stage checkpoints: exact resume, atomic writes, a ``latest`` pointer, early checks.

Layout (Megatron-LM's names)::

    SAVE/latest_checkpointed_iteration.txt   iteration of the last *complete* checkpoint
    SAVE/iter_0000010/metadata.json          run signature, byte size, SHA-256 and parameter index of every rank file
    SAVE/iter_0000010/stage00_dp0.pt         one file per (pipeline stage, data-parallel replica)
    SAVE/iter_0000010/stage00_dp0_tp1.pt     ... and tensor-parallel rank, with TP > 1 (its shards)

A rank file holds the stage's parameters (by their names in the unsplit model), its
optimizer state (moments, fp32 masters, update counter = the stage's weight version, which
for asynchronous schedules is its local update count), its dropout RNG state and its
weight-version drift histogram. The learning rate is a function of the update counter and
the data position is the iteration, so both continue exactly. Checkpoints are taken only
at segment ends, where every schedule is drained: no micro-batch is in flight and no
gradient accumulation window is open (checked), so there is no accumulation state to keep.
What a schedule's weight policy carries across a drain (2BW's stashed version, PipeMare's
delta) is saved with the stage (``weight_versions``).

Atomicity and durability: every rank writes into ``iter_XXXXXXX.tmp/`` (each file via a
temporary name, hashed with SHA-256 while it is written, fsync'd, then ``os.replace``d, the
directory fsync'd); once all ranks are done, the coordinator writes ``metadata.json`` with the
files' sizes and checksums (fsync'd), renames the directory into place, fsyncs the parent,
and only then replaces the pointer file the same way (temporary name, fsync, rename, fsync
of the directory). A crash at any point leaves the previous pointer and its checkpoint
untouched, and what the pointer names is on disk. Staging directories a crashed save left
behind (``iter_*.tmp``, ``iter_*.old``) are removed by the next save.

Loading is checked before any rank starts (:func:`check_resume`): the pointer, the
directory, the signature (model shape, precision, ...), every file's size and checksum, each
failure one line naming the file. A rank verifies each file's checksum again as it reads it
(under torchrun no launcher checks first). A checkpoint of another layout (pipeline size,
data-parallel size, tensor-parallel size, layer split, schedule) loads by global parameter
name (and TP shard offset) through the
``index`` in ``metadata.json`` (:mod:`megatron.trainer.checkpointing.reshard`,
``docs/checkpoints.md``); the same layout loads file for file, bitwise.

A schedule that decides something during the run saves it too (``schedule_state`` in
``metadata.json``): zb-1p / zb-2p save their profiled costs and the iteration profiling
ended at, so the resumed run keeps the same order instead of profiling again.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron.pipeline.runtime.replicas import owned_optimizer_state, whole_optimizer_states
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.checkpointing.fault_injection import kill_here_if_asked
from megatron.trainer.checkpointing.paths import rank_file_name
from megatron.trainer.checkpointing.reshard import (
    LAYOUT_FLAGS, VOCAB_FLAGS, ReshardError, ReshardPlan, check_vocab, file_index, merge_optimizer_states, plan,
    saved_signature, smallest_scale, tp_size, unchecked_flags)
from megatron.trainer.checkpointing.shards import Region, ShardError
from megatron.trainer.config.megatron_compat_args import COMPAT_SIGNATURE_FLAGS
from megatron.trainer.config.run_config import run_config
from megatron.trainer.models.tensor_parallel import shard_layout, stage_tp_group, tp_rank_and_size
from megatron.trainer.tasks.task import PretrainTask
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


def run_signature(task: PretrainTask, args: argparse.Namespace) -> dict[str, Any]:
    """What identifies a run's model and pipeline layout (checked on load)."""
    signature = {flag: getattr(args, flag, None) for flag in SIGNATURE_FLAGS}
    signature["tensor_model_parallel_size"] = signature["tensor_model_parallel_size"] or 1
    signature["tokenizer_vocab_size"] = getattr(args, "tokenizer_vocab_size", None)  # which vocab rows are padding
    signature["task"] = task.name
    signature["tokenizer"] = tokenizer_record(args)  # for tools/export_hf.py and tools/generate.py
    return signature


def tensor_parallel_rank(chunks: list[torch.nn.Module]) -> tuple[int, int]:
    """(TP rank, TP size) of a stage's chunks (the TP group megatron built them with)."""
    model = getattr(chunks[0], "model", chunks[0]) if chunks else None
    return tp_rank_and_size(None if model is None else stage_tp_group(model))


# ----------------------------------------------------------------------------- saving


def stage_states(task: PretrainTask, transport: Transport, workers: Sequence[StageWorker]) -> list[dict[str, Any]]:
    """:func:`stage_state` of every local worker. AMDP's replicas, whose optimizer state is
    sharded over them, first gather each hosted logical stage's whole state (a collective of
    the replica groups, :func:`~megatron.pipeline.runtime.replicas.whole_optimizer_states`), so
    every file holds whole states and loads into any layout, as a distributed optimizer's."""
    for worker in workers:
        _check_drained(worker)
    gathered = whole_optimizer_states(transport, workers) or {}
    return [stage_state(task, worker, gathered.get(worker.stage)) for worker in workers]


def _check_drained(worker: StageWorker) -> None:
    """Refuse a pipeline with micro-batches in flight or gradients not yet applied."""
    in_flight = worker.in_flight()
    if in_flight:
        raise CheckpointError(f"stage {worker.stage}: cannot checkpoint with {in_flight} micro-batches in flight "
                              f"(checkpoints are taken at drained segment ends)")
    if any(p.grad is not None and bool(p.grad.any()) for p in worker.setup.optimizer.parameters()):
        raise CheckpointError(f"stage {worker.stage}: cannot checkpoint with accumulated gradients not yet applied")


def stage_state(task: PretrainTask, worker: StageWorker,
                optimizer_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything one stage needs to continue exactly; refuses an undrained pipeline.
    ``optimizer_state``: the whole state gathered over AMDP's replicas (:func:`stage_states`);
    by default the optimizer's own (a distributed optimizer gathers its shards itself)."""
    _check_drained(worker)
    optimizer = worker.setup.optimizer
    if optimizer_state is None:
        optimizer_state = getattr(optimizer, "full_state_dict", optimizer.state_dict)()
    named = list(task.named_parameters(worker.setup.chunks))
    tp_rank, tp_size_ = tensor_parallel_rank(worker.setup.chunks)
    layouts = {name: list(layout) for name, p in named if (layout := shard_layout(p)) is not None}
    return {
        "format": FORMAT_VERSION,
        "stage": worker.stage,
        "model": {name: p.detach().cpu().clone() for name, p in named},
        "tensor_parallel": {"rank": tp_rank, "size": tp_size_, "layouts": layouts},  # what each shard is
        # Sharded optimizer states (a distributed optimizer's, AMDP's) are gathered: the file
        # holds a whole state, which loads into any layout (docs/checkpoints.md).
        "optimizer": optimizer_state,
        "rng": worker.rng_state(),
        "drift_histogram": dict(worker.drift_histogram),
        "weight_versions": worker.weights.state_dict(),  # 2BW's stash, PipeMare's delta
        **({} if worker.setup.loss_scaler is None else {"loss_scaler": worker.setup.loss_scaler.state_dict()}),
    }


def staging_dir(root: str | Path, iteration: int) -> Path:
    return Path(str(iteration_dir(root, iteration)) + ".tmp")


CHECKSUM_SUFFIX = ".sha256"  # a rank's checksum next to its file in staging, until publish
INDEX_SUFFIX = ".index.json"  # a rank's parameter index next to its file in staging, until publish


def prepare_staging(root: str | Path, iteration: int) -> Path:
    """Coordinator, before any rank writes: an empty staging directory. Every crashed save's
    leftovers go (``iter_*.tmp`` staging and ``iter_*.old`` trash of any iteration)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [*root.glob("iter_*.tmp"), *root.glob("iter_*.old")]:
        shutil.rmtree(stale, ignore_errors=True)
    staging = staging_dir(root, iteration)
    staging.mkdir(parents=True)
    return staging


def fsync_directory(path: str | Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file object that hashes what passes through (torch.save streams into it)."""

    def __init__(self, file: io.BufferedWriter):
        self.file, self.hash = file, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _durable_replace(partial: Path, path: Path) -> None:
    os.replace(partial, path)
    fsync_directory(path.parent)


def write_durable_text(path: Path, text: str) -> None:
    """``text`` into ``path``: temporary name, fsync, rename, fsync of the directory."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _durable_replace(partial, path)


def write_rank_file(root: str | Path, iteration: int, stage: int, dp_rank: int, state: dict[str, Any]) -> None:
    """Write one rank's state into the staging directory (temporary name, fsync, rename), with
    its SHA-256 (computed while writing) and its parameter index (names, shapes, TP shards,
    update count: what a resharded load looks up) beside it for :func:`publish`. The file name
    carries the state's own TP rank (:func:`stage_state` records it)."""
    tp = state.get("tensor_parallel") or {"rank": 0, "size": 1}
    path = staging_dir(root, iteration) / rank_file_name(stage, dp_rank, tp["rank"], tp["size"])
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(state, writer)
        f.flush()
        os.fsync(f.fileno())
    _durable_replace(partial, path)
    write_durable_text(path.with_name(path.name + INDEX_SUFFIX), json.dumps(file_index(state)))
    write_durable_text(path.with_name(path.name + CHECKSUM_SUFFIX), writer.hash.hexdigest())


def file_checksum(path: str | Path) -> str:
    """SHA-256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def schedule_state(schedule: object) -> dict[str, Any] | None:
    """What ``schedule`` decided during the run and must keep on resume (zb-1p/zb-2p's profiled
    costs), or None."""
    state = getattr(schedule, "checkpoint_state", None)
    return state() if state is not None else None


def restore_schedule_state(schedule: object, point: "ResumePoint | None") -> None:
    """Hand a checkpoint's :func:`schedule_state` back to the resumed run's schedule. A schedule
    that decides nothing at run time ignores it (e.g. zb-2p resumed with ``--zb-costs``: the
    user fixed the order on purpose)."""
    restore = getattr(schedule, "restore_checkpoint_state", None)
    if point is not None and point.schedule_state is not None and restore is not None:
        restore(point.schedule_state)


def publish(root: str | Path, iteration: int, signature: dict[str, Any], num_stages: int, dp_size: int,
            schedule: dict[str, Any] | None = None) -> Path:
    """Coordinator, after every rank wrote: metadata (sizes, checksums, the schedule's state),
    rename into place, then the pointer; each step durable before the next. With tensor
    parallelism (the signature's size) every TP rank of every (stage, replica) wrote a file."""
    staging, final = staging_dir(root, iteration), iteration_dir(root, iteration)
    files, checksums, index = {}, {}, {}
    tp = tp_size(signature)
    for stage in range(num_stages):
        for dp, tp_rank in ((dp, r) for dp in range(dp_size) for r in range(tp)):
            name = rank_file_name(stage, dp, tp_rank, tp)
            sidecar = staging / (name + CHECKSUM_SUFFIX)
            if not (staging / name).is_file() or not sidecar.is_file():
                raise CheckpointError(f"checkpoint {staging}: {name} was not written")
            files[name] = (staging / name).stat().st_size
            checksums[name] = sidecar.read_text().strip()
            sidecar.unlink()
            listing = staging / (name + INDEX_SUFFIX)
            index[name] = json.loads(listing.read_text())
            listing.unlink()
    metadata = {"format": FORMAT_VERSION, "iteration": iteration, "signature": signature, "files": files,
                "sha256": checksums, "schedule_state": schedule, "index": index}
    write_durable_text(staging / METADATA, json.dumps(metadata, indent=1, sort_keys=True))
    if final.exists():  # saving the same iteration again: the old copy goes only now
        trash = Path(str(final) + ".old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(staging, final)
        fsync_directory(root)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)
        fsync_directory(root)
    kill_here_if_asked("renamed", iteration)  # tests only (fault_injection)
    write_durable_text(Path(root) / POINTER, f"{iteration}\n")
    return final


# ---------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class ResumePoint:
    iteration: int
    directory: Path
    checksums: dict[str, str] = field(default_factory=dict)  # rank file name -> SHA-256
    schedule_state: dict[str, Any] | None = None
    reshard: ReshardPlan | None = None  # None: saved with this run's layout, loaded file for file


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


def check_resume(task: PretrainTask, args: argparse.Namespace, verify_files: bool = True) -> ResumePoint | None:
    """Validate ``--load`` before any rank starts; return where to resume (None: start fresh).

    A different model shape or precision, a layout change that cannot load correctly
    (:func:`megatron.trainer.checkpointing.reshard.plan`), a missing or truncated rank file, a
    rank file whose checksum differs (``verify_files``: every file, or with a layout change the
    data-parallel replica 0 files that are read; a rank checks each file it reads again in
    :func:`load_stage_state`): each is a one-line :class:`CheckpointError` naming the file.
    """
    if args.load is None:
        return None
    point = find_resume_point(args.load)
    if point is None:
        return None
    metadata = _read_metadata(point.directory)
    path = point.directory / METADATA
    saved, ours = saved_signature(metadata), run_signature(task, args)
    try:
        vocab_padding = check_vocab(saved, ours, str(path))
    except ReshardError as exc:
        raise CheckpointError(str(exc)) from None
    if saved.get("imported_from") and not getattr(args, "finetune", False):
        raise CheckpointError(f"checkpoint {path} holds weights only (imported from {saved['imported_from']}): "
                              f"load it with --finetune")
    for key in ours:
        if saved.get(key) != ours[key] and key not in (*LAYOUT_FLAGS, *VOCAB_FLAGS, *unchecked_flags(saved)):
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
    reshard = None
    if vocab_padding or any(saved.get(key) != ours[key] for key in LAYOUT_FLAGS):
        try:
            reshard = plan(metadata, ours, args, str(path))
        except ReshardError as exc:
            raise CheckpointError(str(exc)) from None
    _check_sharded_optimizer(metadata, args, str(path))
    checksums = metadata.get("sha256", {})
    if verify_files:
        read = None if reshard is None else reshard.files_read(args.data_parallel_size, tp_size(ours))
        for name, expected in checksums.items():
            if read is None or name in read:
                _verify_checksum(point.directory / name, file_checksum(point.directory / name), expected)
    if point.iteration >= args.train_iters and not getattr(args, "finetune", False):
        raise CheckpointError(f"checkpoint {point.directory} is at iteration {point.iteration}, "
                              f"not before --train-iters {args.train_iters}: nothing left to train")
    keeps_order = reshard is None or (reshard.keeps_rank_state and reshard.same_schedule)
    return ResumePoint(point.iteration, point.directory, checksums,
                       metadata.get("schedule_state") if keeps_order else None, reshard)


def _check_sharded_optimizer(metadata: dict[str, Any], args: argparse.Namespace, where: str) -> None:
    """Optimizer shards (files of AMDP or --use-distributed-optimizer written before their saves
    gathered the shards) load only into a run that shards its optimizer state the same way (a
    whole state, by contrast, is sliced into either)."""
    if getattr(args, "no_load_optim", False) or getattr(args, "finetune", False):
        return
    sharded_run = run_config(args).shards_optimizer_state or (
        getattr(args, "use_distributed_optimizer", False) and args.data_parallel_size > 1)
    if not sharded_run and any(e.get("optimizer_sharded") for e in (metadata.get("index") or {}).values()):
        raise CheckpointError(f"checkpoint {where} holds sharded optimizer state (saved with "
                              f"--use-distributed-optimizer or AMDP's sharded state, before saves gathered "
                              f"the shards); this run keeps whole optimizer states: shard it the same way "
                              f"or pass --no-load-optim")


def _verify_checksum(path: Path, actual: str, expected: str) -> None:
    if actual != expected:
        raise CheckpointError(f"checkpoint file {path} is corrupt (SHA-256 {actual[:12]}..., "
                              f"{expected[:12]}... when saved)")


def _read_rank_file(point: ResumePoint, name: str) -> dict[str, Any]:
    """One rank file of ``point``, its SHA-256 checked against the metadata's."""
    path = point.directory / name
    try:
        data = path.read_bytes()
        if path.name in point.checksums:
            _verify_checksum(path, hashlib.sha256(data).hexdigest(), point.checksums[path.name])
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise CheckpointError(f"checkpoint file {path} is truncated or corrupt: {type(exc).__name__}: {exc}") from None


def _copy_parameters(params: dict[str, torch.nn.Parameter], saved: dict[str, torch.Tensor],
                     where: dict[str, Path]) -> None:
    """``saved`` into ``params`` (same names), shapes checked; ``where`` names each one's file."""
    with torch.no_grad():
        for name, p in params.items():
            if saved[name].shape != p.shape:
                raise CheckpointError(f"checkpoint file {where[name]}: {name} has shape {tuple(saved[name].shape)}, "
                                      f"the model has {tuple(p.shape)}")
            p.data.copy_(saved[name])


def _load_optimizer(worker: StageWorker, state: dict[str, Any], path: Path | str) -> None:
    """A whole optimizer state into the worker's optimizer (AMDP's sharded replicas take their
    ranges of it, a distributed optimizer cuts its own)."""
    try:
        worker.setup.optimizer.load_state_dict(owned_optimizer_state(worker, state))
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path}: optimizer state does not fit: {exc}") from None


def _load_rng(worker: StageWorker, state: dict[str, Any]) -> None:
    worker.set_rng_state(state["rng"])
    worker.drift_histogram.clear()
    worker.drift_histogram.update(state.get("drift_histogram", {}))


def load_stage_state(task: PretrainTask, worker: StageWorker, point: ResumePoint, dp_rank: int,
                     optimizer: bool = True, rng: bool = True) -> None:
    """Restore one stage from its rank file (parameters, optimizer, RNG, drift histogram).

    ``optimizer=False`` (``--no-load-optim``, ``--finetune``) keeps the fresh optimizer and
    the weight-version state that counts its updates; ``rng=False`` (``--finetune``) also
    the fresh RNG and drift histogram. A checkpoint of another layout (``point.reshard``) is
    gathered by parameter name from the files that hold this stage's parameters
    (:func:`_load_resharded`).
    """
    if point.reshard is not None:
        _load_resharded(task, worker, point, dp_rank, optimizer, rng)
        return
    path = point.directory / rank_file_name(worker.stage, dp_rank, *tensor_parallel_rank(worker.setup.chunks))
    state = _read_rank_file(point, path.name)
    params = dict(task.named_parameters(worker.setup.chunks))
    saved = state.get("model", {})
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise CheckpointError(f"checkpoint file {path} does not match this stage's model "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    _copy_parameters(params, saved, dict.fromkeys(params, path))
    if optimizer:
        _load_optimizer(worker, state["optimizer"], path)
        worker.weights.load_state_dict(state.get("weight_versions", {}))
        if worker.setup.loss_scaler is not None and "loss_scaler" in state:  # fp16: resume the scale
            worker.setup.loss_scaler.load_state_dict(state["loss_scaler"])
    if rng:
        _load_rng(worker, state)


def _load_resharded(task: PretrainTask, worker: StageWorker, point: ResumePoint, dp_rank: int,
                    optimizer: bool, rng: bool) -> None:
    """This stage's parameters and optimizer state by global name from the old files holding
    them, each tensor-parallel region assembled from the shards overlapping it (parameters and
    AdamW's moments and masters alike); per-rank state as
    :mod:`megatron.trainer.checkpointing.reshard` decides."""
    plan_ = point.reshard
    assert plan_ is not None
    tp_rank, tp_size_ = tensor_parallel_rank(worker.setup.chunks)
    if worker.stage == 0 and dp_rank == 0 and tp_rank == 0:
        for line in plan_.notices:
            print(f"[megatron-async] checkpoint: {line}", flush=True)
    params = dict(task.named_parameters(worker.setup.chunks))
    missing = sorted(set(params) - set(plan_.owners))
    if missing:
        raise CheckpointError(f"checkpoint {point.directory} holds no {missing[0]} "
                              f"({len(missing)} parameters of stage {worker.stage} missing)")
    try:
        regions = {n: plan_.region(n, shard_layout(p), tp_rank, tp_size_, tuple(p.shape)) for n, p in params.items()}
    except ReshardError as exc:
        raise CheckpointError(str(exc)) from None
    states = {name: _read_rank_file(point, name) for name in sorted({f for r in regions.values() for f in r.files})}
    with torch.no_grad():
        for name, p in params.items():
            p.data.copy_(_assemble(point, regions[name], p.detach(), {f: states[f]["model"][name] for f in regions[name].files}))
    stage_file = plan_.stage_file(worker.stage, dp_rank, tp_rank) if plan_.same_partition else None
    if stage_file is not None and stage_file not in states:
        states[stage_file] = _read_rank_file(point, stage_file)
    if optimizer:
        _load_resharded_optimizer(worker, point, params, regions, states)
        if plan_.keeps_rank_state and plan_.same_schedule and stage_file is not None:
            worker.weights.load_state_dict(states[stage_file].get("weight_versions", {}))
        scaler = states[stage_file].get("loss_scaler") if stage_file is not None else \
            smallest_scale([s.get("loss_scaler") for s in states.values()])
        if worker.setup.loss_scaler is not None and scaler is not None:
            worker.setup.loss_scaler.load_state_dict(scaler)
    if rng and stage_file is not None and plan_.keeps_rank_state:
        _load_rng(worker, states[stage_file])


def _assemble(point: ResumePoint, region: Region, current: torch.Tensor, saved: dict[str, torch.Tensor]) -> torch.Tensor:
    """One tensor's region out of the saved shards (a shape that does not fit: one line)."""
    try:
        return region.assemble(current, saved)
    except ShardError as exc:
        raise CheckpointError(f"checkpoint {point.directory} ({', '.join(region.files)}): {exc}") from None


def _load_resharded_optimizer(worker: StageWorker, point: ResumePoint, params: dict[str, torch.nn.Parameter],
                              regions: dict[str, Region], states: dict[str, dict[str, Any]]) -> None:
    """The optimizer's state for this rank: per-name entries merged from the files holding them,
    AdamW's tensors (moments, masters) assembled region by region like their parameters.
    Where the checkpoint has no value (vocabulary padding rows it lacks) the moments start at
    zero and the master at the loaded parameter (this run's initialisation there), as fresh."""
    trained = {n for n, _ in worker.setup.optimizer.named_parameters()}
    sources = [(state["optimizer"], set(state["model"]), {n for n in trained if regions[n].files[:1] == [f]})
               for f, state in states.items()]
    merged = merge_optimizer_states(sources)
    entries, kinds = {}, worker.setup.optimizer.state_dict()["params"]  # which tensors, which dtypes
    # A sharded optimizer (AMDP's replicas, a distributed optimizer) holds entries only for the
    # parameters it owns a part of; those get whole entries, which it cuts to its part on load.
    for name in (n for n in trained if n in kinds):
        saved = {f: states[f]["optimizer"]["params"][name] for f in regions[name].files}
        fresh = {key: params[name].detach().to(value.dtype) if key == "master" else
                 torch.zeros(params[name].shape, dtype=value.dtype) for key, value in kinds[name].items()}
        if any(set(entry) != set(fresh) for entry in saved.values()):
            raise CheckpointError(f"checkpoint {point.directory} ({', '.join(saved)}): optimizer state of {name} "
                                  f"holds {sorted(next(iter(saved.values())))}, this run {sorted(fresh)}")
        entries[name] = {key: _assemble(point, regions[name], value, {f: e[key] for f, e in saved.items()})
                         for key, value in fresh.items()}
    merged["params"] = entries
    _load_optimizer(worker, merged, ", ".join(str(point.directory / n) for n in sorted(states)))
