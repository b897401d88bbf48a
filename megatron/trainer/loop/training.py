"""The pretraining driver: flags -> stages -> schedule -> executor -> logs.

``pretrain(task, argv)`` validates every flag first, then either runs all stages in this
process (``--pipeline-executor emulator``), runs this rank's stage (under torchrun or our
launcher), or starts one process per rank on this machine (:mod:`megatron.trainer.launch.local`).
Run assembly lives beside this module: :mod:`.workers` (a stage's worker), :mod:`.ranks`
(process group and transport), :mod:`.run_start` (resume, banner, logger, schedule, plan),
:mod:`.segments` and :mod:`.runners` (the loop).
"""
from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.pipeline.runtime.executors.common import ReportCadence
from megatron.pipeline.runtime.executors.errors import PipelineRuntimeError
from megatron.pipeline.runtime.profiling import log_fixed_choice
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.transport.in_process import InProcessTransport
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.config.job_config import JobConfig
from megatron.trainer.launch import flight_recorder
from megatron.trainer.launch.exit_control import StopControl, Terminated, rank_signal_defaults, stop_control
from megatron.trainer.launch.host import prepare_host, resolve_device
from megatron.trainer.launch.launcher import is_worker_process
from megatron.trainer.launch.local import enter_process, launch_ranks
from megatron.trainer.launch.preflight import check_launch, check_resume_or_exit, refused_in_one_line
from megatron.trainer.launch.schedule_check import check_schedule
from megatron.trainer.launch.python_gc import CollectorPolicy
from megatron.trainer.loop.logger import ReportCollector
from megatron.trainer.loop.rampup import segment_schedules
from megatron.trainer.loop.ranks import _init_megatron_parallel_state, fail, init_rank_process_group, rank_transport
from megatron.trainer.loop.run_start import make_logger, on_logged, resume_workers, run_plan, run_schedule, start_banner
from megatron.trainer.loop.runners import PipelineRunner
from megatron.trainer.loop import auto
from megatron.trainer.loop.segments import run_segments
from megatron.trainer.loop.workers import build_worker, dump_parameters, local_workers, print_drift_histograms
from megatron.trainer.tasks.auto_partition import apply_auto_partition
from megatron.trainer.tasks.task import PretrainTask

__all__ = ["build_worker", "drive", "emulate", "preflight", "prepare_host", "pretrain", "rank_transport",
           "run_distributed", "_init_megatron_parallel_state"]


def drive(task: PretrainTask, config: JobConfig, transport: Transport, device: torch.device,
          stop: StopControl | None,
          make_transport: Callable[[JobConfig], Transport] | None = None) -> list[StageWorker]:
    """Train the transport's local stages: workers, resume, banner, logger, schedule, segments,
    summary and dumps; the same for the emulator and every rank of the runtime. Returns the
    local stage workers (weights, statistics). ``make_transport``: a transport for another
    layout of the same processes, where ``auto`` may rebuild the stages (:mod:`.relayout`)."""
    resume = check_resume_or_exit(task, config, verify_files=False)  # each process verifies the files it loads
    workers = local_workers(task, config, transport, device)
    start = resume_workers(task, config, workers, transport.dp_rank, resume, say=transport.is_coordinator)
    start_banner(config, transport, workers)
    coordinator = transport.is_coordinator
    logger = make_logger(config, start, task) if coordinator else None
    logged = on_logged(config, start, logger) if logger else None
    schedule = run_schedule(config, start, resume)
    cadence = ReportCadence(config.logging.log_interval, final_update=config.training.train_iters - 1)
    if coordinator:
        log_fixed_choice(schedule)
    gc_policy = CollectorPolicy.from_args(config, freeze_startup=not transport.in_process)
    say = (lambda line: print(line, flush=True)) if coordinator else (lambda line: None)
    rebuilds = auto.Rebuilds(task, device, make_transport) if make_transport else None
    boundary = rebuilds.boundary(schedule, start, config.training.train_iters) if rebuilds else None
    segments = run_plan(config, start, () if boundary is None else (boundary,))

    def runner_for(transport: Transport, config: JobConfig, workers: list[StageWorker]) -> PipelineRunner:
        if stop is not None:
            stop.agree = transport.all_max
        sink = transport.report_sink(ReportCollector(transport.num_reporters, logged) if logged else None)
        return PipelineRunner(task, config, transport, workers, cadence, sink, gc_policy)

    with gc_policy.training():
        runner = runner_for(transport, config, workers)
        while segments:
            now = [s for s in segments if boundary is None or s.end <= boundary]
            last = run_segments(schedule, now, runner, logger, say=say, stop=stop,
                                schedule_for=segment_schedules(config, schedule, workers))
            segments, boundary = segments[len(now):], None
            if last is None:
                break
            schedule = last
            rebuilt = rebuilds.after_segment(auto.Stages(config, transport, workers, schedule), runner,
                                             now[-1].end, say) if rebuilds and segments else None
            if rebuilt is not None:  # auto decided to rebuild the stages in another layout
                config, transport, workers, schedule = rebuilt.config, rebuilt.transport, rebuilt.workers, \
                    rebuilt.schedule
                runner = runner_for(transport, config, workers)
    transport.flush()
    if logger:
        logger.log_summary()
        logger.close()
    if config.logging.log_weight_version_drift and transport.dp_rank == 0 and transport.tp_rank == 0:
        print_drift_histograms(workers)
    if config.logging.dump_final_params and transport.dp_rank == 0:
        for w in workers:
            dump_parameters(task, w, config.logging.dump_final_params, transport.tp_rank)
    return workers


