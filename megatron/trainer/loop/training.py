"""The pretraining driver: flags -> stages -> schedule -> executor -> logs.

``pretrain(task, argv)`` validates every flag first, then either runs all stages in this
process (``--pipeline-executor emulator``), runs this rank's stage (under torchrun or our
launcher), or spawns one process per rank on this machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.pipeline.runtime.executors.common import ReportCadence
from megatron.pipeline.runtime.executors.errors import PipelineRuntimeError
from megatron.pipeline.runtime.report import StageReport
from megatron.pipeline.ir import MultiPipelineLayout
from megatron.pipeline.runtime.parallel import RankLayout, StageGroups
from megatron.pipeline.runtime.tied_embeddings import counted
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.transport.distributed import DistributedTransport
from megatron.pipeline.runtime.transport.in_process import InProcessTransport
from megatron.pipeline.runtime.profiling import log_fixed_choice
from megatron.pipeline.runtime.replicas import optimizer_shards
from megatron.trainer.optim.data_parallel import shard_over_data_parallel
from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.schedules.base import Schedule
from megatron.pipeline.runtime.weight_versions import build_weight_policy
from megatron.pipeline.runtime.worker import StageSetup, StageWorker
from megatron.trainer.tasks.auto_partition import apply_auto_partition
from megatron.trainer.config.arguments import build_parser, parse_args
from megatron.trainer.config.ddp_args import overlap_bucket_size
from megatron.trainer.config.run_config import run_config
from megatron.trainer.launch.exit_control import StopControl, launcher_signals, rank_signal_defaults, stop_control
from megatron.trainer.checkpointing.checkpoint import (
    CheckpointError, ResumePoint, check_resume, load_stage_state, restore_schedule_state)
from megatron.trainer.launch.core_binding import bind_cores
from megatron.trainer.launch.host_allocator import apply_host_malloc
from megatron.trainer.launch.python_gc import CollectorPolicy
from megatron.trainer.launch.launcher import grace_for, is_worker_process, launch_local
from megatron.trainer.launch.memory_check import MemoryCheckError, check_memory
from megatron.trainer.launch.schedule_check import ScheduleCheckError, check_schedule
from megatron.trainer.launch.auto_memory import apply_auto_memory_limit
from megatron.trainer.config.errors import ArgumentError
from megatron.trainer.loop.logger import ReportCollector, TrainingLogger
from megatron.trainer.loop.restart_report import ProgressRecord, read_progress, restart_line
from megatron.trainer.loop.segments import Segment, plan_segments, run_segments
from megatron.trainer.loop.run_banner import print_banner
from megatron.trainer.optim.lr_schedule import LRSchedule
from megatron.trainer.config.mixed_precision_args import loss_scale_config
from megatron.pipeline.runtime.loss_scaling import StageLossScaler
from megatron.trainer.optim.registry import build_optimizer
from megatron.trainer.launch.process_guard import guard_rank_process
from megatron.trainer.launch.rendezvous import rank_store
from megatron.trainer.launch.slurm_env import SlurmEnvironmentError, adopt_slurm_task_environment
from megatron.trainer.config.megatron_compat_args import flops_per_iteration, wandb_run
from megatron.trainer.loop.rampup import segment_boundaries, segment_schedules
from megatron.trainer.launch import flight_recorder
from megatron.trainer.loop.runners import PipelineRunner
from megatron.trainer.tasks.task import PretrainTask
from megatron.trainer.models.tensor_parallel import (
    build_tensor_parallel_stage, full_shape, gather_full, initialize_tensor_parallel, shard_layout)


def uses_cuda(args: argparse.Namespace) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def resolve_device(args: argparse.Namespace, local_rank: int) -> torch.device:
    if uses_cuda(args):
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_host(args: argparse.Namespace, local_processes: int, local_rank: int = 0) -> None:
    """This process's cores, CPU threads and host allocator policy, before any model is built
    (and before any thread starts: threads inherit the core binding)."""
    args.core_binding_effect = bind_cores(args.bind_cores, not uses_cuda(args), local_rank, local_processes)
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_processes))
    torch.set_num_threads(threads)
    args.host_malloc_effect = apply_host_malloc(args.host_malloc)  # shown in the banner


def build_worker(task: PretrainTask, args: argparse.Namespace, stage: int, dp_rank: int,
                 device: torch.device, isolate_rng: bool) -> StageWorker:
    chunks = build_tensor_parallel_stage(task, args, stage, device)
    run = run_config(args)
    layout = run.layout
    if len(chunks) != layout.num_chunks:
        raise ValueError(f"task {task.name} built {len(chunks)} model chunks for stage {stage}, "
                         f"the pipeline layout has {layout.num_chunks}")
    named = list(task.named_parameters(chunks))
    shards = None
    if run.shards_optimizer_state:
        assert isinstance(layout, MultiPipelineLayout)
        shards = optimizer_shards(layout, chunks, named)
    optimizer = shard_over_data_parallel(args, named, stage, dp_rank) or build_optimizer(args, named, stage, shards)
    schedule = LRSchedule(
        max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters,
        decay_steps=args.lr_decay_iters, decay_style=args.lr_decay_style,
        wsd_decay_steps=args.lr_wsd_decay_iters or 0, wsd_decay_style=args.lr_wsd_decay_style,
    )
    shape, dtype = task.activation_spec(args)
    # Asynchronous variants shape what a stage's passes read and its learning rate (2BW, PipeMare).
    schedule_cls, config = run.schedule_cls, run.schedule
    setup = StageSetup(
        stage=stage,
        layout=layout,
        chunks=chunks,
        optimizer=optimizer,
        lr_schedule=schedule_cls.stage_lr_schedule(config, stage, schedule),
        microbatches_per_update=args.num_microbatches,
        batch_fn=task.batch_fn(args, dp_rank, device),
        loss_fn=task.loss_fn,
        activation_shape=shape,
        activation_dtype=dtype,
        device=device,
        clip_grad=args.clip_grad,
        seed=args.seed,
        inject_nonfinite_updates=frozenset(args.nonfinite_injections.get(stage, ())),
        inject_nonfinite_losses=frozenset(getattr(args, "inject_nonfinite_loss", ())),
        weight_policy=build_weight_policy(schedule_cls.stage_weight_policy(config, stage), optimizer),
        loss_scaler=_loss_scaler(args, schedule_cls.asynchronous),
        report_params_norm=args.log_params_norm,
        measure_activations=args.log_activation_memory,
        aux_loss_fn=getattr(task, "aux_loss_fn", None),
        tp_group=_tensor_parallel_group(run.tensor_parallel_size),
    )
    return StageWorker(setup, isolate_rng=isolate_rng)


def _tensor_parallel_group(tp_size: int) -> dist.ProcessGroup | None:
    """megatron's TP group of this rank (set by :func:`initialize_tensor_parallel`); None at TP = 1."""
    if tp_size == 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _loss_scaler(args: argparse.Namespace, asynchronous: bool) -> StageLossScaler | None:
    """``--fp16``: the stage's scaler, pipeline-wide for synchronous schedules, stage-local otherwise."""
    config = loss_scale_config(args, asynchronous)
    return None if config is None else StageLossScaler(config)


