"""A rank's process group, stage groups and transport (the runtime's; the emulator needs none)."""
from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.pipeline.runtime.parallel import RankLayout, StageGroups
from megatron.pipeline.runtime.transport.distributed import DistributedTransport
from megatron.trainer.config.job_config import JobConfig
from megatron.trainer.launch import flight_recorder
from megatron.trainer.launch.rendezvous import rank_store
from megatron.trainer.models.tensor_parallel import initialize_tensor_parallel
from megatron.trainer.tasks.auto_partition import apply_auto_partition
from megatron.trainer.tasks.task import PretrainTask


def _init_megatron_parallel_state() -> None:
    """megatron-core modules read TP/PP sizes from its parallel state; our runtime pipelines
    by itself, so megatron sees one pipeline stage."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def init_rank_process_group(config: JobConfig, device: torch.device, rank: int) -> None:
    """The default process group of this rank (``--distributed-backend``, its timeout)."""
    backend = config.launch.distributed_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=config.launch.distributed_timeout_minutes)
    flight_recorder.disable_unless_requested()  # its ring grew the logging rank's heap by ~1 MB
    device_id = device if device.type == "cuda" else None
    world = int(os.environ["WORLD_SIZE"])
    if world == 1:  # one rank: an in-memory store, no port to collide on
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device_id)
    else:  # a store namespace of this restart attempt's own (megatron.trainer.launch.rendezvous)
        dist.init_process_group(backend, store=rank_store(rank, world, timeout), rank=rank, world_size=world,
                                timeout=timeout, device_id=device_id)


def rank_transport(task: PretrainTask, config: JobConfig,
                   device: torch.device) -> tuple[JobConfig, StageGroups, DistributedTransport]:
    """This rank's groups and transport on the initialised default process group (collective:
    every rank calls it), and the config with the profiled layer split where one was asked
    for. A process may call it again for another run of the same world."""
    parallel = config.parallel
    layout = RankLayout(parallel.pipeline_model_parallel_size, parallel.data_parallel_size, parallel.tensor_model_parallel_size)
    # Stage-level collectives (sync optimizer step, DP all-reduce, statistics) fail as fast as
    # a point-to-point receive does: a hung peer must not stall the others for 10 minutes.
    p2p_timeout = timedelta(seconds=config.launch.pipeline_timeout_seconds)
    stage_layout = config.run.layout  # P2P groups per link direction; AMDP's replica groups
    groups = StageGroups.create(layout, p2p_timeout, stage_layout, tied_embeddings=config.model.tie_embeddings)
    if task.uses_megatron_core:  # the synthetic-cost benchmark task does not
        # megatron's TP groups (T consecutive ranks, its pipeline size 1) are this layout's.
        initialize_tensor_parallel(parallel.tensor_model_parallel_size)
        if device.type == "cpu":  # its advice on CUDA streams (TP linears) means nothing on a CPU
            warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
    config = apply_auto_partition(task, config, device)  # --pipeline-partition auto: rank 0 profiles and decides for all
    return config, groups, DistributedTransport(groups, stage_layout, p2p_timeout)


def fail(message: str) -> None:
    """Exit this rank now: a clean shutdown could wait forever on a dead peer."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
