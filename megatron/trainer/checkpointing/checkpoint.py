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
ended at, so the resumed run keeps the same order instead of profiling again (the run plan
says what to keep: :meth:`~megatron.trainer.config.run_plan.RunPlan.schedule_state`).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron.pipeline.runtime.replicas import whole_optimizer_states
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.checkpointing.fault_injection import kill_here_if_asked
from megatron.trainer.checkpointing.paths import rank_file_name
from megatron.trainer.checkpointing.reshard import file_index, tp_size
from megatron.trainer.models.tensor_parallel import shard_layout
from megatron.trainer.checkpointing.model_names import NamedModel
from megatron.trainer.checkpointing.format import (  # noqa: F401 - the checkpoint API, in one place
    FORMAT_VERSION, METADATA, POINTER, SIGNATURE_FLAGS, CheckpointError, _read_metadata, file_checksum,
    iteration_dir, run_signature, tensor_parallel_rank)
from megatron.trainer.checkpointing.load import (  # noqa: F401
    ResumePoint, check_resume, find_resume_point, load_stage_state, _read_rank_file)


# ----------------------------------------------------------------------------- saving


def stage_states(task: NamedModel, transport: Transport, workers: Sequence[StageWorker]) -> list[dict[str, Any]]:
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


def stage_state(task: NamedModel, worker: StageWorker,
                optimizer_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything one stage needs to continue exactly; refuses an undrained pipeline.
    ``optimizer_state``: the whole state gathered over AMDP's replicas (:func:`stage_states`);
    by default the optimizer's own (a distributed optimizer gathers its shards itself)."""
    _check_drained(worker)
    optimizer = worker.setup.optimizer
    if optimizer_state is None:
        optimizer_state = optimizer.full_state_dict()
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