def make_logger(args: argparse.Namespace, start_iteration: int = 0, task: PretrainTask | None = None) -> TrainingLogger:
    return TrainingLogger(
        num_stages=args.pipeline_model_parallel_size,
        train_iters=args.train_iters,
        samples_per_iteration=args.global_batch_size,
        tokens_per_iteration=args.global_batch_size * args.seq_length,
        log_drift=args.log_weight_version_drift,
        json_path=args.log_json,
        start_iteration=start_iteration,
        tensorboard_dir=args.tensorboard_dir,
        samples_before=args.batch_plan.consumed_before,
        flops_per_sample=flops_per_iteration(args, 1) if args.log_throughput else 0.0,
        num_gpus=args.world_size,
        log_params_norm=args.log_params_norm,
        log_activation_memory=args.log_activation_memory,
        wandb=wandb_run(args),
        per_stage_optimizer=run_config(args).asynchronous,
        aux_loss_name=getattr(task, "aux_loss_name", None),
    )


def stage_parameter_count(worker: StageWorker, tp_size: int = 1) -> int:
    """Parameters of one stage (all its model chunks), for the start banner: of the whole
    stage, a TP shard counted at its full (unsharded) size."""
    return sum(full_shape(p.shape, shard_layout(p), tp_size).numel()
               for p in counted(p for chunk in worker.setup.chunks for p in chunk.parameters()))  # a tied embedding once