def emulate(task: PretrainTask, config: JobConfig) -> list[StageWorker]:
    """Train all stages in this process; return the stage workers (weights, statistics)."""
    config = prepare_host(config, 1)
    stop = stop_control(config, decides_time=True)  # --exit-signal-handler: the handler goes in first
    if not dist.is_initialized():
        flight_recorder.disable_unless_requested()
        # One process: an in-memory store, no port (a probed free port can be taken by another
        # process before the store binds it: two emulator runs at once failed with EADDRINUSE).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(minutes=config.launch.distributed_timeout_minutes))
    if getattr(task, "uses_megatron_core", True):  # the synthetic-cost benchmark task does not
        _init_megatron_parallel_state()
    device = resolve_device(config, 0)
    config = apply_auto_partition(task, config, device)  # --pipeline-partition auto: profile, then split
    try:
        return drive(task, config, InProcessTransport(config.run.layout), device, stop,
                     make_transport=lambda c: InProcessTransport(c.run.layout))
    finally:
        if stop is not None:
            stop.restore()


def run_distributed(task: PretrainTask, config: JobConfig) -> int:
    """This rank's stage: process group, transport, then :func:`drive`; exit code 0 (a failure
    ends the process at once, naming the stage)."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    rank_signal_defaults(config)
    stop = stop_control(config, decides_time=rank == 0)  # the handler goes in before the rendezvous
    config = prepare_host(config, int(os.environ.get("LOCAL_WORLD_SIZE", config.parallel.world_size)), local_rank)
    device = resolve_device(config, local_rank)
    init_rank_process_group(config, device, rank)
    config, groups, transport = rank_transport(task, config, device)
    try:
        drive(task, config, transport, device, stop, make_transport=lambda c: rank_transport(task, c, device)[2])
    except PipelineRuntimeError as exc:
        fail(f"[megatron-async] error: {exc}")
    except Terminated as exc:  # outside the pipeline: between segments, saving, evaluating
        fail(f"[megatron-async] error: stage {groups.stage} (rank {rank}): {exc}")
    except Exception as exc:  # noqa: BLE001 - any failure must end this rank, not hang it
        traceback.print_exc()
        fail(f"[megatron-async] error: stage {groups.stage} (rank {rank}): {type(exc).__name__}: {exc}")
    dist.barrier(group=groups.reports)
    dist.destroy_process_group()
    return 0


def preflight(task: PretrainTask, argv: list[str]) -> JobConfig:
    """Every up-front check and decision of a launch, before any rank starts: the launch's
    checks (:func:`~megatron.trainer.launch.preflight.check_launch`), ``auto``'s plan
    (:func:`megatron.trainer.loop.auto.plan`), then a replay of the schedule's first iterations;
    exits with status 2 and one ``error:`` line on the first problem."""
    config, flags = check_launch(task, argv)
    with refused_in_one_line():  # a schedule that deadlocks, or auto's choice that cannot run
        config = auto.plan(task, config, flags)
        check_schedule(config)
    return config


def pretrain(task: PretrainTask, argv: list[str] | None = None, script: str | None = None) -> int:
    """Entry point of ``pretrain_*.py``; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    code = enter_process()
    if code is not None:
        return code
    config = preflight(task, argv)  # a rank our launcher started: the launcher's config, argv unread
    if config.schedule.pipeline_executor == "emulator":
        emulate(task, config)
        return 0
    if is_worker_process():
        return run_distributed(task, config)
    if config.parallel.world_size == 1 and not config.launch.max_restarts:  # one rank, nothing to restart: run it here
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        return run_distributed(task, config)
    return launch_ranks(config, [script or sys.argv[0], *argv], lambda: run_distributed(task, config))
