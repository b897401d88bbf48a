"""What a run does before its first segment, the same in the emulator and on every rank:
resume from ``--load``, the start banner, the logger (and the restart record), the schedule
from the first iteration and the plan of segments (:func:`start_run`, all of it in order)."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

from megatron.pipeline.runtime.executors.common import ReportCadence
from megatron.pipeline.runtime.profiling import log_fixed_choice
from megatron.pipeline.runtime.report import StageReport
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.worker import StageWorker
from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.schedules.base import Schedule
from megatron.trainer.checkpointing.checkpoint import ResumePoint, load_stage_state
from megatron.trainer.config.exit_args import exit_check_every
from megatron.trainer.config.run_plan import RunPlan, restore_schedule_state
from megatron.trainer.config.tied_args import embeddings_record
from megatron.trainer.config.megatron_compat_args import flops_per_iteration, wandb_run
from megatron.trainer.launch.python_gc import CollectorPolicy
from megatron.trainer.loop.logger import TrainingLogger
from megatron.trainer.loop.rampup import segment_boundaries
from megatron.trainer.loop.restart_report import ProgressRecord, read_progress, restart_line
from megatron.trainer.loop.run_banner import print_banner
from megatron.trainer.loop.segments import Segment, plan_segments
from megatron.trainer.loop.workers import stage_parameter_count
from megatron.trainer.tasks.task import PretrainTask


def resume_workers(task: PretrainTask, config: RunPlan, workers: list[StageWorker], dp_rank: int,
            point: ResumePoint | None, say: bool = True) -> int:
    """Load ``point`` into ``workers``; return the iteration training starts at.

    ``--no-load-optim``: weights, RNG and iteration, a fresh optimizer (and with it a fresh LR
    schedule, which counts the optimizer's updates). ``--finetune``: weights only, iteration 0.
    """
    if point is None:
        return 0
    fresh_optimizer = config.checkpoint.no_load_optim or config.checkpoint.finetune
    for w in workers:
        load_stage_state(task, w, point, dp_rank, optimizer=not fresh_optimizer, rng=not config.checkpoint.finetune)
    start = 0 if config.checkpoint.finetune else point.iteration
    if say:  # the logging rank (not every TP rank of stage 0)
        fresh = " (weights only, from iteration 0)" if config.checkpoint.finetune else \
            " (fresh optimizer and LR schedule)" if config.checkpoint.no_load_optim else ""
        print(f"[megatron-async] resumed from {point.directory} at iteration {point.iteration}{fresh}", flush=True)
    return start


def start_banner(config: RunPlan, transport: Transport, workers: list[StageWorker]) -> None:
    """The run's first lines, with every stage's parameter count (gathered: a rank has one stage)."""
    tp_size = config.run.tensor_parallel_size
    counts = transport.gather_rows({w.stage: [stage_parameter_count(w, tp_size)] for w in workers})
    if transport.is_coordinator:
        per_stage = {s: int(n) for s, (n,) in reversed(counts)}  # data-parallel replicas agree
        print_banner(config, [per_stage[s] for s in sorted(per_stage)], transport.describe(), sys.stdout)


def make_logger(config: RunPlan, start_iteration: int = 0, task: PretrainTask | None = None) -> TrainingLogger:
    return TrainingLogger(
        num_stages=config.parallel.pipeline_model_parallel_size,
        train_iters=config.training.train_iters,
        samples_per_iteration=config.training.global_batch_size,
        tokens_per_iteration=config.training.global_batch_size * config.model.seq_length,
        log_drift=config.logging.log_weight_version_drift,
        json_path=config.logging.log_json,
        start_iteration=start_iteration,
        tensorboard_dir=config.logging.tensorboard_dir,
        samples_before=config.batch.consumed_before,
        flops_per_sample=flops_per_iteration(config, 1) if config.logging.log_throughput else 0.0,
        num_gpus=config.parallel.world_size,
        log_params_norm=config.logging.log_params_norm,
        log_activation_memory=config.logging.log_activation_memory,
        wandb=wandb_run(config),
        per_stage_optimizer=config.run.asynchronous,
        aux_loss_name=task.aux_loss_name,
        embeddings=embeddings_record(config),
    )


def on_logged(config: RunPlan, start: int,
               logger: TrainingLogger) -> Callable[[int, list[StageReport]], None]:
    """The logging rank's per-update callback: the logger, and with ``--save`` the progress
    record a restart reads to say how many iterations it lost (after saying it, if this is one)."""
    if config.checkpoint.save is None:
        return logger.log_update
    line = restart_line(start, read_progress(config.checkpoint.save))
    if line is not None:
        print(line, flush=True)
    progress = ProgressRecord(config.checkpoint.save)
    progress.record(start)  # a dead attempt that logged nothing lost nothing after `start`

    def log_and_record(update: int, reports: list[StageReport]) -> None:
        logger.log_update(update, reports)
        progress(update, reports)
    return log_and_record


def run_schedule(config: RunPlan, start: int, resume: ResumePoint | None = None) -> Schedule:
    """The run's schedule from iteration ``start`` (0, or a checkpoint's iteration) to the end,
    with what the checkpoint's run decided (zb's profiled order) restored; a resumed run starts its
    schedule at the checkpoint's iteration."""
    training = config.training
    run = config.run
    if start == 0:
        schedule = run.run_schedule(config.schedule.pipeline_schedule).segment(0, training.train_iters)
    else:
        resumed = dataclasses.replace(run.schedule, first_iteration=start, num_iterations=training.train_iters - start)
        schedule = build_schedule(config.schedule.pipeline_schedule, resumed)
    restore_schedule_state(schedule, resume.schedule_state if resume is not None else None)
    return schedule