def run_schedule(args: argparse.Namespace, start: int, resume: ResumePoint | None = None) -> Schedule:
    """The run's schedule from iteration ``start`` (0, or a checkpoint's iteration) to the end,
    with what the checkpoint's run decided (zb's profiled order) restored."""
    config = dataclasses.replace(run_config(args).schedule, first_iteration=start, num_iterations=args.train_iters - start)
    schedule = build_schedule(args.pipeline_schedule, config)
    restore_schedule_state(schedule, resume)
    return schedule


def run_plan(args: argparse.Namespace, start: int) -> list[Segment]:
    return plan_segments(start, args.train_iters, args.eval_interval, args.save_interval, args.exit_interval,
                         saving=args.save is not None, check_interval=getattr(args, "exit_check_every", None),
                         boundaries=segment_boundaries(args))


def dump_parameters(task: PretrainTask, worker: StageWorker, directory: str, tp_rank: int = 0) -> None:
    """``--dump-final-params``: the stage's full parameters (TP shards gathered: a collective
    over the TP group), written by TP rank 0."""
    group = worker.setup.tp_group
    state = {name: gather_full(p.detach(), shard_layout(p), group).cpu().clone()
             for name, p in task.named_parameters(worker.setup.chunks)}
    if tp_rank:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(state, path / f"stage{worker.stage}.pt")


def _print_drift_histograms(workers: list[StageWorker]) -> None:
    for w in workers:
        hist = ", ".join(f"{d}: {n}" for d, n in sorted(w.drift_histogram.items()))
        print(f" weight-version drift histogram, stage {w.stage}: {{{hist}}}", flush=True)


