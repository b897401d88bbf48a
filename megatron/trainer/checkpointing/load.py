"""Loading a checkpoint: the up-front check of ``--load`` (:func:`check_resume`) and each
rank's load of its stage (:func:`load_stage_state`, resharded through the metadata's index when
the layout changed). Format and guarantees: :mod:`megatron.trainer.checkpointing.checkpoint`."""
from __future__ import annotations

import hashlib
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron.pipeline.runtime.replicas import owned_optimizer_state
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.checkpointing.format import (
    METADATA, POINTER, CheckpointError, _read_metadata, file_checksum, iteration_dir, run_signature,
    tensor_parallel_rank)
from megatron.trainer.checkpointing.paths import rank_file_name
from megatron.trainer.checkpointing.reshard import (
    LAYOUT_FLAGS, VOCAB_FLAGS, ReshardError, ReshardPlan, check_vocab, merge_optimizer_states, plan,
    saved_signature, smallest_scale, tp_size, unchecked_flags)
from megatron.trainer.checkpointing.shards import Region, ShardError
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.models.tensor_parallel import shard_layout
from megatron.trainer.checkpointing.model_names import NamedModel


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


def check_resume(task: NamedModel, config: RunPlan, verify_files: bool = True) -> ResumePoint | None:
    """Validate ``--load`` before any rank starts; return where to resume (None: start fresh).

    A different model shape or precision, a layout change that cannot load correctly
    (:func:`megatron.trainer.checkpointing.reshard.plan`), a missing or truncated rank file, a
    rank file whose checksum differs (``verify_files``: every file, or with a layout change the
    data-parallel replica 0 files that are read; a rank checks each file it reads again in
    :func:`load_stage_state`): each is a one-line :class:`CheckpointError` naming the file.
    """
    if config.checkpoint.load is None:
        return None
    point = find_resume_point(config.checkpoint.load)
    if point is None:
        return None
    metadata = _read_metadata(point.directory)
    path = point.directory / METADATA
    saved, ours = saved_signature(metadata), run_signature(task, config)
    try:
        vocab_padding = check_vocab(saved, ours, str(path))
    except ReshardError as exc:
        raise CheckpointError(str(exc)) from None
    if saved.get("imported_from") and not config.checkpoint.finetune:
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
            reshard = plan(metadata, ours, config, str(path))
        except ReshardError as exc:
            raise CheckpointError(str(exc)) from None
    _check_sharded_optimizer(metadata, config, str(path))
    checksums = metadata.get("sha256", {})
    if verify_files:
        read = None if reshard is None else reshard.files_read(config.parallel.data_parallel_size, tp_size(ours))
        for name, expected in checksums.items():
            if read is None or name in read:
                _verify_checksum(point.directory / name, file_checksum(point.directory / name), expected)
    if point.iteration >= config.training.train_iters and not config.checkpoint.finetune:
        raise CheckpointError(f"checkpoint {point.directory} is at iteration {point.iteration}, "
                              f"not before --train-iters {config.training.train_iters}: nothing left to train")
    keeps_order = reshard is None or (reshard.keeps_rank_state and reshard.same_schedule)
    return ResumePoint(point.iteration, point.directory, checksums,
                       metadata.get("schedule_state") if keeps_order else None, reshard)



def check_resume_or_exit(task: NamedModel, config: RunPlan, verify_files: bool = True) -> ResumePoint | None:
    """``--load``'s checkpoint, validated (one line and exit 2 if it does not fit this run)."""
    try:
        return check_resume(task, config, verify_files)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)

def _check_sharded_optimizer(metadata: dict[str, Any], config: RunPlan, where: str) -> None:
    """Optimizer shards (files of AMDP or --use-distributed-optimizer written before their saves
    gathered the shards) load only into a run that shards its optimizer state the same way (a
    whole state, by contrast, is sliced into either)."""
    if config.checkpoint.no_load_optim or config.checkpoint.finetune:
        return
    sharded_run = config.run.shards_optimizer_state or (
        config.parallel.use_distributed_optimizer and config.parallel.data_parallel_size > 1)
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


def load_stage_state(task: NamedModel, worker: StageWorker, point: ResumePoint, dp_rank: int,
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


def _load_resharded(task: NamedModel, worker: StageWorker, point: ResumePoint, dp_rank: int,
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