def run_plan(config: RunPlan, start: int, boundaries: tuple[int, ...] = ()) -> list[Segment]:
    """The run's segments from ``start``; ``boundaries``: iterations a segment must also end at."""
    training, checkpoint, stops = config.training, config.checkpoint, config.exit
    return plan_segments(start, training.train_iters, training.eval_interval, checkpoint.save_interval, stops.exit_interval,
                         saving=checkpoint.save is not None, check_interval=exit_check_every(config),
                         boundaries={*segment_boundaries(config), *boundaries})


@dataclass
class RunStart:
    """Where a run stands before its first segment: the iteration it starts at, the logger and
    its per-update callback (None on ranks that do not log), the schedule and the segments, the
    report cadence, the garbage collector's policy and where this process's lines go."""

    start: int
    logger: TrainingLogger | None
    logged: Callable[[int, list[StageReport]], None] | None
    schedule: Schedule
    segments: list[Segment]
    #: the iteration the first segments end at for ``auto``'s decision (None: none)
    boundary: int | None
    cadence: ReportCadence
    gc_policy: CollectorPolicy
    #: prints a line on the coordinator, nothing elsewhere
    say: Callable[[str], None]


def start_run(task: PretrainTask, config: RunPlan, transport: Transport, workers: list[StageWorker],
              resume: ResumePoint | None,
              boundary: Callable[[Schedule, int, int], int | None] | None = None) -> RunStart:
    """Resume ``workers`` from ``resume``, print the banner, make the logger (the coordinator's),
    build the schedule from the start (its decision logged where fixed costs made it) and plan the
    segments, with the report cadence and the collector's policy; ``boundary(schedule, start, end)``: an iteration a segment must also end at (where
    ``auto`` may rebuild)."""
    coordinator = transport.is_coordinator
    start = resume_workers(task, config, workers, transport.dp_rank, resume, say=coordinator)
    start_banner(config, transport, workers)
    logger = make_logger(config, start, task) if coordinator else None
    logged = on_logged(config, start, logger) if logger else None
    schedule = run_schedule(config, start, resume)
    if coordinator:
        log_fixed_choice(schedule)
    end = boundary(schedule, start, config.training.train_iters) if boundary is not None else None
    segments = run_plan(config, start, () if end is None else (end,))
    cadence = ReportCadence(config.logging.log_interval, final_update=config.training.train_iters - 1)
    gc_policy = CollectorPolicy.from_args(config, freeze_startup=not transport.in_process)
    say = (lambda line: print(line, flush=True)) if coordinator else (lambda line: None)
    return RunStart(start, logger, logged, schedule, segments, end, cadence, gc_policy, say)