def _init_megatron_parallel_state() -> None:
    """megatron-core modules read TP/PP sizes from its parallel state; our runtime pipelines
    by itself, so megatron sees one pipeline stage."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def drive(task: PretrainTask, args: argparse.Namespace, transport: Transport, device: torch.device,
          stop: StopControl | None) -> list[StageWorker]:
    """Train the transport's local stages: workers, resume, banner, logger, schedule, segments,
    summary and dumps; the same for the emulator and every rank of the runtime. Returns the
    local stage workers (weights, statistics)."""
    resume = check_resume_or_exit(task, args, verify_files=False)  # each process verifies the files it loads
    workers = [build_worker(task, args, s, transport.dp_rank, device, isolate_rng=transport.in_process)
               for s in transport.stages]
    for w in workers:
        transport.attach(w)  # the distributed optimizer's group, overlapped gradient buckets
    start = _resume(task, args, workers, transport.dp_rank, resume, say=transport.is_coordinator)
    _start_banner(args, transport, workers)
    coordinator = transport.is_coordinator
    logger = make_logger(args, start, task) if coordinator else None
    collector = ReportCollector(transport.num_reporters, _on_logged(args, start, logger)) if logger else None
    sink = transport.report_sink(collector)
    schedule = run_schedule(args, start, resume)
    cadence = ReportCadence(args.log_interval, final_update=args.train_iters - 1)
    if coordinator:
        log_fixed_choice(schedule)
    if stop is not None:
        stop.agree = transport.all_max
    gc_policy = CollectorPolicy.from_args(args, freeze_startup=not transport.in_process)
    with gc_policy.training():
        run_segments(schedule, run_plan(args, start),
                     PipelineRunner(task, args, transport, workers, cadence, sink, gc_policy),
                     logger, say=lambda line: print(line, flush=True) if coordinator else None, stop=stop,
                     schedule_for=segment_schedules(args, schedule, workers))
    transport.flush()
    if logger:
        logger.log_summary()
        logger.close()
    if args.log_weight_version_drift and transport.dp_rank == 0 and transport.tp_rank == 0:
        _print_drift_histograms(workers)
    if args.dump_final_params and transport.dp_rank == 0:
        for w in workers:
            dump_parameters(task, w, args.dump_final_params, transport.tp_rank)
    return workers


def _on_logged(args: argparse.Namespace, start: int,
               logger: TrainingLogger) -> Callable[[int, list[StageReport]], None]:
    """The logging rank's per-update callback: the logger, and with ``--save`` the progress
    record a restart reads to say how many iterations it lost (after saying it, if this is one)."""
    if args.save is None:
        return logger.log_update
    line = restart_line(start, read_progress(args.save))
    if line is not None:
        print(line, flush=True)
    progress = ProgressRecord(args.save)
    progress.record(start)  # a dead attempt that logged nothing lost nothing after `start`

    def log_and_record(update: int, reports: list[StageReport]) -> None:
        logger.log_update(update, reports)
        progress(update, reports)
    return log_and_record


def _start_banner(args: argparse.Namespace, transport: Transport, workers: list[StageWorker]) -> None:
    """The run's first lines, with every stage's parameter count (gathered: a rank has one stage)."""
    tp_size = run_config(args).tensor_parallel_size
    counts = transport.gather_rows({w.stage: [stage_parameter_count(w, tp_size)] for w in workers})
    if transport.is_coordinator:
        per_stage = {s: int(n) for s, (n,) in reversed(counts)}  # data-parallel replicas agree
        print_banner(args, [per_stage[s] for s in sorted(per_stage)], transport.describe(), sys.stdout)


def emulate(task: PretrainTask, args: argparse.Namespace) -> list[StageWorker]:
    """Train all stages in this process; return the stage workers (weights, statistics)."""
    prepare_host(args, 1)
    stop = stop_control(args, decides_time=True)  # --exit-signal-handler: the handler goes in first
    if not dist.is_initialized():
        flight_recorder.disable_unless_requested()
        # One process: an in-memory store, no port (a probed free port can be taken by another
        # process before the store binds it: two emulator runs at once failed with EADDRINUSE).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(minutes=args.distributed_timeout_minutes))
    if getattr(task, "uses_megatron_core", True):  # the synthetic-cost benchmark task does not
        _init_megatron_parallel_state()
    device = resolve_device(args, 0)
    apply_auto_partition(task, args, device)  # --pipeline-partition auto: profile, then split
    try:
        return drive(task, args, InProcessTransport(run_config(args).layout), device, stop)
    finally:
        if stop is not None:
            stop.restore()


def rank_transport(task: PretrainTask, args: argparse.Namespace,
                   device: torch.device) -> tuple[StageGroups, DistributedTransport]:
    """This rank's groups and transport on the initialised default process group (collective:
    every rank calls it). A process may call it again for another run of the same world."""
    layout = RankLayout(args.pipeline_model_parallel_size, args.data_parallel_size, args.tensor_model_parallel_size)
    # Stage-level collectives (sync optimizer step, DP all-reduce, statistics) fail as fast as
    # a point-to-point receive does: a hung peer must not stall the others for 10 minutes.
    p2p_timeout = timedelta(seconds=args.pipeline_timeout_seconds)
    stage_layout = run_config(args).layout  # P2P groups per link direction; AMDP's replica groups
    groups = StageGroups.create(layout, p2p_timeout, stage_layout, tied_embeddings=args.tie_embeddings)
    if getattr(task, "uses_megatron_core", True):  # the synthetic-cost benchmark task does not
        # megatron's TP groups (T consecutive ranks, its pipeline size 1) are this layout's.
        initialize_tensor_parallel(args.tensor_model_parallel_size)
        if device.type == "cpu":  # its advice on CUDA streams (TP linears) means nothing on a CPU
            warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
    apply_auto_partition(task, args, device)  # --pipeline-partition auto: rank 0 profiles and decides for all
    return groups, DistributedTransport(groups, stage_layout, p2p_timeout, overlap_bucket_size(args))


def run_distributed(task: PretrainTask, args: argparse.Namespace) -> int:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    rank_signal_defaults(args)
    stop = stop_control(args, decides_time=rank == 0)  # the handler goes in before the rendezvous
    prepare_host(args, int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size)), local_rank)
    device = resolve_device(args, local_rank)
    backend = args.distributed_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    flight_recorder.disable_unless_requested()  # its ring grew the logging rank's heap by ~1 MB
    device_id = device if device.type == "cuda" else None
    if int(os.environ["WORLD_SIZE"]) == 1:  # one rank: an in-memory store, no port to collide on
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device_id)
    else:  # a store namespace of this restart attempt's own (megatron.trainer.launch.rendezvous)
        dist.init_process_group(backend, store=rank_store(rank, int(os.environ["WORLD_SIZE"]), timeout),
                                rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout,
                                device_id=device_id)
    groups, transport = rank_transport(task, args, device)
    try:
        drive(task, args, transport, device, stop)
    except PipelineRuntimeError as exc:
        _fail(f"[megatron-async] error: {exc}")
    except Exception as exc:  # noqa: BLE001 - any failure must end this rank, not hang it
        traceback.print_exc()
        _fail(f"[megatron-async] error: stage {groups.stage} (rank {rank}): {type(exc).__name__}: {exc}")
    dist.barrier(group=groups.reports)
    dist.destroy_process_group()
    return 0


def check_resume_or_exit(task: PretrainTask, args: argparse.Namespace,
                         verify_files: bool = True) -> ResumePoint | None:
    """``--load``'s checkpoint, validated (one line and exit 2 if it does not fit this run)."""
    try:
        return check_resume(task, args, verify_files)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def _resume(task: PretrainTask, args: argparse.Namespace, workers: list[StageWorker], dp_rank: int,
            point: ResumePoint | None, say: bool = True) -> int:
    """Load ``point`` into ``workers``; return the iteration training starts at.

    ``--no-load-optim``: weights, RNG and iteration, a fresh optimizer (and with it a fresh LR
    schedule, which counts the optimizer's updates). ``--finetune``: weights only, iteration 0.
    """
    if point is None:
        return 0
    fresh_optimizer = args.no_load_optim or args.finetune
    for w in workers:
        load_stage_state(task, w, point, dp_rank, optimizer=not fresh_optimizer, rng=not args.finetune)
    start = 0 if args.finetune else point.iteration
    if say:  # the logging rank (not every TP rank of stage 0)
        fresh = " (weights only, from iteration 0)" if args.finetune else \
            " (fresh optimizer and LR schedule)" if args.no_load_optim else ""
        print(f"[megatron-async] resumed from {point.directory} at iteration {point.iteration}{fresh}", flush=True)
    return start


