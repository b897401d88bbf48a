"""A process's set-up before it builds its stages: its host and device, its stop control, its
process group, stage groups and transport (:func:`rank_process`; the emulator's, all stages in
one process, :func:`emulator_process`)."""
from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.pipeline.runtime.parallel import RankLayout, StageGroups
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.transport.distributed import DistributedTransport
from megatron.pipeline.runtime.transport.in_process import InProcessTransport
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.launch import flight_recorder
from megatron.trainer.launch.exit_control import StopControl, rank_signal_defaults, stop_control
from megatron.trainer.launch.host import prepare_host, resolve_device
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


def init_rank_process_group(plan: RunPlan, device: torch.device, rank: int) -> None:
    """The default process group of this rank (``--distributed-backend``, its timeout)."""
    backend = plan.launch.distributed_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=plan.launch.distributed_timeout_minutes)
    flight_recorder.disable_unless_requested()  # its ring grew the logging rank's heap by ~1 MB
    device_id = device if device.type == "cuda" else None
    world = int(os.environ["WORLD_SIZE"])
    if world == 1:  # one rank: an in-memory store, no port to collide on
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device_id)
    else:  # a store namespace of this restart attempt's own (megatron.trainer.launch.rendezvous)
        dist.init_process_group(backend, store=rank_store(rank, world, timeout), rank=rank, world_size=world,
                                timeout=timeout, device_id=device_id)


def rank_transport(task: PretrainTask, plan: RunPlan,
                   device: torch.device) -> tuple[RunPlan, StageGroups, DistributedTransport]:
    """This rank's groups and transport on the initialised default process group (collective:
    every rank calls it), and the plan with the profiled layer split where one was asked
    for. A process may call it again for another run of the same world."""
    parallel = plan.parallel
    layout = RankLayout(parallel.pipeline_model_parallel_size, parallel.data_parallel_size, parallel.tensor_model_parallel_size)
    # Stage-level collectives (sync optimizer step, DP all-reduce, statistics) fail as fast as
    # a point-to-point receive does: a hung peer must not stall the others for 10 minutes.
    p2p_timeout = timedelta(seconds=plan.launch.pipeline_timeout_seconds)
    stage_layout = plan.run.layout  # P2P groups per link direction; AMDP's replica groups
    groups = StageGroups.create(layout, p2p_timeout, stage_layout, tied_embeddings=plan.embeddings.tied)
    if task.uses_megatron_core:  # the synthetic-cost benchmark task does not
        # megatron's TP groups (T consecutive ranks, its pipeline size 1) are this layout's.
        initialize_tensor_parallel(parallel.tensor_model_parallel_size)
        if device.type == "cpu":  # its advice on CUDA streams (TP linears) means nothing on a CPU
            warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
    plan = apply_auto_partition(task, plan, device)  # --pipeline-partition auto: rank 0 profiles and decides for all
    return plan, groups, DistributedTransport(groups, stage_layout, p2p_timeout)


@dataclass
class RankProcess:
    """What a process trains with, once set up: the plan (with what the host and a profiled
    layer split did), its device, stop control (None without an exit flag), transport, a way to
    build the transport of another layout of the same processes (``auto``'s rebuild) and, in a
    rank, its process groups (None in the emulator)."""

    plan: RunPlan
    device: torch.device
    stop: StopControl | None
    transport: Transport
    make_transport: Callable[[RunPlan], Transport]
    groups: StageGroups | None = None
    #: what a failure names (``stage 1 (rank 3)``; empty in the emulator)
    where: str = ""


def rank_process(task: PretrainTask, plan: RunPlan) -> RankProcess:
    """This rank (``RANK``, ``LOCAL_RANK``): signal defaults and the stop control (its handler
    goes in before the rendezvous), cores and threads, device, process group, transport."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    rank_signal_defaults(plan)
    stop = stop_control(plan, decides_time=rank == 0)
    plan = prepare_host(plan, int(os.environ.get("LOCAL_WORLD_SIZE", plan.parallel.world_size)), local_rank)
    device = resolve_device(plan, local_rank)
    init_rank_process_group(plan, device, rank)
    plan, groups, transport = rank_transport(task, plan, device)
    return RankProcess(plan, device, stop, transport, lambda c: rank_transport(task, c, device)[2], groups,
                       f"stage {groups.stage} (rank {rank})")


def emulator_process(task: PretrainTask, plan: RunPlan) -> RankProcess:
    """Every stage in this process: cores and threads, the stop control (``--exit-signal-handler``:
    the handler goes in first), a one-process group, device, the in-process transport."""
    plan = prepare_host(plan, 1)
    stop = stop_control(plan, decides_time=True)
    if not dist.is_initialized():
        flight_recorder.disable_unless_requested()
        # One process: an in-memory store, no port (a probed free port can be taken by another
        # process before the store binds it: two emulator runs at once failed with EADDRINUSE).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(minutes=plan.launch.distributed_timeout_minutes))
    if task.uses_megatron_core:  # the synthetic-cost benchmark task does not
        _init_megatron_parallel_state()
    device = resolve_device(plan, 0)
    plan = apply_auto_partition(task, plan, device)  # --pipeline-partition auto: profile, then split
    return RankProcess(plan, device, stop, InProcessTransport(plan.run.layout),
                       lambda c: InProcessTransport(c.run.layout))


def fail(message: str) -> None:
    """Exit this rank now: a clean shutdown could wait forever on a dead peer."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