def _fail(message: str) -> None:
    """Exit this rank now: a clean shutdown could wait forever on a dead peer."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def preflight(task: PretrainTask, argv: list[str]) -> argparse.Namespace:
    """Every up-front check of a launch: flags, data, tokenizer, paths, (outside a rank) the
    checkpoint's files, the memory estimate and a replay of the schedule's first iterations;
    exits with status 2 and one ``error:`` line on the first problem."""
    parser = build_parser(f"Megatron-Async {task.name} pretraining")
    task.add_arguments(parser)
    args = parse_args(argv, parser)
    if not is_worker_process():  # a bad checkpoint fails here, before any rank starts
        check_resume_or_exit(task, args)
    try:  # a run that cannot fit memory, or whose schedule deadlocks: refused here, not inside a rank
        check_memory(args, is_worker_process(), not _runs_on_cpu(args))
        apply_auto_memory_limit(args)  # auto: the memory left after the check bounds its choice
        check_schedule(args)
    except (MemoryCheckError, ScheduleCheckError, ArgumentError) as exc:
        parser.exit(2, f"error: {exc}\n")
    return args


def pretrain(task: PretrainTask, argv: list[str] | None = None, script: str | None = None) -> int:
    """Entry point of ``pretrain_*.py``; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        adopt_slurm_task_environment()  # srun, one task per GPU: each task is a rank
    except SlurmEnvironmentError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if is_worker_process():
        guard_rank_process()  # dies with our launcher or torchrun's agent
    args = preflight(task, argv)
    if args.pipeline_executor == "emulator":
        emulate(task, args)
        return 0
    if is_worker_process():
        return run_distributed(task, args)
    if args.world_size == 1 and not args.max_restarts:  # one rank, nothing to restart: run it here
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        return run_distributed(task, args)
    # CPU ranks are forked from here (imports already paid); GPU ranks start fresh processes.
    target = (lambda: run_distributed(task, args)) if _runs_on_cpu(args) else None
    return launch_local(args.world_size, [script or sys.argv[0], *argv], grace_for(args.pipeline_timeout_seconds),
                        target=target, forward_signals=launcher_signals(args), max_restarts=args.max_restarts)


def _runs_on_cpu(args: argparse.Namespace) -> bool:
    """Whether this run will use the CPU, asked without creating a CUDA context (fork-safe)."""
    if args.device != "auto":
        return args.device == "cpu"
    previous = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # NVML query: does not initialise CUDA
    try:
        return not torch.cuda.is_available()
    finally:
        if previous is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = previous
